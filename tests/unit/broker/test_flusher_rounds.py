"""How the flusher runs a round's fsyncs (ferrymq.broker.flusher): without native AIO in
parallel only after a slow round; with it, submitted together."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ferrymq.broker import flusher as flusher_module
from ferrymq.broker.flusher import Flusher
from ferrymq.errors import StorageFailureError
from ferrymq.storage.aio import AioFsync


class _File:
    """A flushable whose fsync takes ``delay_s``; it records the thread that ran it."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.threads: list[str] = []
        self.flushed = asyncio.Event()

    def flush_blocking(self) -> int:
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay_s)
        return 1

    def on_flushed(self, durable: int, sync: bool) -> None:
        self.flushed.set()

    def on_flush_failed(self, exc: BaseException) -> None:
        raise AssertionError(exc)


async def _round(flusher: Flusher, files: list[_File]) -> set[str]:
    """Mark every file dirty at once (one round) and return the threads that fsynced them."""
    for f in files:
        f.flushed.clear()
        f.threads.clear()
    flusher.mark_all_dirty(files)
    await asyncio.wait_for(asyncio.gather(*(f.flushed.wait() for f in files)), 10)
    return {t for f in files for t in f.threads}


SLOW_ROUND_S = 0.1
"""The slow-round threshold these tests pin (the broker's is 2 ms): a round of instant fsyncs
on a crowded CI machine can take a few ms, never 100."""


def test_parallel_only_after_a_slow_round(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flusher_module, "PARALLEL_AFTER_S", SLOW_ROUND_S)

    async def main() -> None:
        flusher = Flusher(asyncio.get_running_loop(), sync=True, interval_ms=200, threads=4,
                          aio=False)
        flusher.start()
        try:
            fast = [_File(0.0) for _ in range(4)]
            assert await _round(flusher, fast) == {"ferrymq-flusher"}
            assert await _round(flusher, fast) == {"ferrymq-flusher"}
            assert flusher.parallel_rounds == 0
            slow = [_File(SLOW_ROUND_S * 2) for _ in range(4)]
            assert await _round(flusher, slow) == {"ferrymq-flusher"}  # learnt after it
            threads = await _round(flusher, slow)
            assert "ferrymq-flusher" in threads and len(threads) >= 2  # now on the pool too
            assert flusher.parallel_rounds == 1
            await _round(flusher, slow)  # the parallel round was slow too: stays parallel
            assert flusher.parallel_rounds == 2
            await _round(flusher, fast)  # a fast round (parallel still) ...
            assert await _round(flusher, fast) == {"ferrymq-flusher"}  # ... then one by one
            assert flusher.parallel_rounds == 3
        finally:
            flusher.stop()

    asyncio.run(main())


def test_one_thread_never_uses_a_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flusher_module, "PARALLEL_AFTER_S", SLOW_ROUND_S)

    async def main() -> None:
        flusher = Flusher(asyncio.get_running_loop(), sync=True, interval_ms=200, threads=1)
        flusher.start()
        try:
            slow = [_File(SLOW_ROUND_S * 2) for _ in range(3)]
            for _ in range(3):
                assert await _round(flusher, slow) == {"ferrymq-flusher"}
            assert flusher.parallel_rounds == 0
        finally:
            flusher.stop()

    asyncio.run(main())


class _FdFile(_File):
    """A flushable whose flush is one fsync of a real file: the flusher may submit it with
    others (``flush_begin``/``flush_end``)."""

    def __init__(self, path: Path) -> None:
        super().__init__(0.0)
        self.fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND)
        self.written = 0
        self.durable = 0
        self.failed: list[BaseException] = []
        self.ended: list[bool] = []

    def write(self) -> None:
        self.written += os.write(self.fd, b"x" * 100)

    def flush_blocking(self) -> int:
        self.threads.append(threading.current_thread().name)
        os.fsync(self.fd)
        return self.written

    def flush_begin(self) -> tuple[int, int] | None:
        self.threads.append(threading.current_thread().name)
        return self.fd, self.written

    def flush_end(self, end: int, fsynced: bool) -> int:
        self.ended.append(fsynced)
        if fsynced:
            self.durable = end
        return self.durable

    def on_flushed(self, durable: int, sync: bool) -> None:
        assert durable == self.written
        self.flushed.set()

    def on_flush_failed(self, exc: BaseException) -> None:
        self.failed.append(exc)
        self.flushed.set()


