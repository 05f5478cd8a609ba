"""Transactional (half) messages with check-back, RocketMQ style.

Theory of operation
-------------------
PREPARE_TRANSACTION appends the message, with its target topic and queue, producer group and
the group's check settings in reserved properties (:mod:`ferrymq.protocol.transactions`), to the
internal topic ``%HALF%transactions`` (one queue). Nobody consumes that topic, so the message is
stored and durable (sync flush mode: the answer waits for the fsync) but invisible. Its id in
that topic is the *transaction id*.

END_TRANSACTION resolves it. COMMIT appends a normal copy to the target queue (a scheduled batch
when the message asked for a delay, indexed by the scheduler like any scheduled send), and only
once that copy is durable (sync mode: fsynced; async mode: written) appends a COMMIT *op* record
to the half topic. ROLLBACK appends a ROLLBACK op. UNKNOWN changes nothing: the broker asks later.

Check-back: the protocol has no server push, so a transactional producer keeps a TXN_CHECK_POLL
long poll open. A pending half message is checked ``check_after`` after it was stored, then
every ``check_interval``; each check goes to one live poller of its group (round robin), which
runs its checker and answers with END_TRANSACTION (``from_check``). A check that finds no live
poller counts too (RocketMQ counts attempts, not answers). When ``max_checks`` checks passed
without a definite answer the broker rolls the message back and records why.

Memory: pending half messages are kept in a dict and a heap of check times, at most
``txn_max_pending`` of them (a new half message beyond that is refused with BUSY); outcomes of
recently resolved ones in a bounded LRU (older outcomes are found by reading the half topic).

Crash safety (kill -9): the half message is in the log before PREPARE is answered. On start the
manager reads the half topic from a checkpointed *floor* (below it every half message is
resolved; rewritten about once a second): half records without an op are pending again (their
check count starts over), the others are resolved. A crash after the committed copy was written
but before its op can commit twice (the check-back asks again; at-least-once, like a producer
retry), never lose a committed message or expose a rolled-back one: the copy is the only way a
half message becomes visible and it is written only on COMMIT.

A full disk (ENOSPC/EDQUOT) never needs a restart: a half message or a committed copy that
cannot be written is refused with STORAGE_FULL (nothing stored; the producer retries). A
committed copy written whose fsync failed for lack of space stays the commit: the request is
answered STORAGE_FULL, a ROLLBACK is refused from then on, and once the flusher wrote the
queue's tail again the copy is durable and the COMMIT op is written (a retried COMMIT is
answered with it; no second copy). An op record that cannot be written is kept and written
once space is back; the floor checkpoint stays below its half message until then.

Everything runs on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ferrymq._time import Clock
from ferrymq.broker.delivery.letters import StoredRecord, stored_record
from ferrymq.broker.flusher import flush_postponed
from ferrymq.errors import (
    BrokerError,
    BusyError,
    CorruptRecordError,
    InvalidRequestError,
    LogClosedError,
    StorageFailureError,
    StorageFullError,
    TransactionResolvedError,
    UnknownTransactionError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.messages import Durability, TransactionState
from ferrymq.protocol.records import (
    ATTR_DEDUP,
    ATTR_SCHEDULED,
    RecordInput,
    decode_msg_id,
    encode_batch,
    encode_msg_id,
    encode_properties,
    iter_batches,
    iter_raw_records,
    validate_batch,
)
from ferrymq.protocol.schedule import DELAY, DELIVER_AT
from ferrymq.protocol.transactions import (
    COMMITTED,
    HALF_TOPIC,
    MAX_REASON_CHARS,
    OP_COMMIT,
    OP_ROLLBACK,
    PREPARED,
    ROLLED_BACK,
    TXN_CHECK,
    TXN_CLIENT,
    TXN_GROUP,
    TXN_HALF,
    TXN_MSGID,
    TXN_OP,
    TXN_QUEUE,
    TXN_REASON,
    TXN_SOURCE,
    TXN_TOPIC,
    committed_properties,
)
from ferrymq.storage.checkpoint import read_checkpoint, write_checkpoint

if TYPE_CHECKING:
    from ferrymq.broker.config import BrokerConfig
    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.scheduler import Scheduler
    from ferrymq.broker.topics import QueueState, TopicRegistry

log = logging.getLogger("ferrymq.broker")

TICK_S = 0.05
"""How often due checks are handed out (check-back precision)."""
CHECKPOINT_INTERVAL_S = 1.0
"""How often the floor checkpoint is rewritten (when it moved)."""
READ_BYTES = 1 << 20
"""Half-topic bytes read per step when rebuilding or looking up an old outcome."""
MAX_LOOKUP_BYTES = 64 << 20
"""An outcome not in memory is searched for in at most this many bytes of the half topic."""
MAX_POLL_CHECKS = 1000
"""Most checks one TXN_CHECK_POLL answer carries."""
_FLOOR = struct.Struct(">q")

SOURCES = ("producer", "check", "max_checks", "broker")


@dataclass(eq=False, slots=True)
class _Half:
    """A pending half message."""

    offset: int
    group: str
    client: str
    topic: str
    queue: int
    stored_ms: int
    check_after_ms: int
    check_interval_ms: int
    max_checks: int
    next_check: float  # monotonic seconds
    checks: int = 0
    last_answer: str = ""
    ending: asyncio.Future[m.EndTransactionResponse] | None = None


class Outcome(NamedTuple):
    """How a transaction ended."""

    state: str  # COMMITTED / ROLLED_BACK
    group: str
    topic: str
    queue: int
    offset: int  # the committed copy's offset, -1 when rolled back
    msg_id: str  # the committed copy's id, "" when rolled back
    source: str
    reason: str
    at_ms: int


@dataclass(eq=False, slots=True)
class _Poller:
    group: str
    client_id: str
    max_checks: int
    future: asyncio.Future[m.TxnCheckPollResponse]
    checks: list[m.TxnCheck] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class TransactionManager:
    """Half messages, their outcomes and check-backs. See the module docstring."""

    def __init__(
        self, config: BrokerConfig, topics: TopicRegistry, flusher: Flusher, scheduler: Scheduler,
        clock: Clock, data_dir: Path,
    ) -> None:
        self.config = config
        self.topics = topics
        self.flusher = flusher
        self.scheduler = scheduler
        self.clock = clock
        self.sync = config.flush == "sync"
        self.dir = data_dir / "transactions"
        self.pending: dict[int, _Half] = {}
        self._heap: list[tuple[float, int]] = []
        self._resolved: OrderedDict[int, Outcome] = OrderedDict()
        self._pollers: dict[str, deque[_Poller]] = {}
        self._floor_saved = -1
        self._last_checkpoint = 0.0
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._ops_due: dict[int, tuple[_Half, dict[str, str]]] = {}
        """Op records not written for lack of space (half offset -> half, properties)."""
        self.committed = 0
        self.rolled_back = 0

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def half(self) -> QueueState:
        """The half topic's one queue (created on first use: a broker that never saw a
        transaction lists no half topic)."""
        topic = self.topics.topics.get(HALF_TOPIC)
        if topic is None:
            topic = self.topics.create(HALF_TOPIC, 1, {}, self.clock.wall_ms(), internal_ok=True)
        return topic.queues[0]

    def load(self) -> None:
        """Rebuild the pending set from the half topic's log (if there is one)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if HALF_TOPIC not in self.topics.topics:
            return
        floor = 0
        try:
            raw = read_checkpoint(self.dir / "floor")
            if raw is not None and len(raw) == _FLOOR.size:
                floor = _FLOOR.unpack(raw)[0]
        except (CorruptRecordError, OSError) as exc:
            log.warning("transactions: floor checkpoint unreadable (%s); reading the whole half "
                        "topic", exc)
        qs = self.half
        start = max(floor, qs.log.start_offset)
        now = self.clock.monotonic()
        wall = self.clock.wall_ms()
        halves = ops = 0
        for off, append_ms, rec in self._scan(qs, start, None):
            props = rec.properties
            op = props.get(TXN_OP)
            if op is None:
                h = self._half_of(off, append_ms, props, now, wall)
                if h is not None:
                    self.pending[off] = h
                    halves += 1
                continue
            ops += 1
            try:
                half_off = int(props.get(TXN_HALF, "-1"))
            except ValueError:
                continue
            h = self.pending.pop(half_off, None)
            if h is not None:
                self._remember(half_off, _outcome_of(h.group, h.topic, h.queue, props, append_ms))
        for h in self.pending.values():
            heapq.heappush(self._heap, (h.next_check, h.offset))
        self._floor_saved = floor
        log.info("transactions: read %s from offset %d: %d half messages, %d outcomes, %d "
                 "pending", qs, start, halves, ops, len(self.pending))

    def _half_of(self, off: int, append_ms: int, props: dict[str, str], now: float,
                 wall: int) -> _Half | None:
        try:
            after, interval, max_checks = (int(x) for x in props[TXN_CHECK].split(","))
            h = _Half(off, props[TXN_GROUP], props.get(TXN_CLIENT, ""), props[TXN_TOPIC],
                      int(props[TXN_QUEUE]), append_ms, after, interval, max_checks, 0.0)
        except (KeyError, ValueError):
            log.warning("transactions: %s@%d is not a half message; ignored", HALF_TOPIC, off)
            return None
        h.next_check = now + max(0, append_ms + after - wall) / 1000
        return h

    def start(self) -> None:
        """Start handing out checks (event loop running)."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        """Stop checking and answer every waiting poll now (shutdown)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for pollers in self._pollers.values():
            for p in pollers:
                _answer(p)
        self._pollers.clear()

    def close(self) -> None:
        """Checkpoint the floor (after the logs' last flush)."""
        self.stop()
        self._checkpoint(force=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick()
            except Exception:
                log.exception("transaction check tick failed")

    def _checkpoint(self, *, force: bool = False) -> None:
        if HALF_TOPIC not in self.topics.topics:
            return
        qs = self.half
        floor = min([*self.pending, *self._ops_due], default=qs.log.end_offset)
        if floor == self._floor_saved:
            return
        now = self.clock.monotonic()
        if not force and now - self._last_checkpoint < CHECKPOINT_INTERVAL_S:
            return
        self._last_checkpoint = now
        try:
            write_checkpoint(self.dir / "floor", _FLOOR.pack(floor))
            self._floor_saved = floor
        except OSError as exc:
            log.error("transactions: cannot write the floor checkpoint: %s", exc)

    def retention_floors(self) -> dict[tuple[int, int], int]:
        """Retention must keep the half topic from the oldest pending half message."""
        if not self.pending and not self._ops_due:
            return {}
        qs = self.half
        return {(qs.topic_id, qs.queue): min([*self.pending, *self._ops_due])}

    # -- prepare ---------------------------------------------------------------------------------

    def prepare(
        self, req: m.PrepareTransactionRequest,
    ) -> m.PrepareTransactionResponse | asyncio.Future[m.PrepareTransactionResponse]:
        """Store a half message; answer once it is durable (sync mode) or written.

        Raises:
            BusyError: ``txn_max_pending`` half messages are pending.
            InvalidRequestError: not exactly one record, an ATTR_DEDUP batch, a bad group name
                or check setting.
            UnknownTopicError, UnknownQueueError: the target does not exist.
        """
        cfg = self.config
        if not req.group or len(req.group) > m.MAX_NAME_CHARS or "," in req.group:
            raise InvalidRequestError("a transactional producer needs a group name (1.."
                                      f"{m.MAX_NAME_CHARS} characters, no comma)")
        if min(req.check_after_ms, req.check_interval_ms, req.max_checks) < 0:
            raise InvalidRequestError("check settings must be >= 0 (0: the broker's default)")
        if len(self.pending) >= cfg.txn_max_pending:
            raise BusyError(f"{len(self.pending)} half messages pending (txn_max_pending "
                            f"{cfg.txn_max_pending}); retry when some are resolved")
        target = self.topics.queue(req.topic, req.queue)  # checks topic and queue
        if target.topic.startswith("%"):
            raise InvalidRequestError("a transaction cannot target an internal topic")
        hdr = validate_batch(req.batch, max_message_bytes=cfg.max_message_bytes, max_records=1)
        if hdr.record_count != 1:
            raise InvalidRequestError("a half message batch holds exactly one record")
        if hdr.attributes & ATTR_DEDUP:
            raise InvalidRequestError("dedup batches cannot be transactional")
        rec = _first_record(req.batch)
        now = self.clock.wall_ms()
        if hdr.attributes & ATTR_SCHEDULED:  # the delay counts from the commit: check it now
            self.scheduler.check(req.batch, hdr, now)
        after = req.check_after_ms or cfg.txn_check_after_ms
        interval = req.check_interval_ms or cfg.txn_check_interval_ms
        max_checks = req.max_checks or cfg.txn_max_checks
        props = dict(rec.properties)
        props.update({TXN_TOPIC: req.topic, TXN_QUEUE: str(req.queue), TXN_GROUP: req.group,
                      TXN_CHECK: f"{after},{interval},{max_checks}",
                      TXN_CLIENT: req.client_id[:MAX_REASON_CHARS]})
        batch = encode_batch([RecordInput(rec.body, rec.timestamp, rec.tag, rec.sharding_key,
                                          rec.keys, encode_properties(props))])
        qs = self.half
        self.flusher.check_writable(qs)
        try:
            res = qs.log.append(batch, now_ms=now)
        except OSError as exc:  # nothing was stored (the segment cut the file back)
            raise self._write_error(exc) from None
        off = res.base_offset
        h = _Half(off, req.group, req.client_id, req.topic, req.queue, res.append_time_ms, after,
                  interval, max_checks, self.clock.monotonic() + after / 1000)
        self.pending[off] = h
        heapq.heappush(self._heap, (h.next_check, off))
        self.flusher.mark_dirty(qs)
        txn_id = encode_msg_id(qs.topic_id, qs.queue, off)
        if not self.sync:
            qs.advance(qs.log.end_offset)
            return m.PrepareTransactionResponse(txn_id, Durability.WRITTEN)
        fut: asyncio.Future[m.PrepareTransactionResponse] = (
            asyncio.get_running_loop().create_future())

        def durable(exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(StorageFailureError(f"half message not fsynced: {exc}"))
            else:
                fut.set_result(m.PrepareTransactionResponse(txn_id, Durability.FSYNCED))

        _wait_durable(qs, res.last_offset + 1, durable)
        return fut

    # -- end -------------------------------------------------------------------------------------

    def end(
        self, req: m.EndTransactionRequest,
    ) -> m.EndTransactionResponse | asyncio.Future[m.EndTransactionResponse]:
        """Commit, roll back or note UNKNOWN; the same outcome again answers the first result.

        Raises:
            UnknownTransactionError: no such transaction in ``req.group``.
            TransactionResolvedError: it was resolved the other way.
            InvalidRequestError: not a transaction id or an unknown state.
        """
        if req.state not in TransactionState._value2member_map_:
            raise InvalidRequestError(f"unknown transaction state {req.state}")
        state = TransactionState(req.state)
        off = self._offset_of(req.txn_id)
        source = "check" if req.from_check else "producer"
        h = self.pending.get(off)
        if h is None:
            out = self._outcome(off)
            if out is None or out.group != req.group:
                raise UnknownTransactionError(
                    f"no transaction {req.txn_id} in producer group {req.group!r}")
            want = {TransactionState.COMMIT: COMMITTED, TransactionState.ROLLBACK: ROLLED_BACK}
            if state != TransactionState.UNKNOWN and want[state] != out.state:
                raise TransactionResolvedError(
                    f"transaction {req.txn_id} was already {out.state.lower().replace('_', ' ')}"
                    f" ({out.source}: {out.reason or '-'})")
            return _response(out, self.sync)
        if h.group != req.group:
            raise UnknownTransactionError(
                f"no transaction {req.txn_id} in producer group {req.group!r}")
        if h.ending is not None:  # a commit is waiting for its copy's fsync
            if state == TransactionState.ROLLBACK:
                raise TransactionResolvedError(f"transaction {req.txn_id} is being committed")
            if h.ending.done() and h.ending.exception() is not None:  # waits for disk space
                raise StorageFullError(
                    f"transaction {req.txn_id} is committed; its copy in {h.topic}/{h.queue} "
                    "is made durable once disk space is back",
                    retry_after_ms=self.config.busy_retry_after_ms)
            return h.ending
        reason = req.reason[:MAX_REASON_CHARS]
        if state == TransactionState.UNKNOWN:
            h.last_answer = f"{source} answered UNKNOWN" + (f": {reason}" if reason else "")
            return m.EndTransactionResponse(PREPARED, "", h.topic, h.queue, -1, 0)
        if state == TransactionState.ROLLBACK:
            return _response(self._rollback(h, source, reason or f"rolled back by the {source}"), self.sync)
        return self._commit(h, source, reason)

    def _commit(self, h: _Half, source: str, reason: str
                ) -> m.EndTransactionResponse | asyncio.Future[m.EndTransactionResponse]:
        txn_id = encode_msg_id(self.half.topic_id, 0, h.offset)
        try:
            rec = self._read_half(h.offset)
            topic = self.topics.get(h.topic)
            if h.queue >= len(topic.queues):
                raise InvalidRequestError(f"{h.topic} has no queue {h.queue} any more")
        except (BrokerError, LogClosedError) as exc:
            return _response(self._rollback(h, "broker", f"cannot commit: {exc}"), self.sync)
        qs = topic.queues[h.queue]
        props = committed_properties(rec.properties, txn_id)
        scheduled = DELAY in props or DELIVER_AT in props
        batch = encode_batch([RecordInput(rec.body, rec.timestamp, rec.tag, rec.sharding_key,
                                          rec.keys, encode_properties(props))],
                             attributes=ATTR_SCHEDULED if scheduled else 0)
        now = self.clock.wall_ms()
        self.flusher.check_writable(qs)
        dues = None
        if scheduled:
            hdr = validate_batch(batch, max_message_bytes=1 << 30, max_records=1)
            dues = self.scheduler.check(batch, hdr, now)
        try:
            res = qs.log.append(batch, now_ms=now)
        except OSError as exc:  # nothing was stored
            raise self._write_error(exc) from None
        if dues is not None:
            self.scheduler.on_append(qs, batch, res.base_offset, res.append_time_ms, dues)
        self.flusher.mark_dirty(qs)
        if not self.sync:
            qs.advance(qs.log.end_offset)
        fut: asyncio.Future[m.EndTransactionResponse] = asyncio.get_running_loop().create_future()
        h.ending = fut
        copy_id = encode_msg_id(qs.topic_id, qs.queue, res.base_offset)

        def copied(exc: BaseException | None) -> None:
            if flush_postponed(exc) and qs not in self.flusher.failed:
                # the copy is written: the flusher's rewrite makes it durable once space is
                # back, then this runs again and writes the op (h.ending stays: no 2nd copy)
                _wait_durable(qs, res.last_offset + 1, copied)
                if not fut.done():
                    back = ("space is back" if isinstance(exc, StorageFullError)
                            else "file descriptors are free")
                    fut.set_exception(type(exc)(
                        f"committed copy not fsynced yet ({exc.message}); the commit completes "
                        f"once {back}", retry_after_ms=self.config.busy_retry_after_ms))
                return
            h.ending = None
            if exc is not None:  # stays pending: a later commit or check writes another copy
                if not fut.done():
                    fut.set_exception(StorageFailureError(f"committed copy not fsynced: {exc}"))
                return
            if self.pending.get(h.offset) is not h:
                out = self._outcome(h.offset)
            else:
                out = self._write_op(h, OP_COMMIT, source, reason, res.base_offset, copy_id)
            if not fut.done():
                if out is None:
                    fut.set_exception(UnknownTransactionError(f"transaction {txn_id} vanished"))
                else:
                    fut.set_result(_response(out, self.sync))

        if self.sync:
            _wait_durable(qs, res.last_offset + 1, copied)
        else:
            copied(None)
        return fut

    def _rollback(self, h: _Half, source: str, reason: str) -> Outcome:
        return self._write_op(h, OP_ROLLBACK, source, reason, -1, "")

    def _write_op(self, h: _Half, op: str, source: str, reason: str, offset: int,
                  msg_id: str) -> Outcome:
        """Append the op record and forget the pending half message. A failed write is logged:
        the half message is pending again after a restart (checked back: at-least-once)."""
        props = {TXN_OP: op, TXN_HALF: str(h.offset), TXN_SOURCE: source,
                 TXN_REASON: reason[:MAX_REASON_CHARS]}
        if msg_id:
            props[TXN_MSGID] = msg_id
        now = self.clock.wall_ms()
        qs = self.half
        if not self._append_op(props, now):
            self._ops_due[h.offset] = (h, props)
            log.error("transactions: cannot record %s of %s@%d yet; written once space is back "
                      "(or checked again after a restart)", op, qs, h.offset)
        self.pending.pop(h.offset, None)
        out = _outcome_of(h.group, h.topic, h.queue, props, now)
        self._remember(h.offset, out)
        if op == OP_COMMIT:
            self.committed += 1
        else:
            self.rolled_back += 1
            log.info("transactions: %s@%d rolled back (%s: %s)", qs, h.offset, source, reason)
        return out

    def _append_op(self, props: dict[str, str], now: int) -> bool:
        """Append one op record to the half topic; False when it could not be written."""
        qs = self.half
        if qs in self.flusher.failed or qs in self.flusher.full:
            return False
        try:
            qs.log.append(encode_batch([RecordInput(b"", now, properties=encode_properties(props))]),
                          now_ms=now)
        except OSError as exc:
            self._write_error(exc)
            log.warning("transactions: cannot write an op record to %s: %s", qs, exc)
            return False
        except (BrokerError, LogClosedError) as exc:
            log.warning("transactions: cannot write an op record to %s: %s", qs, exc)
            return False
        self.flusher.mark_dirty(qs)
        if not self.sync:
            qs.advance(qs.log.end_offset)
        return True

    def _retry_ops(self) -> None:
        """Write the op records a full disk held back (tick, once space is back)."""
        for off, (_h, props) in list(self._ops_due.items()):
            if not self._append_op(props, self.clock.wall_ms()):
                return
            del self._ops_due[off]
            log.warning("transactions: %s of %s@%d recorded after the disk was full",
                        props[TXN_OP], self.half, off)

    def _write_error(self, exc: OSError) -> BrokerError:
        """The error to answer for a failed write (the watermarks hear of a full disk)."""
        return self.flusher.write_error(exc, "the transaction's record")

    # -- check-back ------------------------------------------------------------------------------

    def poll(
        self, req: m.TxnCheckPollRequest,
    ) -> m.TxnCheckPollResponse | asyncio.Future[m.TxnCheckPollResponse]:
        """A producer of ``req.group`` waits up to ``wait_ms`` for checks to answer."""
        if not req.group:
            raise InvalidRequestError("group must not be empty")
        if req.wait_ms < 0 or req.max_checks < 0:
            raise InvalidRequestError("wait_ms and max_checks must be >= 0")
        loop = asyncio.get_running_loop()
        p = _Poller(req.group, req.client_id, min(req.max_checks or MAX_POLL_CHECKS,
                                                  MAX_POLL_CHECKS), loop.create_future())
        if self._closed or req.wait_ms == 0:
            p.future.set_result(m.TxnCheckPollResponse([]))
            return p.future
        wait = min(req.wait_ms, self.config.max_fetch_wait_ms) / 1000
        p.timer = loop.call_later(wait, self._expire, p)
        self._pollers.setdefault(req.group, deque()).append(p)
        return p.future

    def _expire(self, p: _Poller) -> None:
        """A poll's wait is over: answer it (empty) and forget it."""
        p.timer = None
        q = self._pollers.get(p.group)
        if q is not None:
            try:
                q.remove(p)
            except ValueError:
                pass
            if not q:
                del self._pollers[p.group]
        _answer(p)

    def tick(self) -> None:
        """Hand out due checks; roll back half messages that ran out of checks."""
        now = self.clock.monotonic()
        heap = self._heap
        answered: list[_Poller] = []
        while heap and heap[0][0] <= now:
            t, off = heapq.heappop(heap)
            h = self.pending.get(off)
            if h is None or h.next_check != t or h.ending is not None:
                if h is not None and h.ending is not None:  # committing: look again later
                    h.next_check = now + h.check_interval_ms / 1000
                    heapq.heappush(heap, (h.next_check, off))
                continue
            if h.checks >= h.max_checks:
                self._rollback(h, "max_checks",
                               f"no COMMIT or ROLLBACK after {h.checks} check-backs of producer "
                               f"group {h.group!r} (last: {h.last_answer or 'no answer'})")
                continue
            h.checks += 1
            h.next_check = now + h.check_interval_ms / 1000
            heapq.heappush(heap, (h.next_check, off))
            p = self._poller(h.group)
            if p is None:
                h.last_answer = f"no live producer of group {h.group!r}"
                continue
            h.last_answer = f"check {h.checks} sent to {p.client_id or '?'}, no answer"
            try:
                p.checks.append(self._check_of(h))
            except (BrokerError, LogClosedError) as exc:
                self._rollback(h, "broker", f"half message unreadable: {exc}")
                continue
            if len(p.checks) >= p.max_checks:
                self._pollers[h.group].remove(p)
                _answer(p)
            elif p not in answered:
                answered.append(p)
        for p in answered:
            q = self._pollers.get(p.group)
            if q is not None and p in q:
                q.remove(p)
            _answer(p)
        if self._ops_due and self.flusher.space_back:
            self._retry_ops()
        self._checkpoint()

    def _poller(self, group: str) -> _Poller | None:
        """The next live poller of ``group`` (round robin: it goes to the back)."""
        q = self._pollers.get(group)
        while q:
            p = q.popleft()
            if p.future.done():
                continue
            q.append(p)
            return p
        return None

    def _check_of(self, h: _Half) -> m.TxnCheck:
        rec = self._read_half(h.offset)
        txn_id = encode_msg_id(self.half.topic_id, 0, h.offset)
        batch = encode_batch([RecordInput(
            rec.body, rec.timestamp, rec.tag, rec.sharding_key, rec.keys,
            encode_properties(committed_properties(rec.properties, txn_id)))])
        return (txn_id, h.topic, h.queue, bytes(batch), h.checks)

    # -- status ----------------------------------------------------------------------------------

    def is_transaction(self, msg_id: str) -> bool:
        """Whether ``msg_id`` names a message of the half topic."""
        try:
            tid, _q, _off = decode_msg_id(msg_id)
        except ValueError:
            return False
        return HALF_TOPIC in self.topics.topics and tid == self.half.topic_id

    def status(self, msg_id: str) -> m.MessageStatusResponse:
        """``message status`` of a transaction id: PREPARED (checks so far, next check),
        COMMITTED (the committed copy) or ROLLED_BACK (why).

        Raises:
            UnknownTransactionError: not a half message (or removed by retention).
        """
        off = self._offset_of(msg_id)
        h = self.pending.get(off)
        if h is not None:
            left = max(0.0, h.next_check - self.clock.monotonic())
            next_wall = self.clock.wall_ms() + int(left * 1000)
            detail = (f"half message of producer group {h.group!r} (sent by {h.client or '?'}); "
                      f"{h.checks} of {h.max_checks} check-backs so far; "
                      f"{h.last_answer or 'no answer yet'}")
            return m.MessageStatusResponse(h.topic, h.queue, -1, [
                (h.group, PREPARED, h.client, -1, h.checks, next_wall, detail, h.stored_ms)])
        out = self._outcome(off)
        if out is None:
            raise UnknownTransactionError(f"no transaction {msg_id}")
        if out.state == COMMITTED:
            detail = f"committed by the {out.source} as message {out.msg_id}"
        else:
            detail = f"rolled back by the {out.source}: {out.reason or '-'}"
        return m.MessageStatusResponse(out.topic, out.queue, out.offset, [
            (out.group, out.state, "", -1, 0, -1, detail, out.at_ms)])

    # -- reading the half topic ------------------------------------------------------------------

    def _offset_of(self, txn_id: str) -> int:
        try:
            tid, q, off = decode_msg_id(txn_id)
        except ValueError:
            raise InvalidRequestError(f"not a transaction id: {txn_id[:64]!r}") from None
        if HALF_TOPIC not in self.topics.topics or tid != self.half.topic_id or q != 0:
            raise UnknownTransactionError(f"{txn_id} is not a transaction id (a half message's)")
        return off

    def _remember(self, off: int, out: Outcome) -> None:
        r = self._resolved
        r[off] = out
        r.move_to_end(off)
        while len(r) > self.config.txn_max_pending:
            r.popitem(last=False)

    def _outcome(self, off: int) -> Outcome | None:
        """The outcome of the half message at ``off`` (memory, else the half topic)."""
        out = self._resolved.get(off)
        if out is not None:
            return out
        qs = self.half
        if not qs.log.start_offset <= off < qs.log.end_offset:
            return None
        half: dict[str, str] | None = None
        for o, append_ms, rec in self._scan(qs, off, MAX_LOOKUP_BYTES):
            props = rec.properties
            if o == off:
                if TXN_OP in props:
                    return None
                half = props
            elif half is not None and props.get(TXN_HALF) == str(off):
                out = _outcome_of(half.get(TXN_GROUP, ""), half.get(TXN_TOPIC, ""),
                                  int(half.get(TXN_QUEUE, "-1") or -1), props, append_ms)
                self._remember(off, out)
                return out
        return None

    def _read_half(self, off: int) -> StoredRecord:
        for o, _ms, rec in self._scan(self.half, off, 1, step=1):  # just the batch holding it
            if o == off:
                return rec
            break
        raise CorruptRecordError(f"half message at offset {off} not found")

    def _scan(self, qs: QueueState, start: int, max_bytes: int | None, *,
              step: int = READ_BYTES) -> Iterator[tuple[int, int, StoredRecord]]:
        """``(offset, append time, record)`` from ``start`` to the end (or ``max_bytes``),
        reading ``step`` bytes at a time (at least one batch)."""
        pos = start
        read = 0
        while pos < qs.log.end_offset and (max_bytes is None or read < max_bytes):
            data = qs.log.read(pos, step)
            if not data:
                return
            read += len(data)
            mv = memoryview(data)
            nxt = pos
            for p, hdr in iter_batches(mv):
                nxt = hdr.last_offset + 1
                try:
                    for rec in iter_raw_records(mv, p, hdr):
                        if rec[0] >= pos:
                            yield rec[0], hdr.append_time_ms, stored_record(mv, rec)
                except CorruptRecordError as exc:
                    log.warning("transactions: %s batch at %d unreadable: %s", qs,
                                hdr.base_offset, exc)
            if nxt <= pos:
                return
            pos = nxt


def _first_record(batch: bytes | bytearray | memoryview) -> StoredRecord:
    mv = memoryview(batch)
    for p, hdr in iter_batches(mv):
        for rec in iter_raw_records(mv, p, hdr):
            return stored_record(mv, rec)
    raise InvalidRequestError("a half message batch holds exactly one record")


def _outcome_of(group: str, topic: str, queue: int, props: dict[str, str], at_ms: int) -> Outcome:
    msg_id = props.get(TXN_MSGID, "")
    offset = -1
    if msg_id:
        try:
            offset = decode_msg_id(msg_id)[2]
        except ValueError:
            msg_id = ""
    state = COMMITTED if props.get(TXN_OP) == OP_COMMIT else ROLLED_BACK
    return Outcome(state, group, topic, queue, offset, msg_id, props.get(TXN_SOURCE, ""),
                   props.get(TXN_REASON, ""), at_ms)


def _response(out: Outcome, sync: bool) -> m.EndTransactionResponse:
    durability = (Durability.FSYNCED if sync else Durability.WRITTEN) if out.msg_id else 0
    return m.EndTransactionResponse(out.state, out.msg_id, out.topic, out.queue, out.offset,
                                    durability)


def _answer(p: _Poller) -> None:
    if p.timer is not None:
        p.timer.cancel()
        p.timer = None
    if not p.future.done():
        p.future.set_result(m.TxnCheckPollResponse(p.checks))


def _wait_durable(qs: QueueState, end: int, cb: Callable[[BaseException | None], None]) -> None:
    """Run ``cb`` once ``qs`` is fsynced up to ``end`` (the flush-waiter deque stays sorted)."""
    if qs.log.durable_offset >= end and not qs.flush_waiters:
        cb(None)
        return
    qs.wait_durable(end, cb)
