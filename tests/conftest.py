"""Shared fixtures: real brokers (in-process or subprocess) on free ports.

With ``FERRYMQ_REQUIRE_ALL_TESTS=1`` (set by ``.ci/run``) a run in which any test was skipped
fails: a component a test needs (Java for Spark, openssl, Linux AIO, ...) must be there in CI,
and only a developer's machine may lack it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq import Broker
from tests.helpers import REQUIRE_ALL_TESTS, BrokerProcess

_skipped: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Note skipped tests (on the xdist controller too, which gets every worker's reports)."""
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail a CI run that skipped anything."""
    if not REQUIRE_ALL_TESTS or hasattr(session.config, "workerinput") or not _skipped:
        return
    print(f"\nFERRYMQ_REQUIRE_ALL_TESTS: {len(_skipped)} test(s) skipped, which CI does not "
          "allow (install what they need):\n  " + "\n  ".join(_skipped[:20]))
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    """A real in-process broker (sync flush) on a free port."""
    b = Broker(tmp_path / "data", port=0).start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def broker_process(tmp_path: Path) -> Iterator[BrokerProcess]:
    """A broker subprocess (``ferrymq broker``) that tests may kill -9 and restart."""
    bp = BrokerProcess(tmp_path / "data")
    try:
        yield bp
    finally:
        if bp.proc is not None and bp.proc.poll() is None:
            bp.proc.kill()
            bp.proc.wait(10)
