"""The flusher runs a round's fsyncs in parallel only after a slow round (ferrymq.broker.flusher)."""

from __future__ import annotations

import asyncio
import threading
import time

from ferrymq.broker.flusher import PARALLEL_AFTER_S, Flusher


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
    with flusher._cond:  # all of them in one round
        for f in files:
            flusher.mark_dirty(f)
    await asyncio.wait_for(asyncio.gather(*(f.flushed.wait() for f in files)), 10)
    return {t for f in files for t in f.threads}


def test_parallel_only_after_a_slow_round() -> None:
    async def main() -> None:
        flusher = Flusher(asyncio.get_running_loop(), sync=True, interval_ms=200, threads=4)
        flusher.start()
        try:
            fast = [_File(0.0) for _ in range(4)]
            assert await _round(flusher, fast) == {"ferrymq-flusher"}
            assert await _round(flusher, fast) == {"ferrymq-flusher"}
            assert flusher.parallel_rounds == 0
            slow = [_File(PARALLEL_AFTER_S * 2) for _ in range(4)]
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


def test_one_thread_never_uses_a_pool() -> None:
    async def main() -> None:
        flusher = Flusher(asyncio.get_running_loop(), sync=True, interval_ms=200, threads=1)
        flusher.start()
        try:
            slow = [_File(PARALLEL_AFTER_S * 2) for _ in range(3)]
            for _ in range(3):
                assert await _round(flusher, slow) == {"ferrymq-flusher"}
            assert flusher.parallel_rounds == 0
        finally:
            flusher.stop()

    asyncio.run(main())
