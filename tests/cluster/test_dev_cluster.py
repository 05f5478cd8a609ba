"""The cluster launcher (etcd and N brokers in subprocesses) and ``ferrymq dev-cluster``.

Brokers do not act on ``--metadata`` yet (the cluster mode is being wired in), so these tests
check the processes: they start with the cluster flags, stop, die and come back; and the
command's flags and its Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ferrymq.admin.cli import cli
from ferrymq.testing import ClusterProcess
from tests.cluster.conftest import needs_etcd


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


@needs_etcd
def test_dev_cluster_runs_until_ctrl_c_and_then_stops_everything(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferrymq.admin.cli", "dev-cluster", "--brokers", "2", "--dir",
         str(tmp_path / "dev"), "--port", "0", "--etcd-port", "0", "--flush", "async"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        assert proc.stdout is not None
        while not lines or not lines[-1].startswith("bootstrap"):
            line = proc.stdout.readline()
            assert line, f"dev-cluster exited: {proc.wait(10)}: {proc.stderr.read()}"  # type: ignore[union-attr]
            lines.append(line.strip())
        etcd = re.search(r"etcd://([\d.:]+)", lines[0])
        assert etcd is not None and accepts(etcd.group(1))
        brokers = lines[-1].split()[1].split(",")
        assert len(brokers) == 2 and all(accepts(b) for b in brokers)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "stopped" in err
    assert not accepts(etcd.group(1)) and not any(accepts(b) for b in brokers)


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


@pytest.mark.parametrize(("args", "complaint"), [
    (["--brokers", "0"], "--brokers"), (["--brokers", "10"], "--brokers"),
    (["--brokers", "3", "--port", "65534"], "pass 65535"), (["--flush", "never"], "--flush")])
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
