"""Test helpers: waiting, reading a topic, a fake ``statm``; and (from :mod:`ferrymq.testing`,
shared with the benchmarks) the subprocess broker and free ports."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from ferrymq import PullConsumer, ReceivedMessage
from ferrymq.testing import BrokerProcess as BrokerProcess
from ferrymq.testing import Faults
from ferrymq.testing import free_port as free_port

REQUIRE_ALL_TESTS = os.environ.get("FERRYMQ_REQUIRE_ALL_TESTS", "") not in ("", "0")
"""Set by ``.ci/run``: a test that would be skipped (or not collected) fails the run instead."""


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> None:
    """Poll ``cond`` until true or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(interval)
    raise AssertionError("condition not met in time")


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
    """A file the broker reads instead of ``/proc/self/statm`` (``Faults.statm_path``), so a
    test drives the resident memory the broker's memory watermark sees."""

    def __init__(self, path: Path, rss_bytes: int) -> None:
        self.path = path
        self.set_rss(rss_bytes)

    @property
    def faults(self) -> Faults:
        """The fault hooks that point a broker subprocess at this file."""
        return Faults(statm_path=str(self.path))

    def set_rss(self, nbytes: int) -> None:
        """Report ``nbytes`` of resident memory from now on (replaced atomically)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"100000 {nbytes // os.sysconf('SC_PAGE_SIZE')} 0 0 0 0 0\n")
        tmp.replace(self.path)
