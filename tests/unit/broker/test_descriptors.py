"""The descriptor budget (broker/descriptors.py), the auto-creation rate (broker/limits.py) and
how the flusher treats a flush that could not get a descriptor (broker/flusher.py)."""

from __future__ import annotations

import asyncio
import errno
import gc
import subprocess
import sys

import pytest

from ferrymq.broker.descriptors import (
    MIN_CONNECTIONS,
    MIN_OPEN_SEGMENTS,
    RESERVED_DESCRIPTORS,
    is_out_of_descriptors,
    is_resource_shortage,
    out_of_descriptors_error,
    plan_descriptors,
)
from ferrymq.broker.flusher import Flusher, flush_postponed
from ferrymq.broker.limits import CreationRate
from ferrymq.errors import BusyError, ConfigError, StorageFailureError, StorageFullError

EMFILE = OSError(errno.EMFILE, "Too many open files")


def test_plan_of_a_roomy_limit() -> None:
    b = plan_descriptors(20_000, max_connections=10_000, max_open_segments=0, raised_from=1024)
    assert (b.reserved, b.connections, b.open_segments) == (RESERVED_DESCRIPTORS, 10_000,
                                                           20_000 - RESERVED_DESCRIPTORS - 10_000)
    text = b.describe(40_000, 10_000)
    assert "descriptor limit 20000 (soft limit raised from 1024)" in text
    assert f"{b.open_segments} of them in use at once" in text
    assert "max_total_queues=40000" in text and "room for 10000 connections" in text
    assert "max_delivery_groups=10000" in text and "group journals" in text


def test_plan_of_a_small_limit_keeps_a_quarter_for_files() -> None:
    b = plan_descriptors(256, max_connections=10_000, max_open_segments=0)
    assert b.connections + b.open_segments + b.reserved == 256
    assert b.open_segments == 48 and b.connections == 144
    assert "raised" not in b.describe(10, 10)


def test_plan_refuses_a_limit_too_small() -> None:
    too_small = RESERVED_DESCRIPTORS + MIN_OPEN_SEGMENTS + MIN_CONNECTIONS - 1
    with pytest.raises(ConfigError, match=rf"RLIMIT_NOFILE\) is {too_small}: the broker needs at "
                                          rf"least {too_small + 1}"):
        plan_descriptors(too_small, max_connections=10, max_open_segments=0)
    plan_descriptors(too_small + 1, max_connections=10, max_open_segments=0)


def test_plan_with_max_open_segments() -> None:
    b = plan_descriptors(1024, max_connections=100, max_open_segments=500)
    assert (b.open_segments, b.connections) == (500, 1024 - RESERVED_DESCRIPTORS - 500)
    with pytest.raises(ConfigError, match="max_open_segments=950 leaves 10 of the descriptor "
                                          "limit 1024"):
        plan_descriptors(1024, max_connections=100, max_open_segments=950)
    with pytest.raises(ConfigError, match=r"max_open_segments must be 0 \(auto\) or at least 16"):
        plan_descriptors(1024, max_connections=100, max_open_segments=3)


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    code = ("import resource\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (128, 512))\n"
            "from ferrymq.broker.descriptors import raise_descriptor_limit\n"
            "print(raise_descriptor_limit(), resource.getrlimit(resource.RLIMIT_NOFILE))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "(128, 512) (512, 512)"


def test_out_of_descriptors_errors() -> None:
    assert is_out_of_descriptors(EMFILE) and is_out_of_descriptors(OSError(errno.ENFILE, "x"))
    assert not is_out_of_descriptors(OSError(errno.ENOSPC, "x"))
    assert is_resource_shortage(OSError(errno.ENOSPC, "x")) and is_resource_shortage(EMFILE)
    assert not is_resource_shortage(OSError(errno.EIO, "x"))
    err = out_of_descriptors_error(EMFILE, "open t/0", 300)
    assert isinstance(err, BusyError) and err.retriable and err.retry_after_ms == 300
    assert "cannot open t/0: the broker is out of file descriptors" in str(err)
    assert "the system is out" in str(out_of_descriptors_error(OSError(errno.ENFILE, "x"),
                                                               "a", 1))


# --- auto-creation rate --------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Conn:
    """Stands for a connection object (any weak-referenceable object)."""


def test_creation_rate_burst_then_refill() -> None:
    clock = _Clock()
    rate = CreationRate(6, clock)
    conn = _Conn()
    assert [rate.take(conn) for _ in range(6)] == [0.0] * 6
    assert rate.take(conn) == pytest.approx(10.0)  # one every 10 s
    clock.now += 5
    assert rate.take(conn) == pytest.approx(5.0)
    clock.now += 5
    assert rate.take(conn) == 0.0
    assert rate.take(_Conn()) == 0.0  # another connection: its own bucket
    assert [rate.take("alice") for _ in range(6)] == [0.0] * 6
    assert rate.take("alice") > 0  # a user's bucket, shared by all of its connections
    assert rate.take("bob") == 0.0


def test_a_closed_connection_takes_its_bucket_along() -> None:
    rate = CreationRate(1, _Clock())
    conn = _Conn()
    rate.take(conn)
    assert len(rate._connections) == 1
    del conn
    gc.collect()
    assert len(rate._connections) == 0


# --- the flusher ---------------------------------------------------------------------------------


class _Starved:
    """A rewritable flushable whose flush cannot open a file for its first ``fail`` tries."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.errors: list[BaseException] = []
        self.durable: list[int] = []
        self.flushed = asyncio.Event()

    def flush_blocking(self) -> int:
        return self._attempt()

    def rewrite_undurable(self) -> int:
        return self._attempt()

    def _attempt(self) -> int:
        if self.fail:
            self.fail -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return 7

    def on_flushed(self, durable: int, sync: bool) -> None:
        self.durable.append(durable)

    def on_flush_failed(self, exc: BaseException) -> None:
        self.errors.append(exc)
        self.flushed.set()

    def __str__(self) -> str:
        return "starved"


def test_a_flush_short_of_descriptors_is_postponed_and_retried(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        flusher = Flusher(asyncio.get_running_loop(), sync=True, interval_ms=200, threads=1)
        flusher.retry_after_ms = 250
        flusher.start()
        try:
            f = _Starved(fail=2)
            flusher.mark_dirty(f)
            await asyncio.wait_for(f.flushed.wait(), 10)
            (err,) = f.errors
            assert isinstance(err, BusyError) and err.retry_after_ms == 250
            assert "out of file descriptors" in str(err) and flush_postponed(err)
            assert f in flusher.full and f not in flusher.failed
            with pytest.raises(BusyError, match="out of file descriptors"):
                flusher.check_writable(f)
            flusher.retry_full(False)  # the disk is full: descriptors are tried anyway
            assert f in flusher.full and f.durable == []  # still none: waits
            flusher.retry_full(False)
            assert f not in flusher.full and f.durable == [7]
            flusher.check_writable(f)
        finally:
            flusher.stop()

    asyncio.run(main())
    assert "CRITICAL" not in caplog.text
    assert "flush postponed, out of file descriptors" in caplog.text
    assert "back in service" in caplog.text


def test_flush_postponed_tells_waiting_from_failed() -> None:
    assert flush_postponed(StorageFullError("x")) and flush_postponed(BusyError("x"))
    assert not flush_postponed(StorageFailureError("x")) and not flush_postponed(None)
