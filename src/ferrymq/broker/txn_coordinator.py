"""The transaction coordinator: exactly-once read-process-write (Kafka's KIP-98, one broker).

Theory of operation
-------------------
A *transactional id* (tid) names one logical producer across restarts. INIT_TXN gives it a
producer id and a new epoch, which fences every older instance. Its transactional batches
(``ATTR_TRANSACTIONAL``) are ordinary idempotent batches; the first one sent to a queue
registers that queue with the coordinator. END_TXN commit (or abort) then:

1. appends a PrepareCommit record to the internal topic ``%TXN%state`` and waits until it is
   durable: that record *is* the decision;
2. appends a COMMIT (ABORT) control batch (:mod:`ferrymq.protocol.markers`) to every touched
   queue, in one event-loop callback, and waits until they are durable;
3. on commit, applies the offsets sent with TXN_OFFSET_COMMIT to their groups;
4. in one callback, removes the producer from every touched queue's ``open_txns``, which moves
   each queue's *last stable offset* (LSO), so read_committed readers see the whole
   transaction on every queue at once; then appends CompleteCommit (no wait) and answers.

Readers with ``read_committed`` isolation read up to the LSO and skip aborted batches with the
aborted-transaction list the fetch answer carries (:class:`ReadCommittedFilter`).

*Staged* transactions (the Spark sink): END_TXN stage moves Ongoing to Staged (durable, still
invisible); COMMIT_STAGED commits a set of them with one SinkCommit record fenced by
(sink id, batch id): a batch id at or below the sink's last is refused and its staged rows
aborted. Staged transactions that are never committed expire after their TTL.

A full disk (ENOSPC/EDQUOT on a write or an fsync of the state log, a marker or the group
offsets) never leaves a transaction half done. Before step 1 has written the decision nothing
changed. From the END_TXN that takes it on, the decision stands (in memory, then in the
state log): the request is answered STORAGE_FULL (retriable, with the watermarks'
retry-after), every queue keeps its LSO below the transaction, and :meth:`TxnCoordinator.tick`
drives it on from where it stopped once the flusher says space is back -- the decision record
if it was never written, then markers only where the producer's transaction is still open
(the path start-up recovery takes), offsets, CompleteX. A retry of the same END_TXN finishes it
too (or is answered STORAGE_FULL again); the opposite action is refused with
INVALID_TXN_STATE, also after the broker finished it alone, so a client whose commit failed
for lack of space never hears "aborted" for a transaction that was committed.

State: ``%TXN%state`` holds one record per transition, each the *full* state of its tid, so
replay needs only the newest record per tid. A snapshot (``meta/txn_coordinator``, about once a
second when something changed) covers a prefix of the topic; start-up loads it and replays the
rest, then finishes every PrepareX (writes missing markers, re-applies offsets), aborts orphan
open transactions found in the queues' producer state, and seeds every queue's ``open_txns``.

Everything runs on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from ferrymq._faults import crash_point
from ferrymq._time import Clock
from ferrymq.broker.flusher import flush_postponed
from ferrymq.broker.groups import check_group_name, check_offsets
from ferrymq.errors import (
    BatchAlreadyCommittedError,
    BrokerError,
    BusyError,
    ConcurrentTransactionsError,
    CorruptRecordError,
    IllegalGenerationError,
    InvalidRequestError,
    InvalidTxnStateError,
    InvalidTxnTimeoutError,
    ProducerFencedError,
    StagedTxnExpiredError,
    StorageFailureError,
    StorageFullError,
    TransactionTimedOutError,
    UnknownMemberError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.markers import encode_marker
from ferrymq.protocol.messages import Durability, TxnState
from ferrymq.protocol.records import RecordInput, decode_records, encode_batch
from ferrymq.storage.checkpoint import read_checkpoint, write_checkpoint

if TYPE_CHECKING:
    from ferrymq.broker.config import BrokerConfig
    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.groups import GroupCoordinator
    from ferrymq.broker.producer_ids import ProducerIdManager
    from ferrymq.broker.topics import QueueState, TopicRegistry
    from ferrymq.protocol.records import BatchHeader

log = logging.getLogger("ferrymq.broker")

TXN_TOPIC = "%TXN%state"
"""The coordinator's log: one queue, internal, never fetched by clients."""
MAX_EPOCH = 32767
"""Epochs are i16: at this epoch a transactional id gets a new producer id."""
SNAPSHOT_INTERVAL_S = 1.0
READ_BYTES = 1 << 20
OPEN_STATES = (TxnState.ONGOING, TxnState.STAGED)
DONE_STATES = (TxnState.EMPTY, TxnState.COMPLETE_COMMIT, TxnState.COMPLETE_ABORT)
PREPARE_STATES = (TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT)
QueueKey = tuple[str, int]