needs_aio = pytest.mark.skipif(
    not sys.platform.startswith("linux") or AioFsync.open(1) is None,
    reason="native AIO is not available here")


@pytest.fixture
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every round counts as fast, however slow the disk (AIO is used after fast rounds)."""
    monkeypatch.setattr(flusher_module, "PARALLEL_AFTER_S", 60.0)


@contextlib.asynccontextmanager
async def _running(tmp_path: Path, n: int, *, aio: bool = True
                   ) -> AsyncIterator[tuple[Flusher, list[_FdFile]]]:
    """A started flusher (4 threads) and ``n`` files on ``tmp_path``; stopped and closed after."""
    flusher = Flusher(asyncio.get_running_loop(), sync=True, interval_ms=200, threads=4, aio=aio)
    flusher.start()
    files = [_FdFile(tmp_path / f"q{i}") for i in range(n)]
    try:
        yield flusher, files
    finally:
        flusher.stop()
        for f in files:
            with contextlib.suppress(OSError):  # -1: a test closed it itself
                os.close(f.fd)


@needs_aio
def test_single_fsync_flushes_are_submitted_together(tmp_path: Path, patient: None) -> None:
    async def main() -> None:
        async with _running(tmp_path, 4) as (flusher, files):
            other = _File(0.0)  # no flush_begin: fsynced on its own in the same round
            for _ in range(3):
                for f in files:
                    f.write()
                assert await _round(flusher, [*files, other]) == {"ferrymq-flusher"}
            assert flusher.aio_rounds == 3 and flusher.parallel_rounds == 0
            assert flusher.aio_fsyncs == 3 * len(files)  # one submission per round
            assert all(f.ended == [True] * 3 and f.durable == f.written for f in files)
            assert other.threads == ["ferrymq-flusher"]

    asyncio.run(main())


@needs_aio
def test_a_failed_fsync_fails_only_its_own_waiters(tmp_path: Path, patient: None) -> None:
    async def main() -> None:
        async with _running(tmp_path, 3) as (flusher, (good0, bad, good1)):
            good0.write()
            good1.write()
            os.close(bad.fd)  # its fsync fails with EBADF
            await _round(flusher, [good0, bad, good1])
            bad.fd = -1  # closed above: the clean-up must not close a reused number
            assert [type(e) for e in bad.failed] == [StorageFailureError]
            assert os.strerror(errno.EBADF) in str(bad.failed[0])
            assert bad.ended == [False] and bad.durable == 0
            assert bad in flusher.failed  # fsyncgate: no later fsync is believed
            assert all(not f.failed and f.ended == [True] for f in (good0, good1))

    asyncio.run(main())


def test_aio_off_flushes_one_by_one(tmp_path: Path) -> None:
    async def main() -> None:
        async with _running(tmp_path, 3, aio=False) as (flusher, files):
            for f in files:
                f.write()
            await _round(flusher, files)
            assert flusher.aio_rounds == 0
            assert all(f.ended == [] for f in files)  # flush_blocking, not flush_begin

    asyncio.run(main())


@needs_aio
def test_after_a_slow_round_the_pool_runs_the_fsyncs_not_aio(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flusher_module, "PARALLEL_AFTER_S", 0.5)  # real fsyncs stay under it

    async def main() -> None:
        async with _running(tmp_path, 3) as (flusher, files):
            await _round(flusher, [_File(0.6) for _ in range(2)])  # slow
            for f in files:
                f.write()
            threads = await _round(flusher, files)  # large writes: on threads
            assert flusher.aio_rounds == 0 and flusher.parallel_rounds == 1
            assert len(threads) >= 2 and all(f.ended == [] for f in files)
            for f in files:
                f.write()
            await _round(flusher, files)  # that round was fast: together through AIO
            assert flusher.aio_rounds == 1
            assert all(f.ended == [True] for f in files)

    asyncio.run(main())
