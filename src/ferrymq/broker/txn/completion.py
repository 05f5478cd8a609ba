"""Completing decided transactions: decision record, markers, offsets, LSO release, CompleteX.

Steps 1-4 of :mod:`ferrymq.broker.txn` for one transaction, from wherever an earlier attempt
stopped: the PrepareX record (unless written), durable; a marker on every touched queue where the
producer's transaction is still open (all in one event-loop callback), durable on every touched
queue; on commit the offsets applied to their groups; then, in one callback, every touched
queue's LSO released and CompleteX recorded. Only then does the transaction count as complete
(:meth:`~.state.TxnBook.complete`). A storage error on the way leaves the decision standing:
:meth:`Completer.resume` (housekeeping, once space is back), a retried END_TXN or a restart
(:meth:`Completer.recover`) goes on from there.

In a cluster (:attr:`Completer.remote`, :mod:`.cluster`) the markers of queues led by other
brokers are written by those leaders (TXN_MARKERS), each releasing its own queue's LSO, and a
commit's offsets go to the group's coordinator; a new coordinator resumes decided transactions
from the replicated state log. Every marker written here, or asked for on a queue this broker
leads, moves :attr:`Completer.mark_seq` (a transactional batch verified before it must not be
appended after it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ferrymq._faults import crash_point
from ferrymq._time import Clock
from ferrymq.broker.txn.state import OPEN_STATES, PREPARE_STATES, TxnBook, TxnMeta
from ferrymq.errors import BrokerError, StorageFailureError, StorageFullError
from ferrymq.protocol.markers import encode_marker
from ferrymq.protocol.messages import TxnState

if TYPE_CHECKING:
    from ferrymq.broker.consumer_groups import ConsumerGroupCoordinator
    from ferrymq.broker.topics import QueueState, TopicRegistry
    from ferrymq.broker.txn.cluster import TxnCluster
    from ferrymq.broker.txn.statelog import StateLog

log = logging.getLogger("ferrymq.broker")


class Completer:
    """Drives decided transactions to completion (see the module docstring).

    Args:
        book: the transactional ids.
        statelog: ``%TXN%state`` (decision and completion records; appends and waits).
        topics: the touched queues.
        consumer_groups: where a commit's offsets go.
        clock: marker timestamps.
        busy_retry_after_ms: the retry-after of a STORAGE_FULL answer.
    """

    def __init__(self, book: TxnBook, statelog: StateLog, topics: TopicRegistry,
                 consumer_groups: ConsumerGroupCoordinator, clock: Clock, *,
                 busy_retry_after_ms: int) -> None:
        self.book = book
        self.statelog = statelog
        self.topics = topics
        self.consumer_groups = consumer_groups
        self.clock = clock
        self.busy_retry_after_ms = busy_retry_after_ms
        self._running: dict[str, asyncio.Future[None]] = {}
        """Tid -> done when its completion in progress stops (completed or stalled)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._unwritten: set[str] = set()
        """Tids decided (PrepareX in memory) whose decision record is not in the log yet."""
        self._stalls: dict[str, BrokerError] = {}
        """Tids decided whose completion stopped on a storage error (the last one)."""
        self.commits = 0
        self.aborts = 0
        self.remote: TxnCluster | None = None
        """A cluster's coordinator: markers and offsets on other brokers."""
        self.mark_seq = 0
        """Bumped at every marker written or asked for here."""
        self.marked: dict[tuple[str, int, int], int] = {}
        """(topic, queue, producer id) -> :attr:`mark_seq` of its last marker here."""

    async def wait(self, meta: TxnMeta) -> None:
        """Wait until the completion of ``meta`` in progress (if any) stops."""
        if meta.completing:
            await asyncio.shield(self._running[meta.tid])

    async def end(self, meta: TxnMeta, commit: bool) -> None:
        """Commit or abort ``meta``'s open transaction, or finish one decided before whose
        completion stopped on a storage error.

        Raises:
            StorageFullError: the disk is full; the decision stands and :meth:`resume` finishes
                it once space is back.
            StorageFailureError: an fsync failed otherwise (restart needed).
            InvalidTxnStateError: the opposite of a decision taken before was asked for.
        """
        if meta.completing:
            await asyncio.shield(self._running[meta.tid])
            self._check_finished(meta)
            return
        if self.book.decide(meta, commit):
            self._unwritten.add(meta.tid)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        meta.completing = True
        self._running[meta.tid] = done
        try:
            await self._drive(meta, commit)
        except (StorageFullError, StorageFailureError) as exc:
            if meta.tid not in self._stalls:
                log.warning("transactions: the %s of %s is decided but cannot complete yet "
                            "(%s); it completes once the storage is back", "commit" if commit
                            else "abort", meta.tid, exc)
            self._stalls[meta.tid] = exc
            raise
        finally:
            meta.completing = False
            del self._running[meta.tid]
            if not done.done():
                done.set_result(None)

    def decision_written(self, meta: TxnMeta) -> bool:
        """Whether ``meta`` is decided and its decision is in the state log (a decision taken
        while the log could not be written lives in memory until it is)."""
        return meta.state in PREPARE_STATES and meta.tid not in self._unwritten

    def _check_finished(self, meta: TxnMeta) -> None:
        """After waiting for another request's completion of ``meta``: raise if it stalled."""
        if meta.state not in PREPARE_STATES:
            return
        exc = self._stalls.get(meta.tid)
        what = "commit" if meta.state == TxnState.PREPARE_COMMIT else "abort"
        if isinstance(exc, StorageFailureError):
            raise StorageFailureError(f"the {what} of {meta.tid!r} cannot complete: {exc}")
        raise StorageFullError(f"the {what} of {meta.tid!r} waits for disk space: {exc}",
                               retry_after_ms=self.busy_retry_after_ms)

    async def _drive(self, meta: TxnMeta, commit: bool) -> None:
        """Steps 1-4 from wherever a previous attempt stopped."""
        sl = self.statelog
        sq = sl.queue
        if meta.tid in self._unwritten:
            end = sl.save(meta)  # the decision; raises with nothing written
            self._unwritten.discard(meta.tid)
        else:
            sl.flusher.check_writable(sq)
            end = sq.log.end_offset
        await sl.durable(sq, end)
        crash_point("txn.prepare_durable")
        await self._finish(meta, commit)

    async def _finish(self, meta: TxnMeta, commit: bool) -> None:
        now = self.clock.wall_ms()
        remote = self.remote
        others = [] if remote is None else [q for q in meta.queues if not remote.is_local(*q)]
        self.write_markers(meta, commit, now, skip=set(others))
        queues = []
        for topic, queue in meta.queues:  # markers written now or by an earlier attempt
            if (topic, queue) in others:
                continue
            try:
                queues.append(self.topics.queue(topic, queue))
            except BrokerError:
                continue
        for qs in queues:
            self.statelog.flusher.check_writable(qs)
        for qs in queues:
            await self.statelog.durable(qs, qs.log.end_offset)
        if remote is not None and others:
            await remote.send_markers(meta, commit, self.statelog.queue.log.end_offset - 1,
                                      others)
        crash_point("txn.markers_durable")
        if commit:
            if remote is not None:
                for group, offs in meta.offsets.items():
                    await remote.apply_offsets(group, offs)
                    self.book.offsets_done(meta, group)
            else:
                self._apply_offsets(meta)
            crash_point("txn.offsets_applied")
        self._complete(meta, commit)

    def write_markers(self, meta: TxnMeta, commit: bool, now: int,
                      skip: set[tuple[str, int]] | None = None) -> set[QueueState]:
        """Append a marker to every queue the transaction touched where it is still open (a
        queue registered whose batch failed needs none, and one that got its marker before a
        full disk stopped the others must not get a second), all in this callback.

        Raises:
            StorageFullError, StorageFailureError: a marker could not be written (the ones
                before it were: a retry writes the rest).
        """
        out: set[QueueState] = set()
        coord = self.statelog.queue.log.end_offset - 1
        for topic, queue in meta.queues:
            if skip and (topic, queue) in skip:
                continue
            try:
                qs = self.topics.queue(topic, queue)
            except BrokerError:
                continue  # the topic was deleted
            if meta.pid not in qs.log.ongoing_txns():
                continue
            self.append_marker(qs, meta.pid, meta.epoch, commit, meta.tid, coord, now)
            out.add(qs)
        return out

    def append_marker(self, qs: QueueState, pid: int, epoch: int, commit: bool, tid: str,
                      coord: int, now: int) -> int:
        """Append one COMMIT/ABORT control batch to ``qs``; the end offset to wait for."""
        self.note_marker(qs, pid)
        batch = encode_marker(producer_id=pid, producer_epoch=epoch, commit=commit,
                              transactional_id=tid, coordinator_offset=coord, timestamp_ms=now)
        return self.statelog.append(qs, batch, now, "a transaction marker")

    def note_marker(self, qs: QueueState, pid: int) -> None:
        """``pid``'s transaction on ``qs`` ends here now (a marker written or asked for)."""
        self.mark_seq += 1
        self.marked[(qs.topic, qs.queue, pid)] = self.mark_seq

    def _apply_offsets(self, meta: TxnMeta) -> None:
        """Step 3 (idempotent: a retry or recovery applies them again).

        Raises:
            StorageFullError, StorageFailureError: a group's offsets could not be written.
        """
        for group, offs in meta.offsets.items():
            try:
                self.consumer_groups.apply_txn_offsets(group, offs)
            except OSError as exc:
                raise self.statelog.flusher.write_error(
                    exc, f"the offsets of group {group!r}") from None
            self.book.offsets_done(meta, group)

    def _complete(self, meta: TxnMeta, commit: bool) -> None:
        """Step 4: release the queues' LSOs (one callback) and record CompleteX."""
        for topic, queue in meta.queues:
            try:
                qs = self.topics.queue(topic, queue)
            except BrokerError:
                continue
            qs.release_txn(meta.pid)
        self.book.complete(meta)
        try:
            self.statelog.save(meta)
        except BrokerError as exc:  # the PrepareX stays the newest record: recovery redoes it
            log.warning("transactions: CompleteX of %s not recorded (%s); harmless (a restart "
                        "completes it again)", meta.tid, exc)
        if self._stalls.pop(meta.tid, None) is not None:
            log.warning("transactions: the %s of %s completed after the disk was full",
                        "commit" if commit else "abort", meta.tid)
        if commit:
            self.commits += 1
        else:
            self.aborts += 1

    # -- housekeeping ----------------------------------------------------------------------------

    def resume(self, meta: TxnMeta) -> None:
        """Finish a decided transaction whose completion stalled, in a task."""
        task = asyncio.get_running_loop().create_task(self._resume(meta))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resume(self, meta: TxnMeta) -> None:
        if meta.completing or meta.state not in PREPARE_STATES:
            return
        try:
            await self.end(meta, meta.state == TxnState.PREPARE_COMMIT)
        except BrokerError as exc:
            log.debug("transactions: %s still cannot complete: %s", meta.tid, exc)
        except Exception:
            log.exception("transactions: completing %s failed", meta.tid)

    def abort(self, meta: TxnMeta) -> None:
        """Abort ``meta``'s open transaction in a task (a timeout; errors are logged)."""
        asyncio.get_running_loop().create_task(self._abort_logged(meta))

    async def _abort_logged(self, meta: TxnMeta) -> None:
        try:
            await self.end(meta, commit=False)
        except Exception:
            log.exception("transactions: timeout abort of %s failed", meta.tid)

    # -- start-up --------------------------------------------------------------------------------

    def recover(self) -> None:
        """Finish every PrepareX of the replayed state, abort the queues' orphan open
        transactions, flush what that wrote and seed every queue's open transactions (before
        the broker listens; writes synchronously)."""
        now = self.clock.wall_ms()
        touched: set[QueueState] = set()
        for meta in list(self.book.txns.values()):
            if meta.state in PREPARE_STATES:
                commit = meta.state == TxnState.PREPARE_COMMIT
                log.info("transactions: finishing the %s of %s (producer %d epoch %d)",
                         "commit" if commit else "abort", meta.tid, meta.pid, meta.epoch)
                touched |= self.write_markers(meta, commit, now)
                if commit:
                    self._apply_offsets(meta)
                self._complete(meta, commit)
        # orphans: a queue's open transaction that no open tid owns at that queue
        for qs in self.topics.all_queues():
            for pid in list(qs.log.ongoing_txns()):
                owner = self.book.by_pid.get(pid)
                if (owner is not None and owner.state in OPEN_STATES
                        and (qs.topic, qs.queue) in owner.queues):
                    continue
                epoch = owner.epoch if owner is not None else _producer_epoch(qs, pid)
                log.warning("transactions: %s holds an open transaction of producer %d that no "
                            "transactional id owns; aborting it", qs, pid)
                self.append_marker(qs, pid, epoch, False, owner.tid if owner else "", -1, now)
                touched.add(qs)
        sync = self.statelog.sync
        for qs in touched:
            qs.log.flush()
            qs.on_flushed(qs.log.end_offset, sync)
        if self.statelog.dirty:
            sq = self.statelog.queue
            sq.log.flush()
            sq.on_flushed(sq.log.end_offset, sync)
        for qs in self.topics.all_queues():
            for pid, first in qs.log.ongoing_txns().items():
                qs.open_txns[pid] = first


def _producer_epoch(qs: QueueState, pid: int) -> int:
    """The epoch a queue's producer state holds for ``pid`` (0 if it has none)."""
    entry = qs.log.producer_state.producers.get(pid)
    return entry.epoch if entry is not None else 0