@dataclass(eq=False, slots=True)
class TxnMeta:
    """A transactional id's state (what the newest ``%TXN%state`` record says)."""

    tid: str
    pid: int
    epoch: int
    state: TxnState
    timeout_ms: int
    started_ms: int = 0
    updated_ms: int = 0
    queues: dict[QueueKey, None] = field(default_factory=dict)  # ordered set
    offsets: dict[str, dict[QueueKey, int]] = field(default_factory=dict)
    sink: tuple[str, int] | None = None
    ttl_ms: int = 0
    staged_ms: int = 0
    bumped_by: str = ""  # why the epoch last moved: "init", "timeout", "" (new)
    completing: asyncio.Future[None] | None = None  # a commit/abort in progress (not stored)

    def record(self) -> dict[str, Any]:
        """The ``%TXN%state`` record (and snapshot entry) of this state."""
        return {
            "t": "TXN", "tid": self.tid, "pid": self.pid, "epoch": self.epoch,
            "state": int(self.state), "timeout_ms": self.timeout_ms,
            "started_ms": self.started_ms, "updated_ms": self.updated_ms,
            "queues": [list(q) for q in self.queues],
            "offsets": {g: [[t, q, o] for (t, q), o in offs.items()]
                        for g, offs in self.offsets.items()},
            "sink": list(self.sink) if self.sink else None, "ttl_ms": self.ttl_ms,
            "staged_ms": self.staged_ms, "bumped_by": self.bumped_by,
        }

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> TxnMeta:
        """Inverse of :meth:`record`.

        Raises:
            KeyError, ValueError, TypeError: not a TXN record.
        """
        sink = d.get("sink")
        return cls(
            str(d["tid"]), int(d["pid"]), int(d["epoch"]), TxnState(int(d["state"])),
            int(d["timeout_ms"]), int(d["started_ms"]), int(d["updated_ms"]),
            {(str(t), int(q)): None for t, q in d["queues"]},
            {str(g): {(str(t), int(q)): int(o) for t, q, o in offs}
             for g, offs in d["offsets"].items()},
            (str(sink[0]), int(sink[1])) if sink else None, int(d["ttl_ms"]),
            int(d["staged_ms"]), str(d["bumped_by"]),
        )


