"""A broker in a subprocess, for tests and benchmarks: the one launcher, and :func:`free_port`.

Theory of operation
-------------------
:class:`BrokerProcess` runs ``python -m ferrymq.broker`` (what ``ferrymq broker`` runs) on
127.0.0.1 with a data directory, a port and a flush mode, plus command-line flags (``extra``)
and environment variables (``env``, e.g. ``FERRYMQ_<SETTING>``), and a test's fault hooks
(``faults``: :class:`~ferrymq._faults.Faults`, which the broker reads once at start). The
broker's output goes to a
log file next to the data directory. :meth:`BrokerProcess.start` returns once the log says the
broker listens (once the port accepts a connection when ``log_level`` hides that line) and
raises with the log when the process exits first or does not listen in time. Starting again
after :meth:`~BrokerProcess.kill9` or :meth:`~BrokerProcess.terminate` restarts it on the same
port and files, appending to the same log: what crash tests need.

Without a data directory it makes a temporary one and removes it when stopped (the
benchmarks' way). Leaving a ``with`` block kills a broker still running (tests want a fast
teardown, and crash tests an unclean one); :meth:`~BrokerProcess.stop` stops it gracefully.

It lives outside :mod:`ferrymq.testing` (which re-exports it) because ``ferrymq bench`` uses it
too and must not need pytest.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ferrymq._faults import NO_FAULTS, Faults

__all__ = ["BrokerProcess", "free_port"]

LISTEN_RE = re.compile(r"listening on ([\d.]+):(\d+)")
"""The broker's log line once it accepts connections (logged at INFO)."""
_QUIET_LEVELS = frozenset(("WARNING", "ERROR", "CRITICAL"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class BrokerProcess:
    """``ferrymq broker`` in a subprocess: start, stop, kill -9, restart on the same port.

    Args:
        data_dir: the broker's data; None: a temporary directory, removed when stopped.
        port: its port (0: a free one, kept across restarts).
        flush: ``sync`` or ``async``.
        extra: more ``ferrymq broker`` flags (without ``--http-port``: the HTTP listener is
            off).
        env: environment variables added to this process's for the broker.
        faults: fault hooks for the broker (crash points, injected ENOSPC, a fake ``statm``,
            a shifted wall clock); may be changed between restarts.
        nofile: the broker's RLIMIT_NOFILE (soft and hard, so it cannot raise it).
        log_level: the broker's log level (None: its default, INFO).
        python: the interpreter to run it with.
        new_session: start it in a session of its own (a Ctrl-C in the terminal does not
            reach it; the benchmarks stop it themselves).
    """

    def __init__(self, data_dir: str | Path | None = None, *, port: int = 0,
                 flush: str = "sync", extra: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None, faults: Faults = NO_FAULTS,
                 nofile: int | None = None,
                 log_level: str | None = None, python: str = sys.executable,
                 new_session: bool = False) -> None:
        self._scratch: Path | None = None
        if data_dir is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="ferrymq-broker-"))
            data_dir = self._scratch / "data"
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.flush = flush
        self.extra = list(extra or ())
        self.env = env
        self.faults = faults
        self.nofile = nofile
        self.log_level = log_level
        self.python = python
        self.new_session = new_session
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir.parent / f"broker-{self.port}.log"
        self.starts = 0

    @property
    def address(self) -> str:
        """``host:port``."""
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The process id of the broker started last (None before the first start)."""
        return None if self.proc is None else self.proc.pid

    def running(self) -> bool:
        """Whether the broker process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def argv(self) -> list[str]:
        """The command line that starts the broker."""
        argv = [self.python, "-m", "ferrymq.broker", "--host", "127.0.0.1", "--port",
                str(self.port), "--data-dir", str(self.data_dir), "--flush", self.flush]
        if self.log_level is not None:
            argv += ["--log-level", self.log_level]
        if "--http-port" not in self.extra and "FERRYMQ_HTTP_PORT" not in (self.env or {}):
            argv += ["--http-port", "0"]  # test brokers must not all take 9877
        return argv + self.extra

    def start(self, timeout: float = 30.0) -> BrokerProcess:
        """Start the broker and wait until it listens.

        Raises:
            RuntimeError: it exited first, or did not listen within ``timeout`` s (the
                message holds what it logged).
        """
        self.starts += 1
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.starts}\n".encode())
            log.flush()
            offset = log.tell()
            self.proc = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT,
                env=self._environment(),
                preexec_fn=None if self.nofile is None else self._limit_descriptors,
                start_new_session=self.new_session,
            )
        quiet = self.log_level is not None and self.log_level.upper() in _QUIET_LEVELS
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._listening(offset, quiet):
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}:\n"
                                   f"{self._logged_since(offset)}")
            time.sleep(0.02)
        raise RuntimeError(f"broker did not listen within {timeout} s:\n"
                           f"{self._logged_since(offset)}")

    def _environment(self) -> dict[str, str] | None:
        """The broker's environment (None: this process's, unchanged)."""
        added = {**(self.env or {}), **self.faults.env()}
        return {**os.environ, **added} if added else None

    def _listening(self, offset: int, quiet: bool) -> bool:
        if not quiet:
            return LISTEN_RE.search(self._logged_since(offset)) is not None
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port),
                                                                    0.2):
            return True
        return False

    def _logged_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def _limit_descriptors(self) -> None:
        """In the child, before exec: lower RLIMIT_NOFILE to ``nofile``."""
        assert self.nofile is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def open_descriptors(self) -> int:
        """How many descriptors the broker process holds now."""
        assert self.proc is not None
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def kill9(self) -> None:
        """SIGKILL and reap."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful shutdown), wait, return the exit code.

        Raises:
            subprocess.TimeoutExpired: it did not exit within ``timeout`` s.
        """
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        """Stop gracefully (SIGTERM; SIGKILL after ``timeout`` s) if running; remove a
        temporary data directory."""
        if self.running():
            try:
                self.terminate(timeout)
            except subprocess.TimeoutExpired:
                self._kill()
        self._remove_scratch()

    def log_text(self) -> str:
        """Everything the broker logged so far."""
        return self.log_path.read_text(errors="replace")

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def _remove_scratch(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def __enter__(self) -> BrokerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self._kill()
        self._remove_scratch()
