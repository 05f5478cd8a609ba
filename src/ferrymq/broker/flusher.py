"""Group commit: one thread fsyncs dirty queues; the event loop learns what became durable.

Theory of operation
-------------------
The event loop appends with ``write(2)`` and marks the queue dirty. The flusher thread takes the
whole dirty set at once, fsyncs each log (``Log.flush`` returns the end offset now durable) and
posts the results back to the loop with ``call_soon_threadsafe``. While one round of fsyncs
runs, further appends pile up and share the next round: that is the group commit, and it needs
no tuning. A PRODUCE request marks the queues it wrote to together, after its last append
(:meth:`Flusher.mark_all_dirty`), so they share a round: the flusher thread runs whenever the
loop lets go of the GIL (every ``write(2)``), and marked one by one they could each get a round
of their own, one after the other, when fsyncs are fast or the machine is crowded.

A round with several dirty queues fsyncs them at once, so it lasts as long as its slowest fsync
rather than their sum; how depends on the last round. After a fast one (under
``PARALLEL_AFTER_S``: small appends, the latency regime) and with ``flush_aio`` (Linux), the
queues whose flush is one fsync of the active segment (:meth:`ferrymq.storage.log.Log.flush_begin`;
a flush after a roll also fsyncs the sealed segment and the directory and goes one by one) are
submitted together with native AIO (:mod:`ferrymq.storage.aio`): no other Python thread, so no
hand-off. A round of four small fsyncs took 0.65 ms (p50) this way against 1.21 ms one after
the other (sync e2e at 2,000 msg/s, bench/README session 9). Without AIO, short fsyncs run one
after the other on the flusher thread, because handing one to a pool thread costs a futex
wake-up and two GIL hand-offs, which on a virtual machine took longer than the fsync itself
(sync e2e p99 7.5 ms with the pool for every round against 6.2 ms without, session 8). After a
slow round (large writes, the throughput regime) the fsyncs run on up to ``flush_threads``
threads: there AIO lost (10 KB produce, medians of 3 alternating runs: 53k against 56k msg/s
in sync mode, 75k against 86k in async mode), likely because the kernel runs a submitted fsync
on a per-CPU worker of the submitting CPU, where it competes with the event loop.

In ``sync`` mode a round starts as soon as something is dirty; sends are acknowledged when their
offsets become durable, and consumers see only durable data. In ``async`` mode a round runs every
``flush_interval_ms``; sends are acknowledged after ``write(2)``.

An fsync that fails is never retried as if it had worked (fsyncgate): the waiting sends fail,
and a later fsync's success is not believed for that flushable. EIO (or any error other than a
full disk or a lack of descriptors): it goes to ``failed`` and produce to it is refused until
the broker restarts and recovery re-verifies the log. ENOSPC/EDQUOT, in either flush mode: the
waiters fail with STORAGE_FULL (retriable, with the watermarks' retry-after), the flushable goes
to ``full`` and gets no more fsyncs; once the watermarks say space is back,
:meth:`Flusher.retry_full` makes its undurable tail durable again through a new descriptor (a
queue's log: read back from the page cache, both CRCs checked, written in place and fsynced, see
:meth:`ferrymq.storage.log.Log.rewrite_tail`; the scheduler's bucket files and a delivery
journal likewise) and it is back in service with no restart. A tail that cannot be read back
whole (the kernel dropped the pages) goes to ``failed``: restart needed.

A flush that could not open a file (EMFILE/ENFILE: an index file, a checkpoint, the directory;
never the fsync of data itself) is handled the same way, without the disk: its waiters fail
with BUSY (retriable, with the retry-after), it waits in ``full`` and :meth:`Flusher.retry_full`
tries it again at every housekeeping tick, whatever the disk says, until descriptors are free
(the rewrite is more than needed there, as no fsync failed, but it is the same safe path).

The two modes differ in what was promised before the fsync failed. Sync mode acknowledged and
showed nothing undurable: the failed sends were never acknowledged (idempotent producers'
retries are answered with the offsets already stored once the rewrite succeeded). Async mode
acknowledged the sends after ``write(2)`` and consumers may have read them: the rewrite writes
exactly those bytes again from the page cache after checking them; if they cannot be read back
intact, the queue is refused and logged CRITICAL with the offset range at risk, and the
restart's recovery keeps the valid prefix (see docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeGuard, runtime_checkable

from ferrymq.broker.descriptors import is_out_of_descriptors, out_of_descriptors_error
from ferrymq.broker.stats import FlushStats
from ferrymq.broker.watermarks import is_disk_full
from ferrymq.errors import BrokerError, BusyError, StorageFailureError, StorageFullError
from ferrymq.storage.aio import AioFsync

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


@runtime_checkable
class FdFlushable(Flushable, Protocol):
    """A flushable whose flush is usually one fsync of one descriptor, which the flusher can
    run together with others' (a queue's log, see :meth:`ferrymq.storage.log.Log.flush_begin`)."""

    def flush_begin(self) -> tuple[int, int] | None:
        """(descriptor, position it makes durable), or None: call ``flush_blocking``."""
        ...

    def flush_end(self, end: int, fsynced: bool) -> int:
        """After the fsync of what ``flush_begin`` returned; the position now durable."""
        ...


@runtime_checkable
class Rewritable(Protocol):
    """A flushable whose undurable tail can be written again after an ENOSPC fsync failure."""

    def rewrite_undurable(self) -> int:
        """Write the undurable tail again and fsync it (loop thread); the position durable."""
        ...


def flush_postponed(exc: BaseException | None) -> TypeGuard[BrokerError]:
    """Whether the error a flushable's waiters got means its flush is only postponed (disk
    full, descriptors out: :meth:`Flusher.retry_full` makes the tail durable later and the
    waiters may wait again), not failed for good."""
    return isinstance(exc, (StorageFullError, BusyError))


PARALLEL_AFTER_S = 0.002
"""A flush round that took at least this long makes the next one fsync its queues in parallel
(on the pool); a shorter one, one after the other on the flusher thread."""


class Flusher:
    """Owns the flusher thread. ``mark_dirty`` is called on the loop thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, sync: bool, interval_ms: int,
                 threads: int = 1, aio: bool = True) -> None:
        self._loop = loop
        self._pool = ThreadPoolExecutor(threads - 1, "ferrymq-fsync") if threads > 1 else None
        self._sync = sync
        self._interval_s = interval_ms / 1000.0
        self._cond = threading.Condition()
        self._dirty: set[Flushable] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ferrymq-flusher", daemon=True)
        self.failed: set[Flushable] = set()
        """Failed fsync, restart needed (produce refused)."""
        self.full: dict[Flushable, BaseException] = {}
        """Failed fsync with ENOSPC/EDQUOT, or a flush that could not open a file
        (EMFILE/ENFILE), waiting for :meth:`retry_full` (produce refused)."""
        self.on_disk_full: Callable[[BaseException], None] | None = None
        """Told about every ENOSPC/EDQUOT fsync failure (the broker's watermarks)."""
        self.retry_after_ms = 0
        """The retry-after of STORAGE_FULL errors given to waiting sends."""
        self.space_back = True
        """What the watermarks said at the last :meth:`retry_full`: the disk is not full (owners
        of work stalled by a full disk, such as the transaction coordinator, retry then)."""
        self._aio = AioFsync.open(threads) if threads > 1 and aio else None
        self.rounds = 0
        self.stats = FlushStats()
        """Round durations and sizes (for ``/metrics``; written by the flusher thread only)."""
        self.parallel_rounds = 0
        """Rounds whose fsyncs ran on the pool."""
        self.aio_rounds = 0
        """Rounds whose fsyncs were submitted together (native AIO)."""
        self.aio_fsyncs = 0
        """Descriptors fsynced by those submissions (``aio_fsyncs / aio_rounds``: queues per
        group commit)."""
        self._last_round_s = 0.0

    def start(self) -> None:
        """Start the flusher thread."""
        self._thread.start()

    def write_error(self, exc: OSError, what: str) -> BrokerError:
        """The error to answer for a failed write of ``what``: STORAGE_FULL with the
        retry-after for ENOSPC/EDQUOT (and :attr:`on_disk_full` hears of it), BUSY with the
        retry-after for EMFILE/ENFILE, else STORAGE_ERROR."""
        return (self.shortage_error(exc, f"write {what}")
                or StorageFailureError(f"cannot write {what}: {exc}"))

    def shortage_error(self, exc: BaseException, what: str) -> BrokerError | None:
        """The error to answer when ``what`` failed for lack of disk space (STORAGE_FULL, and
        :attr:`on_disk_full` hears of it) or of descriptors (BUSY), both with the retry-after;
        None for any other failure."""
        if is_disk_full(exc):
            if self.on_disk_full is not None:
                self.on_disk_full(exc)
            return StorageFullError(f"cannot {what}, disk full: {exc}",
                                    retry_after_ms=self.retry_after_ms)
        if is_out_of_descriptors(exc):
            return out_of_descriptors_error(exc, what, self.retry_after_ms)
        return None

    def check_writable(self, qs: Flushable) -> None:
        """Refuse to write to ``qs`` while its last fsync failed (loop thread).

        Raises:
            StorageFailureError: it failed for good (restart needed).
            StorageFullError: it waits for disk space (retry-after).
            BusyError: it waits for file descriptors (retry-after).
        """
        if qs in self.failed:
            raise StorageFailureError(f"{qs} had an fsync failure; restart needed")
        why = self.full.get(qs)
        if why is None:
            return
        if is_out_of_descriptors(why):
            raise out_of_descriptors_error(why, f"flush {qs} (waiting for descriptors)",
                                           self.retry_after_ms)
        raise StorageFullError(f"{qs} waits for disk space (an fsync failed for lack of space)",
                               retry_after_ms=self.retry_after_ms)

    def mark_dirty(self, qs: Flushable) -> None:
        """Note that ``qs`` has unflushed writes (wakes the thread in sync mode)."""
        self.mark_all_dirty((qs,))

    def mark_all_dirty(self, flushables: Iterable[Flushable]) -> None:
        """Note that every one of ``flushables`` has unflushed writes, all at once, so that the
        next round fsyncs them together (a PRODUCE request's queues, whose answer waits for
        all of them; wakes the thread in sync mode)."""
        # one waiting in ``full``: no fsync is believed until retry_full rewrote its tail
        new = [qs for qs in flushables if qs not in self.full]
        if not new:
            return
        with self._cond:
            before = len(self._dirty)
            self._dirty.update(new)
            if self._sync and len(self._dirty) > before:
                self._cond.notify()

    def stop(self) -> None:
        """Flush what is dirty one last time and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()
        if self._pool is not None:
            self._pool.shutdown()
        if self._aio is not None:
            self._aio.close()

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
            results = self._flush_all(batch)
            self.rounds += 1
            if results:
                try:
                    self._loop.call_soon_threadsafe(self._on_flushed, results)
                except RuntimeError:  # loop closed: shutdown already flushed synchronously
                    return
            if stopping:
                return

    def _flush_all(self, batch: set[Flushable]
                   ) -> list[tuple[Flushable, int, BaseException | None]]:
        """fsync every one of ``batch``: after a fast round, together through AIO (or this
        thread all of them in turn); after a slow one the pool takes all but one and this thread
        the last."""
        start = time.perf_counter()
        fast = self._last_round_s < PARALLEL_AFTER_S
        if self._aio is not None and len(batch) > 1 and fast:
            results = self._flush_together(self._aio, batch)
        elif self._pool is None or len(batch) < 2 or fast:
            results = [_flush_one(qs) for qs in batch]
        else:
            self.parallel_rounds += 1
            items = list(batch)
            futures = [self._pool.submit(_flush_one, qs) for qs in items[1:]]
            first = _flush_one(items[0])
            results = [first, *(f.result() for f in futures)]
        self._last_round_s = time.perf_counter() - start
        self.stats.record(self._last_round_s, len(batch))
        return results

    def _flush_together(self, aio: AioFsync, batch: set[Flushable]
                        ) -> list[tuple[Flushable, int, BaseException | None]]:
        """fsync the single-descriptor flushes of ``batch`` with one AIO submission (each
        log's flush lock held meanwhile), then the others one by one."""
        results: list[tuple[Flushable, int, BaseException | None]] = []
        begun: list[tuple[FdFlushable, int, int]] = []
        rest: list[Flushable] = []
        for qs in batch:
            if not isinstance(qs, FdFlushable):
                rest.append(qs)
                continue
            try:
                target = qs.flush_begin()
            except Exception as exc:  # noqa: BLE001 - any failure must reach the waiters
                _log_failure(qs, exc)
                results.append((qs, -1, exc))
                continue
            if target is None:
                rest.append(qs)
            else:
                begun.append((qs, *target))
        if begun:
            self.aio_rounds += 1
            self.aio_fsyncs += len(begun)
            errs: list[int] | None = None
            failure: BaseException | None = None
            try:
                errs = aio.fsync([fd for _qs, fd, _end in begun])
            except Exception as exc:  # noqa: BLE001 - nothing of this round is durable
                failure = exc
            finally:
                for i, (fq, _fd, end) in enumerate(begun):
                    err = failure
                    if err is None and errs is not None and errs[i]:
                        err = OSError(errs[i], os.strerror(errs[i]))
                    durable = fq.flush_end(end, err is None)
                    if err is not None:
                        _log_failure(fq, err)
                    results.append((fq, -1, err) if err is not None else (fq, durable, None))
        results += [_flush_one(qs) for qs in rest]
        return results

    def _on_flushed(self, results: list[tuple[Flushable, int, BaseException | None]]) -> None:
        for qs, durable, exc in results:
            if exc is not None:
                if is_disk_full(exc) and isinstance(qs, Rewritable):
                    self.full[qs] = exc
                    if self.on_disk_full is not None:
                        self.on_disk_full(exc)
                    qs.on_flush_failed(StorageFullError(
                        f"fsync failed for lack of space, not yet durable: {exc}",
                        retry_after_ms=self.retry_after_ms))
                    continue
                if is_out_of_descriptors(exc) and isinstance(qs, Rewritable):
                    if qs not in self.full:
                        log.warning("%s: flush postponed, out of file descriptors (%s); "
                                    "retried until they are free", qs, exc)
                    self.full[qs] = exc
                    qs.on_flush_failed(out_of_descriptors_error(
                        exc, "flush (not yet durable)", self.retry_after_ms))
                    continue
                self.failed.add(qs)
                qs.on_flush_failed(StorageFailureError(f"fsync failed: {exc}"))
                continue
            if qs in self.failed or qs in self.full:
                continue  # fsyncgate: a success after a failure proves nothing
            qs.on_flushed(durable, self._sync)

    def retry_full(self, space_back: bool) -> None:
        """On the loop thread (housekeeping): rewrite and fsync the tails of flushables whose
        fsync failed with ENOSPC/EDQUOT, when ``space_back``, and of those whose flush could
        not open a file (EMFILE/ENFILE), always. One whose tail cannot be read back whole goes
        to ``failed`` (restart needed); one that is still short of space or descriptors waits."""
        self.space_back = space_back
        for qs, why in list(self.full.items()):
            if is_disk_full(why) and not self.space_back:
                continue
            assert isinstance(qs, Rewritable)
            try:
                durable = qs.rewrite_undurable()
            except OSError as exc:
                if is_out_of_descriptors(exc):
                    self.full[qs] = exc
                    return  # none free: the others would fail alike
                if not is_disk_full(exc):
                    self._give_up(qs, exc)
                    continue
                log.warning("%s: still cannot write its tail: %s", qs, exc)
                self.full[qs] = exc
                self.space_back = False
                if self.on_disk_full is not None:
                    self.on_disk_full(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - anything else: restart needed
                self._give_up(qs, exc)
                continue
            del self.full[qs]
            log.warning("%s: tail written again after %s; back in service", qs,
                        "the disk was full" if is_disk_full(why) else
                        "file descriptors ran out")
            qs.on_flushed(durable, self._sync)

    def _give_up(self, qs: Flushable, exc: BaseException) -> None:
        """The tail of ``qs`` cannot be made durable again: restart needed."""
        log.critical("%s: cannot rewrite its tail after a full disk (%s); %s", qs, exc,
                     "writes acknowledged since its last fsync may be lost; restart to recover"
                     if not self._sync else "restart to recover")
        del self.full[qs]
        self.failed.add(qs)
        qs.on_flush_failed(StorageFailureError(f"cannot rewrite after a full disk: {exc}"))


def _flush_one(qs: Flushable) -> tuple[Flushable, int, BaseException | None]:
    try:
        return qs, qs.flush_blocking(), None
    except Exception as exc:  # noqa: BLE001 - any failure must reach the waiters
        _log_failure(qs, exc)
        return qs, -1, exc


def _log_failure(qs: Flushable, exc: BaseException) -> None:
    """A failed fsync is CRITICAL; a flush that could not open a file is only postponed (the
    loop thread says so once, see ``Flusher._on_flushed``)."""
    if not is_out_of_descriptors(exc):
        log.critical("fsync of %s failed: %s", qs, exc)