class TxnCoordinator:
    """Transactional ids, their transactions, sink fences. See the module docstring."""

    def __init__(
        self, config: BrokerConfig, topics: TopicRegistry, flusher: Flusher,
        groups: GroupCoordinator, producer_ids: ProducerIdManager, clock: Clock, data_dir: Path,
    ) -> None:
        self.config = config
        self.topics = topics
        self.flusher = flusher
        self.groups = groups
        self.producer_ids = producer_ids
        self.clock = clock
        self.sync = config.flush == "sync"
        self.snapshot_path = data_dir / "meta" / "txn_coordinator"
        self.txns: dict[str, TxnMeta] = {}
        self.by_pid: dict[int, TxnMeta] = {}
        self.sinks: dict[str, tuple[int, int]] = {}  # sink id -> (last batch id, at ms)
        self.pending_offsets: dict[tuple[str, str, int], str] = {}  # (group, t, q) -> tid
        self._snap_offset = 0
        self._dirty = False
        self._last_snapshot = 0.0
        self._tasks: set[asyncio.Task[None]] = set()
        self._unwritten: set[str] = set()
        """Tids decided (PrepareX in memory) whose decision record is not in the log yet."""
        self._stalls: dict[str, BrokerError] = {}
        """Tids decided whose completion stopped on a storage error (the last one)."""
        self._unanswered: dict[str, bool] = {}
        """Tid -> commit?: an END_TXN answered STORAGE_FULL, not yet answered otherwise."""
        self.commits = 0
        self.aborts = 0

    # -- the state log -----------------------------------------------------------------------

    @property
    def state_queue(self) -> QueueState:
        """``%TXN%state``'s one queue (created on first use)."""
        topic = self.topics.topics.get(TXN_TOPIC)
        if topic is None:
            topic = self.topics.create(TXN_TOPIC, 1, {}, self.clock.wall_ms(), internal_ok=True)
        return topic.queues[0]

    def _write(self, rec: dict[str, Any], key: str) -> int:
        """Append one record to the state log; the end offset to wait for."""
        qs = self.state_queue
        now = self.clock.wall_ms()
        body = bytes(msgpack.packb(rec, use_bin_type=True))
        batch = encode_batch([RecordInput(body, now, rec["t"].encode(), b"", key.encode())])
        end = self._append(qs, batch, now, "the transaction log")
        self._dirty = True
        return end

    def _append(self, qs: QueueState, batch: bytes | bytearray, now: int, what: str) -> int:
        """Append a batch the coordinator built; the end offset to wait for.

        Raises:
            StorageFullError: the disk is full (nothing written).
            StorageFailureError: the queue had an fsync failure (restart needed), or the write
                failed otherwise.
        """
        self._check_space(qs)
        try:
            res = qs.log.append(batch, now_ms=now)
        except OSError as exc:
            raise self.flusher.write_error(exc, f"{what} to {qs}") from None
        self.flusher.mark_dirty(qs)
        if not self.sync:
            qs.advance(qs.log.end_offset)
        return res.last_offset + 1

    def _check_space(self, qs: QueueState) -> None:
        """Refuse to go on with ``qs`` while its fsync failed (ENOSPC, EMFILE: until its tail
        is written again; anything else: until a restart)."""
        self.flusher.check_writable(qs)

    def _save(self, meta: TxnMeta) -> int:
        meta.updated_ms = self.clock.wall_ms()
        return self._write(meta.record(), meta.tid)

    async def _durable(self, qs: QueueState, end: int) -> None:
        """Wait until ``qs`` is durable up to ``end`` (sync flush mode; async: written)."""
        if not self.sync:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def done(exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is None:
                fut.set_result(None)
            elif isinstance(exc, StorageFullError):
                fut.set_exception(StorageFullError(
                    f"{qs} not fsynced for lack of space: {exc.message}",
                    retry_after_ms=self.config.busy_retry_after_ms))
            elif flush_postponed(exc):
                fut.set_exception(exc)
            else:
                fut.set_exception(StorageFailureError(f"{qs} not fsynced: {exc}"))

        qs.when_durable(end, done)
        await fut

    async def _save_durable(self, meta: TxnMeta) -> None:
        await self._durable(self.state_queue, self._save(meta))

    # -- start-up ----------------------------------------------------------------------------

    def load(self) -> None:
        """Rebuild the state from the snapshot and the state log, finish interrupted
        commits/aborts, abort orphans and seed every queue's open transactions. Runs before
        the broker listens; writes synchronously and flushes what it wrote."""
        start = 0
        raw: bytes | None = None
        try:
            raw = read_checkpoint(self.snapshot_path)
        except (CorruptRecordError, OSError) as exc:
            log.warning("transactions: snapshot unreadable (%s); replaying the whole log", exc)
        if raw is not None:
            try:
                snap = msgpack.unpackb(raw, raw=False, strict_map_key=False)
                for d in snap["txns"]:
                    self._put(TxnMeta.from_record(d))
                self.sinks = {str(s): (int(b), int(a)) for s, b, a in snap["sinks"]}
                start = int(snap["offset"])
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("transactions: snapshot unusable (%s); replaying the whole log", exc)
                self.txns.clear()
                self.by_pid.clear()
                self.sinks.clear()
                start = 0
        if TXN_TOPIC in self.topics.topics:
            self._replay(max(start, self.state_queue.log.start_offset))
        self._snap_offset = start
        self._recover()

    def _put(self, meta: TxnMeta) -> None:
        old = self.txns.get(meta.tid)
        if old is not None and self.by_pid.get(old.pid) is old:
            del self.by_pid[old.pid]
        self.txns[meta.tid] = meta
        self.by_pid[meta.pid] = meta

    def _replay(self, start: int) -> None:
        qs = self.state_queue
        pos = start
        n = 0
        while pos < qs.log.end_offset:
            data = qs.log.read(pos, READ_BYTES)
            if not data:
                break
            try:
                recs = decode_records(data)
            except CorruptRecordError as exc:
                log.warning("transactions: unreadable state record at %d: %s", pos, exc)
                break
            nxt = pos
            for rec in recs:
                nxt = rec.offset + 1
                if rec.offset < pos:
                    continue
                try:
                    self._apply_record(msgpack.unpackb(rec.body, raw=False,
                                                       strict_map_key=False))
                    n += 1
                except (KeyError, ValueError, TypeError) as exc:
                    log.warning("transactions: bad state record at %d: %s", rec.offset, exc)
            if nxt <= pos:
                break
            pos = nxt
        log.info("transactions: replayed %d state records from offset %d: %d transactional ids",
                 n, start, len(self.txns))

    def _apply_record(self, d: dict[str, Any]) -> None:
        if d["t"] == "TXN":
            self._put(TxnMeta.from_record(d))
        elif d["t"] == "SINK":
            self.sinks[str(d["sink_id"])] = (int(d["batch_id"]), int(d["at_ms"]))
            for tid, pid, epoch in d["members"]:
                meta = self.txns.get(tid)
                if (meta is not None and meta.pid == pid and meta.epoch == epoch
                        and meta.state == TxnState.STAGED):
                    meta.state = TxnState.PREPARE_COMMIT  # the SinkCommit is their decision

    def _recover(self) -> None:
        now = self.clock.wall_ms()
        touched: set[QueueState] = set()
        for meta in list(self.txns.values()):
            if meta.state in (TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT):
                commit = meta.state == TxnState.PREPARE_COMMIT
                log.info("transactions: finishing the %s of %s (producer %d epoch %d)",
                         "commit" if commit else "abort", meta.tid, meta.pid, meta.epoch)
                touched |= self._write_markers(meta, commit, now, only_open=True)
                if commit:
                    self._apply_offsets(meta)
                self._complete(meta, commit)
        # orphans: a queue's open transaction that no open tid owns at that queue
        for qs in self.topics.all_queues():
            for pid in list(qs.log.ongoing_txns()):
                owner = self.by_pid.get(pid)
                if (owner is not None and owner.state in OPEN_STATES
                        and (qs.topic, qs.queue) in owner.queues):
                    continue
                epoch = owner.epoch if owner is not None else _producer_epoch(qs, pid)
                log.warning("transactions: %s holds an open transaction of producer %d that no "
                            "transactional id owns; aborting it", qs, pid)
                self._append_marker(qs, pid, epoch, False, owner.tid if owner else "", -1, now)
                touched.add(qs)
        for qs in touched:
            qs.log.flush()
            qs.on_flushed(qs.log.end_offset, self.sync)
        if self._dirty:
            sq = self.state_queue
            sq.log.flush()
            sq.on_flushed(sq.log.end_offset, self.sync)
        for qs in self.topics.all_queues():
            for pid, first in qs.log.ongoing_txns().items():
                qs.open_txns[pid] = first

    def _write_markers(self, meta: TxnMeta, commit: bool, now: int, *,
                       only_open: bool = True) -> set[QueueState]:
        """Append a marker to every queue the transaction touched where it is still open
        (``only_open``: a queue registered whose batch failed needs none, and one that got its
        marker before a full disk stopped the others must not get a second), all in this
        callback.

        Raises:
            StorageFullError, StorageFailureError: a marker could not be written (the ones
                before it were: a retry writes the rest).
        """
        out: set[QueueState] = set()
        coord = self.state_queue.log.end_offset - 1
        for topic, queue in meta.queues:
            try:
                qs = self.topics.queue(topic, queue)
            except BrokerError:
                continue  # the topic was deleted
            if only_open and meta.pid not in qs.log.ongoing_txns():
                continue
            self._append_marker(qs, meta.pid, meta.epoch, commit, meta.tid, coord, now)
            out.add(qs)
        return out

    def _append_marker(self, qs: QueueState, pid: int, epoch: int, commit: bool, tid: str,
                       coord: int, now: int) -> int:
        batch = encode_marker(producer_id=pid, producer_epoch=epoch, commit=commit,
                              transactional_id=tid, coordinator_offset=coord, timestamp_ms=now)
        return self._append(qs, batch, now, "a transaction marker")

    def _apply_offsets(self, meta: TxnMeta) -> None:
        """Step 3 (idempotent: a retry or recovery applies them again).

        Raises:
            StorageFullError, StorageFailureError: a group's offsets could not be written.
        """
        for group, offs in meta.offsets.items():
            try:
                self.groups.apply_txn_offsets(group, offs)
            except OSError as exc:
                raise self.flusher.write_error(exc, f"the offsets of group {group!r}") from None
            for t, q in offs:
                if self.pending_offsets.get((group, t, q)) == meta.tid:
                    del self.pending_offsets[(group, t, q)]

    def _complete(self, meta: TxnMeta, commit: bool) -> None:
        """Step 4: release the queues' LSOs (one callback) and record CompleteX."""
        for topic, queue in meta.queues:
            try:
                qs = self.topics.queue(topic, queue)
            except BrokerError:
                continue
            qs.release_txn(meta.pid)
        if not commit:
            for group, offs in meta.offsets.items():
                for t, q in offs:
                    if self.pending_offsets.get((group, t, q)) == meta.tid:
                        del self.pending_offsets[(group, t, q)]
        meta.state = TxnState.COMPLETE_COMMIT if commit else TxnState.COMPLETE_ABORT
        meta.queues = {}
        meta.offsets = {}
        meta.sink = None
        meta.started_ms = 0
        meta.staged_ms = 0
        try:
            self._save(meta)
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

    # -- checks ------------------------------------------------------------------------------

    def _meta(self, tid: str, pid: int, epoch: int) -> TxnMeta:
        """The tid's state, checked against the caller's producer id and epoch.

        Raises:
            InvalidTxnStateError: unknown tid (INIT_TXN first).
            TransactionTimedOutError: the caller's epoch was ended by a timeout.
            ProducerFencedError: another instance took the tid.
        """
        meta = self.txns.get(tid)
        if meta is None:
            raise InvalidTxnStateError(f"unknown transactional id {tid!r}: call INIT_TXN first")
        self._check_epoch(meta, pid, epoch)
        return meta

    @staticmethod
    def _check_epoch(meta: TxnMeta, pid: int, epoch: int) -> None:
        if pid == meta.pid and epoch == meta.epoch:
            return
        if pid == meta.pid and epoch == meta.epoch - 1 and meta.bumped_by == "timeout":
            raise TransactionTimedOutError(
                f"transaction of {meta.tid!r} was aborted after its timeout "
                f"({meta.timeout_ms} ms); abort() and begin again")
        raise ProducerFencedError(
            f"transactional id {meta.tid!r} is now producer {meta.pid} epoch {meta.epoch} "
            f"(this one: {pid} epoch {epoch}): fenced by a newer instance")

    def _open_count(self) -> int:
        return sum(1 for t in self.txns.values() if t.state in OPEN_STATES)

    def _begin_if_needed(self, meta: TxnMeta) -> None:
        if meta.state == TxnState.ONGOING:
            return
        if meta.completing is not None:
            raise ConcurrentTransactionsError(
                f"the previous transaction of {meta.tid!r} is still completing")
        if meta.state not in DONE_STATES:
            raise InvalidTxnStateError(
                f"transaction of {meta.tid!r} is {meta.state.name}: no more sends")
        if self._open_count() >= self.config.txn_max_open:
            raise BusyError(f"{self.config.txn_max_open} transactions open (txn_max_open); "
                            "retry when some end")
        meta.state = TxnState.ONGOING
        meta.started_ms = self.clock.wall_ms()
        self._unanswered.pop(meta.tid, None)

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
        meta = self.txns.get(tid)
        if meta is None:
            meta = TxnMeta(tid, self.producer_ids.allocate(), 0, TxnState.EMPTY, timeout)
            self._put(meta)
            await self._save_durable(meta)
            return m.InitTxnResponse(meta.pid, meta.epoch, timeout)
        if meta.completing is not None:
            await asyncio.shield(meta.completing)
        if meta.state in PREPARE_STATES:  # decided, stalled on a full disk: finish it first
            await self._end(meta, meta.state == TxnState.PREPARE_COMMIT)
        self._unanswered.pop(tid, None)
        if req.expected_producer_id >= 0:
            try:
                self._check_epoch(meta, req.expected_producer_id, req.expected_epoch)
            except TransactionTimedOutError:
                pass  # resume after a timeout (KIP-360): bump once more below
        if meta.state in OPEN_STATES:
            self._bump(meta, "init")
            await self._end(meta, commit=False)
        self._bump(meta, "init")
        meta.state = TxnState.EMPTY
        meta.timeout_ms = timeout
        await self._save_durable(meta)
        return m.InitTxnResponse(meta.pid, meta.epoch, timeout)

    def _bump(self, meta: TxnMeta, why: str) -> None:
        if meta.epoch >= MAX_EPOCH:
            del self.by_pid[meta.pid]
            meta.pid = self.producer_ids.allocate()
            meta.epoch = 0
            self.by_pid[meta.pid] = meta
        else:
            meta.epoch += 1
        meta.bumped_by = why

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
        meta = self.by_pid.get(h.producer_id)
        if meta is None:
            raise InvalidTxnStateError(
                f"producer {h.producer_id} has no transactional id: INIT_TXN first")
        self._check_epoch(meta, h.producer_id, h.producer_epoch)
        self._begin_if_needed(meta)
        key = (qs.topic, qs.queue)
        if key in meta.queues:
            return -1
        meta.queues[key] = None
        try:
            return self._save(meta)
        except BrokerError:  # not registered: the batch is not appended either
            del meta.queues[key]
            raise

    @staticmethod
    def on_append(qs: QueueState, pid: int, base_offset: int) -> None:
        """A transactional batch was appended: the queue's LSO stops at its transaction."""
        if pid not in qs.open_txns:
            qs.open_txns[pid] = base_offset

    # -- TXN_OFFSET_COMMIT -------------------------------------------------------------------

    async def add_offsets(self, req: m.TxnOffsetCommitRequest) -> m.CommitOffsetsResponse:
        """Record consumer offsets in the open transaction (applied at commit)."""
        meta = self._meta(req.transactional_id, req.producer_id, req.producer_epoch)
        check_group_name(req.group)
        g = self.groups.groups.get(req.group)
        if g is None:
            self.groups.check_new(req.group)
        if req.generation >= 0:
            if g is None or req.member_id not in g.members:
                raise UnknownMemberError(f"group {req.group!r} has no member {req.member_id!r}")
            if req.generation != g.generation:
                raise IllegalGenerationError(
                    f"offsets for generation {req.generation}, group {req.group!r} is at "
                    f"{g.generation}")
        valid, out = check_offsets(
            self.topics, req.entries,
            lambda t, q: self.check_pending(req.group, t, q, meta.tid))
        if valid:
            self._begin_if_needed(meta)
            offs = meta.offsets.setdefault(req.group, {})
            for topic, queue, offset in valid:
                offs[(topic, queue)] = offset
                self.pending_offsets[(req.group, topic, queue)] = meta.tid
            await self._save_durable(meta)
        return m.CommitOffsetsResponse(out)

    def unstable(self, group: str) -> list[tuple[str, int]]:
        """Queues of ``group`` with offsets pending in an open transaction."""
        return sorted((t, q) for (g, t, q) in self.pending_offsets if g == group)

    def check_pending(self, group: str, topic: str, queue: int, tid: str = "") -> None:
        """Offsets of ``group`` on a queue may not be committed while a transaction other than
        ``tid``'s ("": any) holds offsets for it.

        Raises:
            ConcurrentTransactionsError.
        """
        owner = self.pending_offsets.get((group, topic, queue)) if self.pending_offsets else None
        if owner is not None and owner != tid:
            raise ConcurrentTransactionsError(
                f"{group} {topic}/{queue} has offsets pending in the transaction of {owner!r}")

    # -- END_TXN -----------------------------------------------------------------------------

    async def end(self, req: m.EndTxnRequest) -> m.EndTxnResponse:
        """Commit, abort or stage the open transaction."""
        meta = self._meta(req.transactional_id, req.producer_id, req.producer_epoch)
        durability = Durability.FSYNCED if self.sync else Durability.WRITTEN
        if meta.completing is not None:
            await asyncio.shield(meta.completing)
        try:
            action = m.EndTxnAction(req.action)
        except ValueError:
            raise InvalidRequestError(f"unknown END_TXN action {req.action}") from None
        if action == m.EndTxnAction.STAGE:
            return await self._stage(meta, req, durability)
        commit = action == m.EndTxnAction.COMMIT
        asked = self._unanswered.get(meta.tid)
        if asked is not None and asked != commit and meta.state not in OPEN_STATES:
            raise InvalidTxnStateError(
                f"the {'commit' if asked else 'abort'} of the transaction of {meta.tid!r} was "
                "answered STORAGE_FULL, but it was decided then: it "
                f"{'is' if meta.state in DONE_STATES else 'will be'} "
                f"{'committed' if asked else 'aborted'} (once disk space is back); retry "
                f"{'commit' if asked else 'abort'}, it cannot be "
                f"{'aborted' if asked else 'committed'} any more")
        if meta.state in DONE_STATES:
            self._unanswered.pop(meta.tid, None)
            # nothing open at this epoch: the transaction sent nothing (begin() is local), or
            # this is a retry whose first answer was lost; either way the outcome asked for
            # holds (a transaction the broker aborted on its own moved the epoch on, so its
            # producer gets TRANSACTION_TIMED_OUT or PRODUCER_FENCED above, never this)
            return m.EndTxnResponse(int(TxnState.COMPLETE_COMMIT if commit
                                        else TxnState.COMPLETE_ABORT), durability)
        if meta.state == TxnState.STAGED and commit:
            raise InvalidTxnStateError(f"transaction of {meta.tid!r} is staged: commit it with "
                                       "COMMIT_STAGED")
        try:
            await self._end(meta, commit)
        except (StorageFullError, StorageFailureError):
            if meta.state in PREPARE_STATES:
                self._unanswered[meta.tid] = commit
            raise
        self._unanswered.pop(meta.tid, None)
        return m.EndTxnResponse(int(meta.state), durability)

    async def _end(self, meta: TxnMeta, commit: bool, *, decided: bool = False) -> None:
        """Commit or abort ``meta``'s open transaction (steps 1-4 of the module docstring), or
        finish one decided before whose completion stopped on a storage error. ``decided``:
        the decision record is already written (a SinkCommit).

        Raises:
            StorageFullError: the disk is full; the decision stands and :meth:`tick` finishes
                it once space is back.
            StorageFailureError: an fsync failed otherwise (restart needed).
            InvalidTxnStateError: the opposite of a decision taken before was asked for.
        """
        if meta.completing is not None:
            await asyncio.shield(meta.completing)
            self._check_finished(meta)
            return
        if meta.state in PREPARE_STATES:
            if (meta.state == TxnState.PREPARE_COMMIT) != commit:
                raise InvalidTxnStateError(
                    f"the transaction of {meta.tid!r} is being "
                    f"{'committed' if not commit else 'aborted'} (decided before the disk "
                    "filled up; it completes once space is back)")
        else:
            meta.state = TxnState.PREPARE_COMMIT if commit else TxnState.PREPARE_ABORT
            if not decided:
                self._unwritten.add(meta.tid)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        meta.completing = done
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
            meta.completing = None
            if not done.done():
                done.set_result(None)

    def _check_finished(self, meta: TxnMeta) -> None:
        """After waiting for another request's completion of ``meta``: raise if it stalled."""
        if meta.state not in PREPARE_STATES:
            return
        exc = self._stalls.get(meta.tid)
        what = "commit" if meta.state == TxnState.PREPARE_COMMIT else "abort"
        if isinstance(exc, StorageFailureError):
            raise StorageFailureError(f"the {what} of {meta.tid!r} cannot complete: {exc}")
        raise StorageFullError(f"the {what} of {meta.tid!r} waits for disk space: {exc}",
                               retry_after_ms=self.config.busy_retry_after_ms)

    async def _drive(self, meta: TxnMeta, commit: bool) -> None:
        """Steps 1-4 from wherever a previous attempt stopped."""
        sq = self.state_queue
        if meta.tid in self._unwritten:
            end = self._save(meta)  # the decision; raises with nothing written
            self._unwritten.discard(meta.tid)
        else:
            self._check_space(sq)
            end = sq.log.end_offset
        await self._durable(sq, end)
        crash_point("txn.prepare_durable")
        await self._finish(meta, commit)

    async def _finish(self, meta: TxnMeta, commit: bool) -> None:
        now = self.clock.wall_ms()
        self._write_markers(meta, commit, now)
        queues = []
        for topic, queue in meta.queues:  # markers written now or by an earlier attempt
            try:
                queues.append(self.topics.queue(topic, queue))
            except BrokerError:
                continue
        for qs in queues:
            self._check_space(qs)
        for qs in queues:
            await self._durable(qs, qs.log.end_offset)
        crash_point("txn.markers_durable")
        if commit:
            self._apply_offsets(meta)
            crash_point("txn.offsets_applied")
        self._complete(meta, commit)

    async def _stage(self, meta: TxnMeta, req: m.EndTxnRequest,
                     durability: Durability) -> m.EndTxnResponse:
        if not req.sink_id or len(req.sink_id) > m.MAX_NAME_CHARS or req.batch_id < 0:
            raise InvalidTxnStateError("staging needs a sink id and a batch id >= 0")
        if meta.state == TxnState.STAGED and meta.sink == (req.sink_id, req.batch_id):
            return m.EndTxnResponse(int(TxnState.STAGED), durability)  # a retry
        if meta.state not in (TxnState.ONGOING, *DONE_STATES):
            raise InvalidTxnStateError(f"transaction of {meta.tid!r} is {meta.state.name}")
        last = self.sinks.get(req.sink_id)
        if last is not None and req.batch_id <= last[0]:
            # a late task of a batch already committed (a dead driver's): abort now, or its
            # rows would hold back read_committed readers until the staged TTL
            if meta.state == TxnState.ONGOING:
                await self._end(meta, False)
            raise BatchAlreadyCommittedError(
                f"sink {req.sink_id!r} already committed batch {last[0]}; batch "
                f"{req.batch_id} is a replay: its transaction was aborted")
        if req.staged_ttl_ms < 0:
            raise InvalidRequestError("staged_ttl_ms must be >= 0 (0: the broker's default)")
        self._begin_if_needed(meta)
        meta.state = TxnState.STAGED
        meta.sink = (req.sink_id, req.batch_id)
        meta.ttl_ms = req.staged_ttl_ms or self.config.txn_staged_ttl_ms
        meta.staged_ms = self.clock.wall_ms()
        await self._save_durable(meta)
        return m.EndTxnResponse(int(TxnState.STAGED), durability)

    # -- staged commits ----------------------------------------------------------------------

    async def commit_staged(self, req: m.CommitStagedRequest) -> m.CommitStagedResponse:
        """Commit a sink batch's staged transactions at once, fenced by (sink, batch)."""
        last = self.sinks.get(req.sink_id)
        if last is not None and req.batch_id <= last[0]:
            n = await self._abort_sink_batch(req.sink_id, req.batch_id, req.members)
            raise BatchAlreadyCommittedError(
                f"sink {req.sink_id!r} already committed batch {last[0]}; batch "
                f"{req.batch_id} dropped ({n} staged transactions aborted)")
        metas: list[TxnMeta] = []
        for tid, pid, epoch in req.members:
            meta = self.txns.get(tid)
            if (meta is None or meta.pid != pid or meta.epoch != epoch
                    or meta.state != TxnState.STAGED
                    or meta.sink != (req.sink_id, req.batch_id) or meta.completing is not None):
                raise StagedTxnExpiredError(
                    f"staged transaction {tid!r} (producer {pid} epoch {epoch}) of sink "
                    f"{req.sink_id!r} batch {req.batch_id} is not staged any more (expired, "
                    "aborted or unknown): nothing committed")
            metas.append(meta)
        now = self.clock.wall_ms()
        rec = {"t": "SINK", "sink_id": req.sink_id, "batch_id": req.batch_id, "at_ms": now,
               "members": [[t, p, e] for t, p, e in req.members]}
        end = self._write(rec, req.sink_id)
        self.sinks[req.sink_id] = (req.batch_id, now)
        for meta in metas:
            meta.state = TxnState.PREPARE_COMMIT
        await self._durable(self.state_queue, end)
        crash_point("txn.sink_record_durable")
        await asyncio.gather(*(self._end(meta, True, decided=True) for meta in metas))
        await self._abort_sink_batch(req.sink_id, req.batch_id, [])  # leftover attempts
        return m.CommitStagedResponse(int(TxnState.COMPLETE_COMMIT), req.batch_id)

    async def abort_staged(self, req: m.AbortStagedRequest) -> m.AbortStagedResponse:
        """Abort staged transactions of one sink batch (all when no members are named)."""
        return m.AbortStagedResponse(
            await self._abort_sink_batch(req.sink_id, req.batch_id, req.members))

    async def _abort_sink_batch(self, sink_id: str, batch_id: int,
                                members: list[m.StagedMember]) -> int:
        named = {(t, p, e) for t, p, e in members}
        victims = [
            meta for meta in self.txns.values()
            if meta.state == TxnState.STAGED and meta.sink == (sink_id, batch_id)
            and meta.completing is None
            and (not named or (meta.tid, meta.pid, meta.epoch) in named)
        ]
        for meta in victims:
            self._bump(meta, "init")
        await asyncio.gather(*(self._end(meta, False) for meta in victims))
        return len(victims)

    # -- housekeeping ------------------------------------------------------------------------

    def tick(self) -> None:
        """Abort transactions past their timeout and staged ones past their TTL; forget idle
        transactional ids; write the snapshot when due."""
        now = self.clock.wall_ms()
        cfg = self.config
        for meta in list(self.txns.values()):
            if meta.completing is not None:
                continue
            if meta.state in PREPARE_STATES:  # stalled on a full disk: go on when space is back
                if self.flusher.space_back:
                    task = asyncio.get_running_loop().create_task(self._resume(meta))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                continue
            expired = (
                (meta.state == TxnState.ONGOING and now - meta.started_ms > meta.timeout_ms)
                or (meta.state == TxnState.STAGED and now - meta.staged_ms > meta.ttl_ms))
            if expired:
                log.info("transactions: aborting the %s transaction of %s after %d ms",
                         meta.state.name.lower(), meta.tid,
                         now - (meta.started_ms if meta.state == TxnState.ONGOING
                                else meta.staged_ms))
                self._bump(meta, "timeout")
                asyncio.get_running_loop().create_task(self._end_logged(meta))
            elif (meta.state in DONE_STATES
                  and now - meta.updated_ms > cfg.txn_id_expiration_ms):
                del self.txns[meta.tid]
                if self.by_pid.get(meta.pid) is meta:
                    del self.by_pid[meta.pid]
                self._dirty = True
        self.snapshot()

    async def _resume(self, meta: TxnMeta) -> None:
        """Finish a decided transaction whose completion stalled (housekeeping)."""
        if meta.completing is not None or meta.state not in PREPARE_STATES:
            return
        try:
            await self._end(meta, meta.state == TxnState.PREPARE_COMMIT)
        except BrokerError as exc:
            log.debug("transactions: %s still cannot complete: %s", meta.tid, exc)
        except Exception:
            log.exception("transactions: completing %s failed", meta.tid)

    async def _end_logged(self, meta: TxnMeta) -> None:
        try:
            await self._end(meta, commit=False)
        except Exception:
            log.exception("transactions: timeout abort of %s failed", meta.tid)

    def snapshot(self, *, force: bool = False) -> None:
        """Write the snapshot if anything changed (at most about once a second)."""
        if not self._dirty or TXN_TOPIC not in self.topics.topics:
            return
        now = self.clock.monotonic()
        if not force and now - self._last_snapshot < SNAPSHOT_INTERVAL_S:
            return
        if any(t.completing is not None for t in self.txns.values()):
            return  # a PrepareX in flight must be replayed from the log
        self._last_snapshot = now
        offset = self.state_queue.log.end_offset
        data = {"offset": offset, "txns": [t.record() for t in self.txns.values()],
                "sinks": [[s, b, a] for s, (b, a) in self.sinks.items()]}
        try:
            write_checkpoint(self.snapshot_path, msgpack.packb(data, use_bin_type=True))
        except OSError as exc:
            log.error("transactions: cannot write the snapshot: %s", exc)
            return
        self._snap_offset = offset
        self._dirty = False

    def retention_floors(self) -> dict[tuple[int, int], int]:
        """The state log must be kept from the snapshot's offset."""
        if TXN_TOPIC not in self.topics.topics:
            return {}
        qs = self.state_queue
        return {(qs.topic_id, qs.queue): self._snap_offset}

    def close(self) -> None:
        """Write the final snapshot (after the logs' last flush)."""
        self.snapshot(force=True)

    # -- DESCRIBE_TXNS -----------------------------------------------------------------------

    def describe(self, req: m.DescribeTxnsRequest) -> m.DescribeTxnsResponse:
        """Transactional ids and sink fences, optionally one of each."""
        txns: list[m.TxnDescription] = []
        for meta in sorted(self.txns.values(), key=lambda t: t.tid):
            if req.transactional_id and meta.tid != req.transactional_id:
                continue
            if req.sink_id and (meta.sink is None or meta.sink[0] != req.sink_id):
                continue
            sink, batch = meta.sink if meta.sink else ("", -1)
            txns.append((meta.tid, meta.pid, meta.epoch, int(meta.state), meta.started_ms,
                         meta.timeout_ms, list(meta.queues), sorted(meta.offsets), sink, batch))
        sinks = [(s, b, a) for s, (b, a) in sorted(self.sinks.items())
                 if not req.sink_id or s == req.sink_id]
        return m.DescribeTxnsResponse(txns, sinks)


def _producer_epoch(qs: QueueState, pid: int) -> int:
    """The epoch a queue's producer state holds for ``pid`` (0 if it has none)."""
    entry = qs.log.producer_state.producers.get(pid)
    return entry.epoch if entry is not None else 0
