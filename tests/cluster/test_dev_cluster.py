"""The cluster launcher (etcd and N brokers in subprocesses) and ``ferrymq dev-cluster``.

Brokers do not act on ``--metadata`` yet (the cluster mode is being wired in), so these tests
check the processes: they start with the cluster flags, stop, die and come back; and the
command's flags and its Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ferrymq.admin.cli import cli
from ferrymq.testing import ClusterProcess
from tests.cluster.conftest import needs_etcd
from tests.helpers import free_port


def accepts(address: str) -> bool:
    """Whether something listens on ``host:port``."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), 0.5):
            return True
    except OSError:
        return False


@needs_etcd
def test_a_cluster_starts_etcd_and_brokers_and_restarts_a_killed_broker(tmp_path: Path) -> None:
    with ClusterProcess(3, tmp_path / "c", cluster="orders") as cluster:
        assert cluster.running() == {"etcd": True, "broker-1": True, "broker-2": True,
                                     "broker-3": True}
        assert cluster.etcd.healthy()
        addresses = cluster.addresses
        assert sorted(addresses) == [1, 2, 3] and len(set(addresses.values())) == 3
        assert cluster.bootstrap == ",".join(addresses[i] for i in (1, 2, 3))
        assert all(accepts(a) for a in addresses.values())
        for i, b in cluster.brokers.items():
            flags = " ".join(b.argv())
            assert f"--metadata {cluster.metadata_url} --cluster orders --broker-id {i}" in flags
            assert b.data_dir == tmp_path / "c" / f"broker-{i}" / "data"
        cluster.kill9(2)
        assert cluster.running()["broker-2"] is False
        assert not accepts(addresses[2])
        cluster.restart(2)
        assert cluster.addresses == addresses and accepts(addresses[2])
        cluster.stop()
        assert not any(cluster.running().values())
        assert not any(accepts(a) for a in addresses.values())
        assert (tmp_path / "c" / "broker-2" / "data").is_dir()  # data kept


def on_a_terminal(argv: list[str]) -> tuple[int, int]:
    """Run ``argv`` on a new pseudo-terminal, in its foreground process group, as a shell
    would: its pid and the terminal's master end."""
    pid, master = pty.fork()
    if pid == 0:  # the child: Ctrl-C must reach it even if this process ignores SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(argv[0], argv)
    return pid, master


def read_until(master: int, marker: str, timeout: float) -> str:
    """What the terminal showed until ``marker`` (or its end, or ``timeout``)."""
    seen = b""
    deadline = time.monotonic() + timeout
    while marker.encode() not in seen and time.monotonic() < deadline:
        if select.select([master], [], [], 0.1)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the terminal closed: every process on it is gone
                break
            if not chunk:
                break
            seen += chunk
    return seen.decode(errors="replace")


@needs_etcd
@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_dev_cluster_runs_until_ctrl_c_and_then_stops_everything(tmp_path: Path,
                                                                  stop: str) -> None:
    pid, master = on_a_terminal([
        sys.executable, "-m", "ferrymq.admin.cli", "dev-cluster", "--brokers", "2", "--dir",
        str(tmp_path / "dev"), "--port", "0", "--etcd-port", "0", "--flush", "async"])
    try:
        shown = read_until(master, "Ctrl-C stops everything", 60)
        etcd = re.search(r"etcd://([\d.:]+)", shown)
        bootstrap = re.search(r"bootstrap (\S+)", shown)
        assert etcd is not None and bootstrap is not None, shown
        brokers = bootstrap.group(1).split(",")
        assert accepts(etcd.group(1)) and len(brokers) == 2 and all(map(accepts, brokers))
        if stop == "ctrl-c":
            os.write(master, b"\x03")  # SIGINT to the terminal's foreground group
        else:  # a `kill`: the brokers and etcd (sessions of their own) do not get it
            os.kill(pid, signal.SIGTERM)
        shown = read_until(master, "stopped\r\n", 60)
        _, status = os.waitpid(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(master)
    assert os.waitstatus_to_exitcode(status) == 0, shown
    assert "stopping the brokers, then etcd" in shown and "exited on its own" not in shown
    assert not accepts(etcd.group(1)) and not any(map(accepts, brokers))
    for i in (1, 2):  # the brokers were stopped by the command, gracefully
        log = next((tmp_path / "dev" / f"broker-{i}").glob("broker-*.log")).read_text()
        assert "stopped cleanly" in log, log[-2000:]


@needs_etcd
def test_dev_cluster_fails_naming_a_process_that_died(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferrymq.admin.cli", "dev-cluster", "--brokers", "1", "--dir",
         str(tmp_path / "dev"), "--port", "0", "--etcd-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        etcd_port = first.split("etcd://127.0.0.1:")[1].split()[0]
        for pid in os.listdir("/proc"):  # etcd, found by its client URL
            if pid.isdigit():
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if f"http://127.0.0.1:{etcd_port}".encode() in cmdline and b"--name" in cmdline:
                    os.kill(int(pid), signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "etcd exited on its own; stopping the rest" in err


@needs_etcd
def test_dev_cluster_opens_kafka_ports_when_asked(tmp_path: Path) -> None:
    kafka = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferrymq.admin.cli", "dev-cluster", "--brokers", "1", "--dir",
         str(tmp_path / "dev"), "--port", "0", "--etcd-port", "0", "--kafka-port", str(kafka)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(4)]  # etcd, broker 1, bootstrap, kafka
        assert lines[3].startswith(f"kafka     127.0.0.1:{kafka} "), lines
        assert accepts(f"127.0.0.1:{kafka}")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # never left running for the next tests
            proc.kill()
            proc.communicate()
            raise
    assert proc.returncode == 0


@pytest.mark.parametrize(("args", "complaint"), [
    (["--brokers", "0"], "--brokers"), (["--brokers", "10"], "--brokers"),
    (["--brokers", "3", "--port", "65534"], "pass 65535"), (["--flush", "never"], "--flush"),
    (["--brokers", "3", "--kafka-port", "65534"], "pass 65535"),
    (["--brokers", "2", "--port", "9000", "--kafka-port", "9001"], "overlap")])
def test_dev_cluster_refuses_bad_flags(args: list[str], complaint: str) -> None:
    res = CliRunner().invoke(cli, ["dev-cluster", *args])
    assert res.exit_code == 2
    assert complaint in res.output


def test_dev_cluster_without_etcd_says_how_to_install_it(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no etcd on it
    res = CliRunner().invoke(cli, ["dev-cluster", "--dir", str(tmp_path / "dev")])
    assert res.exit_code == 1
    assert "needs etcd, which is not installed (sudo apt-get install -y etcd-server)" in res.output
    assert not (tmp_path / "dev").exists()
