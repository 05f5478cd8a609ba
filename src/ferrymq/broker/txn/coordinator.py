"""The transaction coordinator: INIT_TXN, transactional sends, offsets, END_TXN, staged commits.

It checks each request against :class:`~.state.TxnBook` (which holds and moves every
transactional id's state), records every change in ``%TXN%state`` (:class:`~.statelog.StateLog`)
before answering, and hands decided transactions to :class:`~.completion.Completer`. The
package docstring (:mod:`ferrymq.broker.txn`) has the theory of operation; in a cluster
:mod:`.cluster` is attached (:meth:`TxnCoordinator.attach`) and says what changes.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ferrymq._faults import crash_point
from ferrymq._time import Clock
from ferrymq.broker.consumer_groups import check_group_name, check_offsets
from ferrymq.broker.txn.completion import Completer
from ferrymq.broker.txn.state import (
    DONE_STATES,
    OPEN_STATES,
    PREPARE_STATES,
    TxnBook,
    TxnEvent,
    TxnMeta,
    can,
)
from ferrymq.broker.txn.statelog import StateLog, sink_record
from ferrymq.errors import (
    BatchAlreadyCommittedError,
    BrokerError,
    IllegalGenerationError,
    InvalidRequestError,
    InvalidTxnStateError,
    InvalidTxnTimeoutError,
    NotCoordinatorError,
    ProducerFencedError,
    StagedTxnExpiredError,
    StorageFailureError,
    StorageFullError,
    TransactionTimedOutError,
    UnknownMemberError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.messages import Acks, Durability, TxnState

if TYPE_CHECKING:
    from ferrymq.broker.config import BrokerConfig
    from ferrymq.broker.consumer_groups import ConsumerGroupCoordinator
    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.producer_ids import ProducerIdManager
    from ferrymq.broker.topics import QueueState, TopicRegistry
    from ferrymq.broker.txn.cluster import TxnCluster, Verified
    from ferrymq.protocol.records import BatchHeader

log = logging.getLogger("ferrymq.broker")


class TxnCoordinator:
    """Transactional ids, their transactions, sink fences. See the package docstring."""

    def __init__(
        self, config: BrokerConfig, topics: TopicRegistry, flusher: Flusher,
        consumer_groups: ConsumerGroupCoordinator, producer_ids: ProducerIdManager, clock: Clock,
        data_dir: Path,
    ) -> None:
        self.config = config
        self.topics = topics
        self.flusher = flusher
        self.consumer_groups = consumer_groups
        self.producer_ids = producer_ids
        self.clock = clock
        self.sync = config.flush == "sync"
        self.book = TxnBook()
        self.statelog = StateLog(topics, flusher, clock, data_dir, sync=self.sync,
                                 busy_retry_after_ms=config.busy_retry_after_ms)
        self.completer = Completer(self.book, self.statelog, topics, consumer_groups, clock,
                                   busy_retry_after_ms=config.busy_retry_after_ms)
        self.cluster: TxnCluster | None = None
        """A cluster's part (None: a single broker, which coordinates everything)."""

    def attach(self, cluster: TxnCluster) -> None:
        """Coordinate as a broker of a cluster (see :mod:`.cluster`)."""
        self.cluster = cluster
        self.completer.remote = cluster
        self.statelog.cluster = True

    @property
    def state_queue(self) -> QueueState:
        """``%TXN%state``'s one queue (created on first use)."""
        return self.statelog.queue

    @property
    def commits(self) -> int:
        """Transactions committed since start."""
        return self.completer.commits

    @property
    def aborts(self) -> int:
        """Transactions aborted since start."""
        return self.completer.aborts

    # -- start-up and housekeeping ---------------------------------------------------------------

    def load(self) -> None:
        """Rebuild the state from the snapshot and the state log, finish interrupted
        commits/aborts, abort orphans and seed every queue's open transactions. Runs before
        the broker listens; writes synchronously and flushes what it wrote. A cluster's
        broker has nothing to load: the coordinator rebuilds when it starts leading
        ``%TXN%state`` (:meth:`rebuild`)."""
        if self.config.metadata:
            return
        self.statelog.load(self.book)
        self.completer.recover()

    def rebuild(self) -> int:
        """A cluster's new coordinator: the book from the whole state log (every earlier
        state forgotten); how many transactional ids it holds."""
        book = self.book
        book.clear()
        book.pending_offsets.clear()
        book.unanswered.clear()
        self.statelog.replay_all(book)
        for meta in book.txns.values():
            if meta.state in OPEN_STATES or meta.state in PREPARE_STATES:
                for group, offs in meta.offsets.items():
                    book.add_offsets(meta, group, ((t, q, o) for (t, q), o in offs.items()))
        return len(book.txns)

    def resume_decided(self, *, force: bool = False) -> None:
        """Drive every decided transaction whose completion stopped on (``force``: whatever
        stopped it, e.g. a coordinator that died)."""
        for meta in list(self.book.txns.values()):
            if meta.state in PREPARE_STATES and not meta.completing and (
                    force or self.flusher.space_back):
                self.completer.resume(meta)

    def tick(self) -> None:
        """Abort transactions past their timeout and staged ones past their TTL; forget idle
        transactional ids; write the snapshot when due."""
        now = self.clock.wall_ms()
        if self.cluster is not None and not self.cluster.leads:
            return
        for meta in list(self.book.txns.values()):
            if meta.completing:
                continue
            if meta.state in PREPARE_STATES:  # stalled on a full disk (in a cluster: on
                # another broker) go on when space is back
                if self.flusher.space_back or self.cluster is not None:
                    self.completer.resume(meta)
                continue
            if self.book.expired(meta, now):
                log.info("transactions: aborting the %s transaction of %s after %d ms",
                         meta.state.name.lower(), meta.tid,
                         now - (meta.started_ms if meta.state == TxnState.ONGOING
                                else meta.staged_ms))
                self._bump(meta, "timeout")
                self.completer.abort(meta)
            elif self.book.idle(meta, now, self.config.txn_id_expiration_ms):
                self.book.forget(meta)
                self.statelog.dirty = True
        self.snapshot()

    def snapshot(self, *, force: bool = False) -> None:
        """Write the snapshot if anything changed (at most about once a second)."""
        self.statelog.snapshot(self.book, force=force)

    def retention_floors(self) -> dict[tuple[int, int], int]:
        """The state log must be kept from the snapshot's offset."""
        return self.statelog.retention_floors()

    def close(self) -> None:
        """Write the final snapshot (after the logs' last flush)."""
        self.snapshot(force=True)

    def _bump(self, meta: TxnMeta, why: str) -> None:
        self.book.bump(meta, why, self.producer_ids.allocate)

    def _begin_if_needed(self, meta: TxnMeta) -> None:
        self.book.begin(meta, self.clock.wall_ms(), self.config.txn_max_open)

    # -- INIT_TXN ----------------------------------------------------------------------------

    async def init(self, req: m.InitTxnRequest) -> m.InitTxnResponse:
        """Start (or restart) a transactional producer. See :class:`m.InitTxnRequest`."""
        cfg = self.config
        tid = req.transactional_id
        if not tid or len(tid) > m.MAX_NAME_CHARS:
            raise InvalidRequestError(f"a transactional id has 1..{m.MAX_NAME_CHARS} characters")
        if req.txn_timeout_ms < 0 or req.txn_timeout_ms > cfg.txn_max_timeout_ms:
            raise InvalidTxnTimeoutError(
                f"transaction timeout {req.txn_timeout_ms} ms is not in 0.."
                f"{cfg.txn_max_timeout_ms} (txn_max_timeout_ms)")
        timeout = req.txn_timeout_ms or cfg.txn_default_timeout_ms
        meta = self.book.txns.get(tid)
        if meta is None:
            meta = TxnMeta(tid, self.producer_ids.allocate(), 0, TxnState.EMPTY, timeout)
            self.book.put(meta)
            await self.statelog.save_durable(meta)
            return m.InitTxnResponse(meta.pid, meta.epoch, timeout)
        await self.completer.wait(meta)
        if meta.state in PREPARE_STATES:  # decided, stalled on a full disk: finish it first
            await self.completer.end(meta, meta.state == TxnState.PREPARE_COMMIT)
        self.book.unanswered.pop(tid, None)
        if req.expected_producer_id >= 0:
            try:
                self.book.check_epoch(meta, req.expected_producer_id, req.expected_epoch)
            except TransactionTimedOutError:
                pass  # resume after a timeout (KIP-360): bump once more below
        if meta.state in OPEN_STATES:
            self._bump(meta, "init")
            await self.completer.end(meta, commit=False)
        self._bump(meta, "init")
        self.book.reset(meta, timeout)
        await self.statelog.save_durable(meta)
        return m.InitTxnResponse(meta.pid, meta.epoch, timeout)

    # -- PRODUCE -----------------------------------------------------------------------------

    def check_produce(self, qs: QueueState, h: BatchHeader) -> int:
        """Admit a transactional batch for ``qs`` (before its append); register the queue.

        Returns:
            The state log's end offset to wait for (sync mode), or -1 when nothing was written.

        Raises:
            InvalidTxnStateError, ProducerFencedError, TransactionTimedOutError,
            ConcurrentTransactionsError, BusyError, InvalidRequestError.
        """
        if qs.topic.startswith("%"):
            raise InvalidRequestError("transactions cannot write to internal topics")
        meta = self.book.producer(h.producer_id, h.producer_epoch)
        self._begin_if_needed(meta)
        key = (qs.topic, qs.queue)
        if key in meta.queues:
            return -1
        meta.queues[key] = None
        try:
            return self.statelog.save(meta)
        except BrokerError:  # not registered: the batch is not appended either
            del meta.queues[key]
            raise

    def admit(self, qs: QueueState, h: BatchHeader, verified: Verified | None) -> None:
        """A cluster's queue leader: admit a transactional batch for ``qs`` (before its
        append) if its producer's transaction is open here, or the coordinator registered the
        queue (``verified``) and no marker ended that transaction here since.

        Raises:
            InvalidTxnStateError: not verified (the transaction ended meanwhile).
            InvalidRequestError: an internal topic.
        """
        if qs.topic.startswith("%"):
            raise InvalidRequestError("transactions cannot write to internal topics")
        pid = h.producer_id
        if pid in qs.open_txns:
            return  # the queue's producer state fences older epochs
        got = None if verified is None else verified.get((qs.topic, qs.queue, pid))
        if got is None or got[0] != h.producer_epoch:
            raise InvalidTxnStateError(
                f"producer {pid} epoch {h.producer_epoch} has no transaction registered "
                f"with {qs}: retry (the coordinator registers it)")
        if self.completer.marked.get((qs.topic, qs.queue, pid), -1) > got[1]:
            raise InvalidTxnStateError(
                f"the transaction of producer {pid} on {qs} ended while this batch was being "
                "verified: it is not part of it")

    async def add_queue(self, pid: int, epoch: int, topic: str, queue: int) -> None:
        """TXN_ADD_QUEUE (a cluster's coordinator): register ``topic``/``queue`` with the
        open transaction of ``pid`` at ``epoch`` (begun if needed), replicated before the
        answer.

        Raises:
            NotCoordinatorError, ProducerFencedError, TransactionTimedOutError,
            InvalidTxnStateError, ConcurrentTransactionsError, BusyError.
        """
        if self.cluster is not None:
            self.cluster.check_owner(f"producer {pid}")
        if topic.startswith("%"):
            raise InvalidRequestError("transactions cannot write to internal topics")
        meta = self.book.producer(pid, epoch)
        self._begin_if_needed(meta)
        key = (topic, queue)
        if key not in meta.queues:
            meta.queues[key] = None
            try:
                end = self.statelog.save(meta)
            except BrokerError:
                del meta.queues[key]
                raise
        else:
            end = self.state_queue.log.end_offset  # (a retry: the same wait)
        await self.statelog.durable(self.state_queue, end)
        if self.cluster is not None and not self.cluster.leads:
            raise NotCoordinatorError("this broker stopped coordinating transactions")

    async def write_markers_here(self, pid: int, epoch: int, commit: bool, tid: str,
                                 coord: int, queues: list[tuple[str, int]]
                                 ) -> list[m.TxnMarkerResult]:
        """TXN_MARKERS (a cluster's queue leader): end ``pid``'s transaction on each of
        ``queues`` this broker leads with a marker (none where it is not open), replicated,
        then release the queue's LSO. One result per queue."""
        out: list[m.TxnMarkerResult] = []
        now = self.clock.wall_ms()

        async def one(topic: str, queue: int) -> None:
            try:
                qs = self.topics.queue(topic, queue)
                if qs.replica is not None:
                    qs.replica.check_produce(Acks.ALL)
                self.completer.note_marker(qs, pid)
                if pid in qs.log.ongoing_txns():
                    end = self.completer.append_marker(qs, pid, epoch, commit, tid, coord, now)
                    await self.statelog.durable(qs, end)
                qs.release_txn(pid)
            except BrokerError as exc:
                out.append((topic, queue, exc.code, str(exc)[:1024]))
                return
            out.append((topic, queue, 0, ""))

        await asyncio.gather(*(one(t, q) for t, q in queues))
        return out

    @staticmethod
    def on_append(qs: QueueState, pid: int, base_offset: int) -> None:
        """A transactional batch was appended: the queue's LSO stops at its transaction."""
        if pid not in qs.open_txns:
            qs.open_txns[pid] = base_offset

    # -- TXN_OFFSET_COMMIT -------------------------------------------------------------------

    async def add_offsets(self, req: m.TxnOffsetCommitRequest) -> m.CommitOffsetsResponse:
        """Record consumer offsets in the open transaction (applied at commit)."""
        meta = self.book.meta(req.transactional_id, req.producer_id, req.producer_epoch)
        check_group_name(req.group)
        g = self.consumer_groups.groups.get(req.group)
        if g is None:
            self.consumer_groups.check_new(req.group)
        if req.generation >= 0 and self._group_here(req.group):
            if g is None or req.member_id not in g.members:
                raise UnknownMemberError(f"group {req.group!r} has no member {req.member_id!r}")
            if req.generation != g.generation:
                raise IllegalGenerationError(
                    f"offsets for generation {req.generation}, group {req.group!r} is at "
                    f"{g.generation}")
        valid, out = check_offsets(
            self.topics, req.entries,
            lambda t, q: self.book.check_pending(req.group, t, q, meta.tid),
            local_end=self.cluster is None)
        if valid:
            self._begin_if_needed(meta)
            self.book.add_offsets(meta, req.group, valid)
            await self.statelog.save_durable(meta)
        return m.CommitOffsetsResponse(out)

    def _group_here(self, group: str) -> bool:
        """Whether this broker coordinates ``group`` (knows its members and generation); in a
        cluster another broker may (its generation is not checked then: the transaction's
        epoch fences the producer)."""
        if self.cluster is None:
            return True
        try:
            self.cluster.link.groups.check_coordinator(group)
        except NotCoordinatorError:
            return False
        return True

    def unstable(self, group: str) -> list[tuple[str, int]]:
        """Queues of ``group`` with offsets pending in an open transaction."""
        return self.book.unstable(group)

    def check_pending(self, group: str, topic: str, queue: int, tid: str = "") -> None:
        """Offsets of ``group`` on a queue may not be committed while a transaction other than
        ``tid``'s ("": any) holds offsets for it.

        Raises:
            ConcurrentTransactionsError.
        """
        self.book.check_pending(group, topic, queue, tid)

    # -- END_TXN -----------------------------------------------------------------------------

    async def end(self, req: m.EndTxnRequest) -> m.EndTxnResponse:
        """Commit, abort or stage the open transaction. A commit or abort asked with
        ``new_epoch`` moves the transactional id to a new epoch (KIP-890), answered for the
        producer's next transaction; a retry whose first answer was lost gets the same answer.
        Without it (an older client, a Kafka client) the epoch stays."""
        try:
            action = m.EndTxnAction(req.action)
        except ValueError:
            raise InvalidRequestError(f"unknown END_TXN action {req.action}") from None
        durability = Durability.FSYNCED if self.sync else Durability.WRITTEN
        commit = action == m.EndTxnAction.COMMIT
        try:
            meta = self.book.meta(req.transactional_id, req.producer_id, req.producer_epoch)
        except ProducerFencedError:
            done = self._ended_before(req, commit)
            if done is None:
                raise
            await self.statelog.save_durable(done)  # the new epoch is answered once durable
            return m.EndTxnResponse(int(done.state), durability, done.pid, done.epoch)
        await self.completer.wait(meta)
        if action == m.EndTxnAction.STAGE:
            return await self._stage(meta, req, durability)
        if not self.book.check_end(meta, commit):
            try:
                await self.completer.end(meta, commit)
            except (StorageFullError, StorageFailureError):
                if meta.state in PREPARE_STATES:
                    self.book.unanswered[meta.tid] = commit
                raise
            self.book.unanswered.pop(meta.tid, None)
        state = TxnState.COMPLETE_COMMIT if commit else TxnState.COMPLETE_ABORT
        if req.new_epoch and meta.state in DONE_STATES and (meta.pid, meta.epoch) == (
                req.producer_id, req.producer_epoch):
            self._bump(meta, "end")  # a new epoch per transaction: fences this one's zombies
            # (if this save fails the producer retries: _ended_before answers the new epoch
            # once a save of it is durable)
            await self.statelog.save_durable(meta)
        return m.EndTxnResponse(int(state), durability, meta.pid, meta.epoch)

    def _ended_before(self, req: m.EndTxnRequest, commit: bool) -> TxnMeta | None:
        """The tid's state if ``req`` retries an END_TXN that ended its transaction with the
        same outcome and moved it to the epoch after (its answer was lost); else None."""
        meta = self.book.txns.get(req.transactional_id)
        want = TxnState.COMPLETE_COMMIT if commit else TxnState.COMPLETE_ABORT
        if (req.new_epoch and meta is not None and meta.bumped_by == "end"
                and meta.pid == req.producer_id
                and meta.epoch == req.producer_epoch + 1 and meta.state == want
                and req.action != m.EndTxnAction.STAGE):
            return meta
        return None

    async def _stage(self, meta: TxnMeta, req: m.EndTxnRequest,
                     durability: Durability) -> m.EndTxnResponse:
        if not req.sink_id or len(req.sink_id) > m.MAX_NAME_CHARS or req.batch_id < 0:
            raise InvalidTxnStateError("staging needs a sink id and a batch id >= 0")
        if meta.state == TxnState.STAGED and meta.sink == (req.sink_id, req.batch_id):
            return m.EndTxnResponse(int(TxnState.STAGED), durability)  # a retry
        if not (can(meta.state, TxnEvent.STAGE) or can(meta.state, TxnEvent.BEGIN)):
            raise InvalidTxnStateError(f"transaction of {meta.tid!r} is {meta.state.name}")
        last = self.book.last_batch(req.sink_id)
        if last is not None and req.batch_id <= last:
            # a late task of a batch already committed (a dead driver's): abort now, or its
            # rows would hold back read_committed readers until the staged TTL
            if meta.state == TxnState.ONGOING:
                await self.completer.end(meta, False)
            raise BatchAlreadyCommittedError(
                f"sink {req.sink_id!r} already committed batch {last}; batch "
                f"{req.batch_id} is a replay: its transaction was aborted")
        if req.staged_ttl_ms < 0:
            raise InvalidRequestError("staged_ttl_ms must be >= 0 (0: the broker's default)")
        self._begin_if_needed(meta)
        self.book.stage(meta, (req.sink_id, req.batch_id),
                        req.staged_ttl_ms or self.config.txn_staged_ttl_ms, self.clock.wall_ms())
        await self.statelog.save_durable(meta)
        return m.EndTxnResponse(int(TxnState.STAGED), durability)

    # -- staged commits ----------------------------------------------------------------------

    async def commit_staged(self, req: m.CommitStagedRequest) -> m.CommitStagedResponse:
        """Commit a sink batch's staged transactions at once, fenced by (sink, batch)."""
        last = self.book.last_batch(req.sink_id)
        if last is not None and req.batch_id <= last:
            n = await self._abort_sink_batch(req.sink_id, req.batch_id, req.members)
            raise BatchAlreadyCommittedError(
                f"sink {req.sink_id!r} already committed batch {last}; batch "
                f"{req.batch_id} dropped ({n} staged transactions aborted)")
        sink = (req.sink_id, req.batch_id)
        metas: list[TxnMeta] = []
        for tid, pid, epoch in req.members:
            meta = self.book.txns.get(tid)
            if meta is None or not self.book.staged(meta, pid, epoch, sink):
                raise StagedTxnExpiredError(
                    f"staged transaction {tid!r} (producer {pid} epoch {epoch}) of sink "
                    f"{req.sink_id!r} batch {req.batch_id} is not staged any more (expired, "
                    "aborted or unknown): nothing committed")
            metas.append(meta)
        now = self.clock.wall_ms()
        members = [(t, p, e) for t, p, e in req.members]
        end = self.statelog.write(sink_record(req.sink_id, req.batch_id, now, members),
                                  req.sink_id)
        self.book.commit_sink(req.sink_id, req.batch_id, now, members)  # the decision
        await self.statelog.durable(self.state_queue, end)
        crash_point("txn.sink_record_durable")
        await asyncio.gather(*(self.completer.end(meta, True) for meta in metas))
        await self._abort_sink_batch(req.sink_id, req.batch_id, [])  # leftover attempts
        return m.CommitStagedResponse(int(TxnState.COMPLETE_COMMIT), req.batch_id)

    async def abort_staged(self, req: m.AbortStagedRequest) -> m.AbortStagedResponse:
        """Abort staged transactions of one sink batch (all when no members are named)."""
        return m.AbortStagedResponse(
            await self._abort_sink_batch(req.sink_id, req.batch_id, req.members))

    async def _abort_sink_batch(self, sink_id: str, batch_id: int,
                                members: list[m.StagedMember]) -> int:
        victims = self.book.staged_of(sink_id, batch_id, {(t, p, e) for t, p, e in members})
        for meta in victims:
            self._bump(meta, "init")
        await asyncio.gather(*(self.completer.end(meta, False) for meta in victims))
        return len(victims)

    # -- DESCRIBE_TXNS -----------------------------------------------------------------------

    def describe(self, req: m.DescribeTxnsRequest) -> m.DescribeTxnsResponse:
        """Transactional ids and sink fences, optionally one of each."""
        txns: list[m.TxnDescription] = []
        for meta in sorted(self.book.txns.values(), key=lambda t: t.tid):
            if req.transactional_id and meta.tid != req.transactional_id:
                continue
            if req.sink_id and (meta.sink is None or meta.sink[0] != req.sink_id):
                continue
            sink, batch = meta.sink if meta.sink else ("", -1)
            txns.append((meta.tid, meta.pid, meta.epoch, int(meta.state), meta.started_ms,
                         meta.timeout_ms, list(meta.queues), sorted(meta.offsets), sink, batch))
        sinks = [(s, b, a) for s, (b, a) in sorted(self.book.sinks.items())
                 if not req.sink_id or s == req.sink_id]
        return m.DescribeTxnsResponse(txns, sinks)

