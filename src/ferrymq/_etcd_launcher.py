"""etcd in subprocesses, for tests and ``ferrymq dev-cluster``: one member or a cluster of n.

Theory of operation
-------------------
:class:`EtcdProcess` runs the ``etcd`` binary (Debian's ``etcd-server``; see
:func:`etcd_binary`) on 127.0.0.1 with a client port, a peer port and a data directory of its
own, with fast elections (``--heartbeat-interval 50 --election-timeout 500``: a lost leader is
replaced within about a second on loopback), allowing commits of
:data:`~ferrymq.cluster.metadata.store.COMMIT_MAX_OPS` operations (``--max-txn-ops``; etcd's
default, 128, is too few for a topic's create). Its output goes to a log file next to the data
directory. :meth:`EtcdProcess.start` returns once ``/health`` answers true (the member serves
linearisable requests) and raises with the log when the process exits first or stays unhealthy.
Starting again after :meth:`~EtcdProcess.kill9` or :meth:`~EtcdProcess.stop` restarts it on the
same ports and data, as a crashed etcd restarts; :meth:`~EtcdProcess.pause` and
:meth:`~EtcdProcess.resume` (SIGSTOP / SIGCONT) make a hung member.

:class:`EtcdCluster` starts ``n`` such members with one ``--initial-cluster`` string (a member
alone is never healthy before it has a quorum, so all are launched before any is waited for);
its :attr:`~EtcdCluster.url` lists every member, which is what a store needs to ride through
the loss of one.

It lives outside :mod:`ferrymq.testing` (which re-exports it) because ``ferrymq dev-cluster``
uses it too and must not need pytest.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from ferrymq._launcher import free_port
from ferrymq.cluster.metadata.store import COMMIT_MAX_OPS

__all__ = ["ETCD_INSTALL_HINT", "EtcdCluster", "EtcdProcess", "etcd_binary"]

ETCD_INSTALL_HINT = "sudo apt-get install -y etcd-server"
"""How to get the etcd binary on Debian and Ubuntu (what ``make test`` runs as root)."""

HEARTBEAT_INTERVAL_MS = 50
"""etcd's ``--heartbeat-interval`` for test members: loopback round trips are ~0.1 ms."""
ELECTION_TIMEOUT_MS = 500
"""etcd's ``--election-timeout``: ten heartbeats, so a killed leader is replaced in ~0.5-1 s."""


def etcd_binary() -> str | None:
    """The etcd executable on ``PATH`` (None: not installed; :data:`ETCD_INSTALL_HINT` says
    how). Another one can be given to :class:`EtcdProcess` as ``binary``."""
    return shutil.which("etcd")


