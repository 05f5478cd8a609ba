"""Group commit: one thread fsyncs dirty queues; the event loop learns what became durable.

Theory of operation
-------------------
The event loop appends with ``write(2)`` and marks the queue dirty. The flusher thread takes the
whole dirty set at once, fsyncs each log (``Log.flush`` returns the end offset now durable) and
posts the results back to the loop with ``call_soon_threadsafe``. While one round of fsyncs runs,
further appends pile up and share the next round: that is the group commit, and it needs no
tuning.

In ``sync`` mode a round starts as soon as something is dirty; sends are acknowledged when their
offsets become durable, and consumers see only durable data. In ``async`` mode a round runs every
``flush_interval_ms``; sends are acknowledged after ``write(2)``.

An fsync that fails (EIO, ENOSPC) is never retried as if it had worked (fsyncgate): the waiting
sends fail with STORAGE_ERROR, the queue is marked failed, and produce to it is refused until the
broker restarts and recovery re-verifies the log.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Protocol

from ferrymq.errors import StorageFailureError

log = logging.getLogger("ferrymq.broker")


class Flushable(Protocol):
    """Something the flusher fsyncs: a queue's log, a delivery group's journal."""

    def flush_blocking(self) -> int:
        """fsync (on the flusher thread); return the position now durable."""
        ...

    def on_flushed(self, durable: int, sync: bool) -> None:
        """On the loop thread: ``durable`` is fsynced (``sync``: the broker's flush mode)."""
        ...

    def on_flush_failed(self, exc: BaseException) -> None:
        """On the loop thread: the fsync failed; fail whoever waits for it."""
        ...


class Flusher:
    """Owns the flusher thread. ``mark_dirty`` is called on the loop thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, sync: bool, interval_ms: int) -> None:
        self._loop = loop
        self._sync = sync
        self._interval_s = interval_ms / 1000.0
        self._cond = threading.Condition()
        self._dirty: set[Flushable] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ferrymq-flusher", daemon=True)
        self.failed: set[Flushable] = set()
        self.rounds = 0

    def start(self) -> None:
        """Start the flusher thread."""
        self._thread.start()

    def mark_dirty(self, qs: Flushable) -> None:
        """Note that ``qs`` has unflushed writes (wakes the thread in sync mode)."""
        with self._cond:
            if qs not in self._dirty:
                self._dirty.add(qs)
                if self._sync:
                    self._cond.notify()

    def stop(self) -> None:
        """Flush what is dirty one last time and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._sync:
                    while not self._dirty and not self._stopping:
                        self._cond.wait()
                elif not self._stopping:
                    self._cond.wait(self._interval_s)
                batch = self._dirty
                self._dirty = set()
                stopping = self._stopping
            results: list[tuple[Flushable, int, BaseException | None]] = []
            for qs in batch:
                try:
                    results.append((qs, qs.flush_blocking(), None))
                except Exception as exc:  # noqa: BLE001 - any failure must reach the waiters
                    log.critical("fsync of %s failed: %s", qs, exc)
                    results.append((qs, -1, exc))
            self.rounds += 1
            if results:
                try:
                    self._loop.call_soon_threadsafe(self._on_flushed, results)
                except RuntimeError:  # loop closed: shutdown already flushed synchronously
                    return
            if stopping:
                return

    def _on_flushed(self, results: list[tuple[Flushable, int, BaseException | None]]) -> None:
        for qs, durable, exc in results:
            if exc is not None:
                self.failed.add(qs)
                qs.on_flush_failed(StorageFailureError(f"fsync failed: {exc}"))
                continue
            qs.on_flushed(durable, self._sync)
