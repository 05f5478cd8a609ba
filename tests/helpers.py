"""Test helpers: a broker in a subprocess (for kill -9), free ports, waiting, reading a topic."""

from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ferrymq import PullConsumer, ReceivedMessage

REQUIRE_ALL_TESTS = os.environ.get("FERRYMQ_REQUIRE_ALL_TESTS", "") not in ("", "0")
"""Set by ``.ci/run``: a test that would be skipped (or not collected) fails the run instead."""
LISTEN_RE = re.compile(r"listening on ([\d.]+):(\d+)")


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> None:
    """Poll ``cond`` until true or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(interval)
    raise AssertionError("condition not met in time")


class BrokerProcess:
    """``ferrymq broker`` in a subprocess: start, kill -9, terminate, restart on the same port."""

    def __init__(self, data_dir: Path, *, port: int = 0, flush: str = "sync",
                 extra: list[str] | None = None, env: dict[str, str] | None = None,
                 nofile: int | None = None) -> None:
        """``nofile``: the broker's RLIMIT_NOFILE (soft and hard: it cannot raise it)."""
        self.data_dir = data_dir
        self.env = env
        self.nofile = nofile
        self.port = port or free_port()
        self.flush = flush
        self.extra = extra or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"broker-{self.port}.log"
        self.starts = 0

    @property
    def address(self) -> str:
        """host:port."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> BrokerProcess:
        """Start and wait until it listens."""
        self.starts += 1
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the subprocess
        log.write(f"--- start {self.starts}\n".encode())
        log.flush()
        offset = self.log_path.stat().st_size
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ferrymq.broker", "--port", str(self.port), "--data-dir",
             str(self.data_dir), "--flush", self.flush, *self.extra],
            stdout=subprocess.DEVNULL, stderr=log,
            env={**os.environ, **self.env} if self.env else None,
            preexec_fn=None if self.nofile is None else self._limit_descriptors,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_bytes()[offset:].decode(errors="replace")
            if LISTEN_RE.search(text):
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}:\n{text}")
            time.sleep(0.02)
        raise RuntimeError("broker did not start in time")

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
        """SIGTERM, wait, return the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def log_text(self) -> str:
        """Everything the broker logged so far."""
        return self.log_path.read_text(errors="replace")

    def __enter__(self) -> BrokerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def read_topic(address: str, topic: str, expect: int = 0, *, timeout: float = 10.0,
               quiet: float = 0.5, isolation: str = "read_committed") -> list[ReceivedMessage]:
    """Every message of ``topic`` from the start, with a fresh group that commits nothing: wait
    until at least ``expect`` arrived (at most ``timeout`` s), then until none came for
    ``quiet`` s (to catch extra copies)."""
    got: list[ReceivedMessage] = []
    with PullConsumer(address, f"check-{time.monotonic_ns()}", auto_offset_reset="earliest",
                      auto_commit=False, isolation=isolation) as c:
        c.subscribe(topic)
        deadline = time.monotonic() + timeout
        while len(got) < expect and time.monotonic() < deadline:
            got.extend(c.poll(timeout=0.2))
        until = time.monotonic() + quiet
        while time.monotonic() < until:
            batch = c.poll(timeout=0.1)
            if batch:
                got.extend(batch)
                until = time.monotonic() + quiet
    return got


class FakeStatm:
    """A file the broker reads instead of ``/proc/self/statm`` (``FERRYMQ_FAULT_STATM``), so a
    test drives the resident memory the broker's memory watermark sees."""

    def __init__(self, path: Path, rss_bytes: int) -> None:
        self.path = path
        self.set_rss(rss_bytes)

    @property
    def env(self) -> dict[str, str]:
        """The broker environment that points it at this file."""
        return {"FERRYMQ_FAULT_STATM": str(self.path)}

    def set_rss(self, nbytes: int) -> None:
        """Report ``nbytes`` of resident memory from now on (replaced atomically)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"100000 {nbytes // os.sysconf('SC_PAGE_SIZE')} 0 0 0 0 0\n")
        tmp.replace(self.path)