class EtcdProcess:
    """One etcd member in a subprocess: start, stop, kill -9, pause, restart on the same ports.

    Args:
        data_dir: its data; None: a temporary directory, removed when stopped.
        name: the member's name (unique within a cluster).
        client_port: its client port (0: a free one, kept across restarts).
        peer_port: its peer port (0: a free one, kept across restarts).
        initial_cluster: ``name=http://host:peer,...`` of every member (None: itself alone).
        binary: the etcd executable (None: :func:`etcd_binary`).
        new_session: start it in a session of its own (a Ctrl-C in the terminal does not
            reach it; ``ferrymq dev-cluster`` stops it itself).
    """

    def __init__(self, data_dir: str | Path | None = None, *, name: str = "etcd0",
                 client_port: int = 0, peer_port: int = 0, initial_cluster: str | None = None,
                 binary: str | None = None, new_session: bool = False) -> None:
        self._scratch: Path | None = None
        if data_dir is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="ferrymq-etcd-"))
            data_dir = self._scratch / name
        self.data_dir = Path(data_dir)
        self.name = name
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.initial_cluster = initial_cluster or f"{name}={self.peer_url}"
        self.binary = binary
        self.new_session = new_session
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir.parent / f"{name}-{self.client_port}.log"
        self.starts = 0
        self._offset = 0

    @property
    def url(self) -> str:
        """The metadata store URL of this member: ``etcd://127.0.0.1:PORT``."""
        return f"etcd://127.0.0.1:{self.client_port}"

    @property
    def client_url(self) -> str:
        """``http://127.0.0.1:PORT`` (etcd's own notation)."""
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        """The URL other members reach this one at."""
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        """The process id of the member started last (None before the first start)."""
        return None if self.proc is None else self.proc.pid

    def running(self) -> bool:
        """Whether the process is alive (paused counts as alive)."""
        return self.proc is not None and self.proc.poll() is None

    def argv(self) -> list[str]:
        """The command line that starts the member.

        Raises:
            FileNotFoundError: etcd is not installed.
        """
        binary = self.binary or etcd_binary()
        if binary is None:
            raise FileNotFoundError(f"etcd is not installed (on Debian: {ETCD_INSTALL_HINT})")
        return [binary, "--name", self.name, "--data-dir", str(self.data_dir),
                "--listen-client-urls", self.client_url,
                "--advertise-client-urls", self.client_url,
                "--listen-peer-urls", self.peer_url,
                "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", self.initial_cluster,
                "--initial-cluster-state", "new",
                "--initial-cluster-token", "ferrymq",
                "--heartbeat-interval", str(HEARTBEAT_INTERVAL_MS),
                "--election-timeout", str(ELECTION_TIMEOUT_MS),
                "--max-txn-ops", str(COMMIT_MAX_OPS),
                "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"]

    def launch(self) -> EtcdProcess:
        """Start the process without waiting for it to be healthy (see :meth:`wait_healthy`)."""
        self.starts += 1
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        argv = self.argv()
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.starts}\n".encode())
            log.flush()
            self._offset = log.tell()
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL,
                                         start_new_session=self.new_session)
        return self

    def wait_healthy(self, timeout: float = 30.0) -> EtcdProcess:
        """Wait until ``/health`` says true.

        Raises:
            RuntimeError: the process exited first, or was not healthy within ``timeout`` s
                (the message holds what it logged).
        """
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.healthy():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd {self.name} exited with {self.proc.returncode}:\n"
                                   f"{self._logged_since_start()}")
            time.sleep(0.05)
        raise RuntimeError(f"etcd {self.name} was not healthy within {timeout} s:\n"
                           f"{self._logged_since_start()}")

    def start(self, timeout: float = 30.0) -> EtcdProcess:
        """Start the member and wait until it is healthy (see :meth:`wait_healthy`)."""
        return self.launch().wait_healthy(timeout)

    def healthy(self, timeout: float = 0.5) -> bool:
        """Whether ``/health`` answers ``{"health": "true"}`` within ``timeout`` s."""
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=timeout) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def _logged_since_start(self) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(self._offset)
            return f.read().decode(errors="replace")[-4000:]

    def log_text(self) -> str:
        """Everything the member logged so far."""
        return self.log_path.read_text(errors="replace")

    def kill9(self) -> None:
        """SIGKILL and reap (a paused member dies too)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the member hangs, its sockets stay open."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM (after SIGCONT, should it be paused), wait, return the exit code.

        Raises:
            subprocess.TimeoutExpired: it did not exit within ``timeout`` s.
        """
        assert self.proc is not None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM; SIGKILL after ``timeout`` s) if running; remove a
        temporary data directory."""
        if self.running():
            try:
                self.terminate(timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        self._remove_scratch()

    def _remove_scratch(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def __enter__(self) -> EtcdProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.running():
            self.kill9()
        self._remove_scratch()


class EtcdCluster:
    """``n`` etcd members on loopback forming one cluster.

    Args:
        n: how many members (1, 3 or 5 make sense: a majority must live).
        base_dir: where their data directories go (``<base_dir>/etcd<i>``); None: a temporary
            directory, removed when stopped.
        new_session: as for :class:`EtcdProcess`.
    """

    def __init__(self, n: int = 3, base_dir: str | Path | None = None, *,
                 new_session: bool = False) -> None:
        if n < 1:
            raise ValueError(f"an etcd cluster needs at least 1 member, not {n}")
        self._scratch: Path | None = None
        if base_dir is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="ferrymq-etcd-"))
            base_dir = self._scratch
        base = Path(base_dir)
        names = [f"etcd{i}" for i in range(n)]
        peer_ports = [free_port() for _ in names]
        self.initial_cluster = ",".join(f"{name}=http://127.0.0.1:{port}"
                                        for name, port in zip(names, peer_ports, strict=True))
        self.members = [EtcdProcess(base / name, name=name, peer_port=port,
                                    initial_cluster=self.initial_cluster,
                                    new_session=new_session)
                        for name, port in zip(names, peer_ports, strict=True)]

    @property
    def url(self) -> str:
        """``etcd://127.0.0.1:P1,127.0.0.1:P2,...``: every member."""
        return "etcd://" + ",".join(f"127.0.0.1:{m.client_port}" for m in self.members)

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        """Start every member and wait until all are healthy."""
        for m in self.members:
            m.launch()
        for m in self.members:
            m.wait_healthy(timeout)
        return self

    def member(self, i: int) -> EtcdProcess:
        """Member ``i`` (0-based)."""
        return self.members[i]

    def kill9(self, i: int) -> None:
        """SIGKILL member ``i``."""
        self.members[i].kill9()

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Start member ``i`` again on its ports and data, and wait until it is healthy."""
        self.members[i].start(timeout)

    def stop(self, members: Sequence[int] | None = None) -> None:
        """Stop the given members (every one by default) gracefully; with every one, remove a
        temporary base directory."""
        for i in range(len(self.members)) if members is None else members:
            self.members[i].stop()
        if members is None and self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        for m in self.members:
            if m.running():
                m.kill9()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
