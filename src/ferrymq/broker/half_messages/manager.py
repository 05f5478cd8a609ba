"""The half-message manager: PREPARE, END_HALF, check-back rounds, status and recovery.

It drives :class:`~.state.HalfBook` (which decides) over :class:`~.halflog.HalfLog` (which
writes and reads the half topic) and :class:`~.checkback.Pollers` (which holds the producers'
long polls). The package docstring (:mod:`ferrymq.broker.half_messages`) has the theory of
operation; in a cluster :mod:`.cluster` is attached (:meth:`HalfMessageManager.attach`) and says
what changes.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ferrymq._time import Clock
from ferrymq.broker.flusher import flush_postponed
from ferrymq.broker.half_messages.checkback import Poller, Pollers
from ferrymq.broker.half_messages.halflog import HalfLog, first_record
from ferrymq.broker.half_messages.state import (
    TRANSITIONS,
    HalfBook,
    HalfEvent,
    HalfPhase,
    Outcome,
    PendingHalf,
    outcome_of,
)
from ferrymq.errors import (
    BrokerError,
    HalfMessageResolvedError,
    InvalidRequestError,
    LogClosedError,
    NotCoordinatorError,
    StorageFailureError,
    StorageFullError,
    UnknownHalfMessageError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.half_messages import (
    COMMITTED,
    HALF_CHECK,
    HALF_CLIENT,
    HALF_GROUP,
    HALF_MSGID,
    HALF_OFFSET,
    HALF_OP,
    HALF_REASON,
    HALF_SOURCE,
    HALF_TARGET_QUEUE,
    HALF_TARGET_TOPIC,
    HALF_TOPIC,
    MAX_REASON_CHARS,
    OP_COMMIT,
    OP_ROLLBACK,
    PREPARED,
    committed_properties,
)
from ferrymq.protocol.messages import Durability, HalfState
from ferrymq.protocol.records import (
    ATTR_DEDUP,
    ATTR_SCHEDULED,
    RecordInput,
    decode_msg_id,
    encode_batch,
    encode_msg_id,
    encode_properties,
    validate_batch,
)
from ferrymq.protocol.schedule import DELAY, DELIVER_AT

if TYPE_CHECKING:
    from ferrymq.broker.config import BrokerConfig
    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.half_messages.cluster import HalfCluster
    from ferrymq.broker.scheduler import Scheduler
    from ferrymq.broker.topics import QueueState, TopicRegistry

log = logging.getLogger("ferrymq.broker")

TICK_S = 0.05
"""How often due checks are handed out (check-back precision)."""
CHECKPOINT_INTERVAL_S = 1.0
"""How often the floor checkpoint is rewritten (when it moved)."""

R = TypeVar("R", m.PrepareHalfResponse, m.EndHalfResponse)
_ANSWERS = {HalfState.COMMIT: HalfEvent.COMMIT,
            HalfState.ROLLBACK: HalfEvent.ROLLBACK,
            HalfState.UNKNOWN: HalfEvent.UNKNOWN}


class HalfMessageManager:
    """Half messages, their outcomes and check-backs. See the package docstring."""

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
        self.book = HalfBook(config.half_max_pending)
        self.halflog = HalfLog(topics, flusher, clock, data_dir, sync=self.sync)
        self.pollers = Pollers()
        self._floor_saved = -1
        self._last_checkpoint = 0.0
        self._task: asyncio.Task[None] | None = None
        self._ending: dict[int, asyncio.Future[m.EndHalfResponse]] = {}
        """Half offset -> the answer of its commit in progress (its copy not durable yet)."""
        self._ops_due: dict[int, tuple[PendingHalf, dict[str, str]]] = {}
        """Op records not written for lack of space (half offset -> half, properties)."""
        self.committed = 0
        self.rolled_back = 0
        self.cluster: HalfCluster | None = None
        """A cluster's part (None: a single broker, which owns every half message)."""
        self._copies: set[asyncio.Task[None]] = set()
        """A cluster's committed copies on their way to other brokers."""

    def attach(self, cluster: HalfCluster) -> None:
        """Own half messages as a broker of a cluster (see :mod:`.cluster`)."""
        self.cluster = cluster
        self.halflog.cluster = True

    @property
    def pending(self) -> dict[int, PendingHalf]:
        """The pending half messages by offset."""
        return self.book.pending

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def half(self) -> QueueState:
        """The half topic's one queue (created on first use)."""
        return self.halflog.queue

    def load(self) -> None:
        """Rebuild the pending set from the half topic's log (if there is one). A cluster's
        broker has nothing to load: the owner reads the half queue when it starts leading it
        (:meth:`rebuild`)."""
        self.halflog.dir.mkdir(parents=True, exist_ok=True)
        if not self.halflog.exists or self.config.metadata:
            return
        floor = self.halflog.read_floor()
        self._read(max(floor, self.half.log.start_offset))
        self._floor_saved = floor

    def rebuild(self) -> None:
        """A cluster's new owner: the pending set from the whole half queue (everything known
        before forgotten)."""
        self.forget()
        if self.halflog.exists:
            self._read(self.half.log.start_offset)

    def forget(self) -> None:
        """Forget every half message (a cluster's owner that stops owning) and answer the
        waiting polls."""
        self.book = HalfBook(self.config.half_max_pending)
        self._ops_due.clear()
        for fut in self._ending.values():
            if not fut.done():
                fut.set_exception(NotCoordinatorError("this broker stopped owning half "
                                                      "messages during the commit; retry"))
        self._ending.clear()
        self.pollers.release()

    def _read(self, start: int) -> None:
        """Half records without an op from ``start`` on are pending; the others resolved."""
        qs = self.half
        now = self.clock.monotonic()
        wall = self.clock.wall_ms()
        pending = self.book.pending
        halves = ops = 0
        for off, append_ms, rec in self.halflog.scan(start, None):
            props = rec.properties
            op = props.get(HALF_OP)
            if op is None:
                h = _half_of(off, append_ms, props, now, wall)
                if h is not None:
                    pending[off] = h
                    halves += 1
                continue
            ops += 1
            try:
                half_off = int(props.get(HALF_OFFSET, "-1"))
            except ValueError:
                continue
            h = pending.pop(half_off, None)
            if h is not None:
                self.book.remember(half_off, outcome_of(h.group, h.topic, h.queue, props,
                                                        append_ms))
        self.book.restore(pending.values())
        log.info("half messages: read %s from offset %d: %d half messages, %d outcomes, %d "
                 "pending", qs, start, halves, ops, len(pending))

    def start(self) -> None:
        """Start handing out checks (event loop running)."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        """Stop checking and answer every waiting poll now (shutdown)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.pollers.stop()

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
                log.exception("half-message check tick failed")

    def _checkpoint(self, *, force: bool = False) -> None:
        if not self.halflog.exists:
            return
        floor = self.book.floor(self._ops_due, self.half.log.end_offset)
        if floor == self._floor_saved:
            return
        now = self.clock.monotonic()
        if not force and now - self._last_checkpoint < CHECKPOINT_INTERVAL_S:
            return
        self._last_checkpoint = now
        if self.halflog.write_floor(floor):
            self._floor_saved = floor

    def retention_floors(self) -> dict[tuple[int, int], int]:
        """Retention must keep the half topic from the oldest pending half message (a cluster's
        broker that does not own them: all of it, as it may own them next)."""
        if self.cluster is not None and not self.cluster.leads and self.halflog.exists:
            return {(self.half.topic_id, 0): 0}
        if not self.book.pending and not self._ops_due:
            return {}
        qs = self.half
        return {(qs.topic_id, qs.queue): self.book.floor(self._ops_due, qs.log.end_offset)}

    # -- prepare ---------------------------------------------------------------------------------

    def prepare(
        self, req: m.PrepareHalfRequest,
    ) -> m.PrepareHalfResponse | asyncio.Future[m.PrepareHalfResponse]:
        """Store a half message; answer once it is durable (sync mode) or written.

        Raises:
            BusyError: ``half_max_pending`` half messages are pending.
            InvalidRequestError: not exactly one record, an ATTR_DEDUP batch, a bad group name
                or check setting.
            UnknownTopicError, UnknownQueueError: the target does not exist.
        """
        cfg = self.config
        if not req.group or len(req.group) > m.MAX_NAME_CHARS or "," in req.group:
            raise InvalidRequestError("a half-message producer needs a group name (1.."
                                      f"{m.MAX_NAME_CHARS} characters, no comma)")
        if min(req.check_after_ms, req.check_interval_ms, req.max_checks) < 0:
            raise InvalidRequestError("check settings must be >= 0 (0: the broker's default)")
        self.book.check_room()
        target = self.topics.queue(req.topic, req.queue)  # checks topic and queue
        if target.topic.startswith("%"):
            raise InvalidRequestError("a half message cannot target an internal topic")
        hdr = validate_batch(req.batch, max_message_bytes=cfg.max_message_bytes, max_records=1)
        if hdr.record_count != 1:
            raise InvalidRequestError("a half message batch holds exactly one record")
        if hdr.attributes & ATTR_DEDUP:
            raise InvalidRequestError("dedup batches cannot be half messages")
        rec = first_record(req.batch)
        now = self.clock.wall_ms()
        if hdr.attributes & ATTR_SCHEDULED:  # the delay counts from the commit: check it now
            self.scheduler.check(req.batch, hdr, now)
        after = req.check_after_ms or cfg.half_check_after_ms
        interval = req.check_interval_ms or cfg.half_check_interval_ms
        max_checks = req.max_checks or cfg.half_max_checks
        props = dict(rec.properties)
        props.update({HALF_TARGET_TOPIC: req.topic, HALF_TARGET_QUEUE: str(req.queue), HALF_GROUP: req.group,
                      HALF_CHECK: f"{after},{interval},{max_checks}",
                      HALF_CLIENT: req.client_id[:MAX_REASON_CHARS]})
        batch = encode_batch([RecordInput(rec.body, rec.timestamp, rec.tag, rec.sharding_key,
                                          rec.keys, encode_properties(props))])
        res = self.halflog.append_half(batch, now)
        qs = self.half
        off = res.base_offset
        self.book.add(PendingHalf(off, req.group, req.client_id, req.topic, req.queue,
                                  res.append_time_ms, after, interval, max_checks,
                                  self.clock.monotonic() + after / 1000))
        self.halflog.written(qs)
        half_id = encode_msg_id(qs.topic_id, qs.queue, off)
        if self.cluster is not None:
            return asyncio.ensure_future(self._replicated(
                res.last_offset + 1, m.PrepareHalfResponse(half_id, Durability.REPLICATED)))
        if not self.sync:
            return m.PrepareHalfResponse(half_id, Durability.WRITTEN)
        fut: asyncio.Future[m.PrepareHalfResponse] = (
            asyncio.get_running_loop().create_future())

        def durable(exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(StorageFailureError(f"half message not fsynced: {exc}"))
            else:
                fut.set_result(m.PrepareHalfResponse(half_id, Durability.FSYNCED))

        qs.when_durable(res.last_offset + 1, durable)
        return fut

    async def _replicated(self, end: int, answer: R) -> R:
        """``answer`` once the half queue's high watermark covers ``end`` (a cluster's)."""
        assert self.cluster is not None
        await self.cluster.replicated(self.half, end)
        return answer

    def _answer(self, out: Outcome) -> m.EndHalfResponse | asyncio.Future[m.EndHalfResponse]:
        """END_HALF's answer for ``out``: in a cluster once its op record is replicated."""
        if self.cluster is None:
            return _response(out, self.sync)
        return asyncio.ensure_future(self._replicated(
            self.half.log.end_offset, _response(out, self.sync)))

    # -- end -------------------------------------------------------------------------------------

    def end(
        self, req: m.EndHalfRequest,
    ) -> m.EndHalfResponse | asyncio.Future[m.EndHalfResponse]:
        """Commit, roll back or note UNKNOWN; the same outcome again answers the first result.

        Raises:
            UnknownHalfMessageError: no such half message in ``req.group``.
            HalfMessageResolvedError: it was resolved the other way.
            InvalidRequestError: not a half id or an unknown state.
        """
        if req.state not in HalfState._value2member_map_:
            raise InvalidRequestError(f"unknown half-message state {req.state}")
        event = _ANSWERS[HalfState(req.state)]
        off = self._offset_of(req.half_id)
        source = "check" if req.from_check else "producer"
        h = self.book.get(off)
        if h is None:
            out = self._outcome(off)
            if out is None or out.group != req.group:
                raise UnknownHalfMessageError(
                    f"no half message {req.half_id} in producer group {req.group!r}")
            if (HalfPhase(out.state), event) not in TRANSITIONS:
                raise HalfMessageResolvedError(
                    f"half message {req.half_id} was already {out.state.lower().replace('_', ' ')}"
                    f" ({out.source}: {out.reason or '-'})")
            return self._answer(out)
        if h.group != req.group:
            raise UnknownHalfMessageError(
                f"no half message {req.half_id} in producer group {req.group!r}")
        if h.state == HalfPhase.COMMITTING:  # a commit is waiting for its copy's fsync
            if (h.state, event) not in TRANSITIONS:
                raise HalfMessageResolvedError(f"half message {req.half_id} is being committed")
            ending = self._ending[off]
            if ending.done() and ending.exception() is not None:  # waits for disk space
                raise StorageFullError(
                    f"half message {req.half_id} is committed; its copy in {h.topic}/{h.queue} "
                    "is made durable once disk space is back",
                    retry_after_ms=self.config.busy_retry_after_ms)
            return ending
        reason = req.reason[:MAX_REASON_CHARS]
        if event == HalfEvent.UNKNOWN:
            self.book.step(h, event)
            h.last_answer = f"{source} answered UNKNOWN" + (f": {reason}" if reason else "")
            return m.EndHalfResponse(PREPARED, "", h.topic, h.queue, -1, 0)
        if event == HalfEvent.ROLLBACK:
            return self._answer(self._rollback(h, source,
                                               reason or f"rolled back by the {source}"))
        return self._commit(h, source, reason)

    def _commit(self, h: PendingHalf, source: str, reason: str
                ) -> m.EndHalfResponse | asyncio.Future[m.EndHalfResponse]:
        half_id = encode_msg_id(self.half.topic_id, 0, h.offset)
        try:
            rec = self.halflog.read_half(h.offset)
            topic = self.topics.get(h.topic)
            if h.queue >= len(topic.queues):
                raise InvalidRequestError(f"{h.topic} has no queue {h.queue} any more")
        except (BrokerError, LogClosedError) as exc:
            return self._answer(self._rollback(h, "broker", f"cannot commit: {exc}"))
        qs = topic.queues[h.queue]
        props = committed_properties(rec.properties, half_id)
        scheduled = DELAY in props or DELIVER_AT in props
        batch = encode_batch([RecordInput(rec.body, rec.timestamp, rec.tag, rec.sharding_key,
                                          rec.keys, encode_properties(props))],
                             attributes=ATTR_SCHEDULED if scheduled else 0)
        now = self.clock.wall_ms()
        if self.cluster is not None and not self.cluster.is_local(qs):
            return self._commit_remote(h, qs, batch, source, reason)
        qs.check_own_write()  # a cluster's queue led elsewhere: NOT_LEADER, nothing written
        self.flusher.check_writable(qs)
        dues = None
        if scheduled:
            hdr = validate_batch(batch, max_message_bytes=1 << 30, max_records=1)
            dues = self.scheduler.check(batch, hdr, now)
        try:
            res = qs.log.append(batch, now_ms=now)
        except OSError as exc:  # nothing was stored
            raise self.halflog.write_error(exc) from None
        if dues is not None:
            self.scheduler.on_append(qs, batch, res.base_offset, res.append_time_ms, dues)
        self.halflog.written(qs)
        fut: asyncio.Future[m.EndHalfResponse] = asyncio.get_running_loop().create_future()
        self.book.step(h, HalfEvent.COMMIT)
        self._ending[h.offset] = fut
        copy_id = encode_msg_id(qs.topic_id, qs.queue, res.base_offset)

        def copied(exc: BaseException | None) -> None:
            if flush_postponed(exc) and qs not in self.flusher.failed:
                # the copy is written: the flusher's rewrite makes it durable once space is
                # back, then this runs again and writes the op (still COMMITTING: no 2nd copy)
                qs.when_durable(res.last_offset + 1, copied)
                if not fut.done():
                    back = ("space is back" if isinstance(exc, StorageFullError)
                            else "file descriptors are free")
                    fut.set_exception(type(exc)(
                        f"committed copy not fsynced yet ({exc.message}); the commit completes "
                        f"once {back}", retry_after_ms=self.config.busy_retry_after_ms))
                return
            self._ending.pop(h.offset, None)
            if exc is not None:  # stays pending: a later commit or check writes another copy
                self.book.step(h, HalfEvent.COPY_LOST)
                if not fut.done():
                    fut.set_exception(StorageFailureError(f"committed copy not fsynced: {exc}"))
                return
            if self.book.get(h.offset) is not h:
                out = self._outcome(h.offset)
            else:
                out = self._write_op(h, OP_COMMIT, source, reason, res.base_offset, copy_id)
            self._settle(fut, out, half_id)

        if self.cluster is not None and qs.replica is not None:
            qs.replica.wait_acks(res.last_offset + 1, 0, copied)
        elif self.sync:
            qs.when_durable(res.last_offset + 1, copied)
        else:
            copied(None)
        return fut

    def _settle(self, fut: asyncio.Future[m.EndHalfResponse], out: Outcome | None,
                half_id: str) -> None:
        """Answer a commit with its outcome (in a cluster once its op record is replicated)."""
        if fut.done():
            return
        if out is None:
            fut.set_exception(UnknownHalfMessageError(f"half message {half_id} vanished"))
            return
        answer = self._answer(out)
        if isinstance(answer, m.EndHalfResponse):
            fut.set_result(answer)
            return

        def done(a: asyncio.Future[m.EndHalfResponse]) -> None:
            if fut.done():
                return
            if a.exception() is not None:
                fut.set_exception(a.exception())  # type: ignore[arg-type]
            else:
                fut.set_result(a.result())

        answer.add_done_callback(done)

    def _commit_remote(self, h: PendingHalf, qs: QueueState, batch: bytes | bytearray,
                       source: str, reason: str) -> asyncio.Future[m.EndHalfResponse]:
        """A cluster's commit into a queue led by another broker: the copy is sent there
        (``acks="all"``), then the op record written here."""
        cluster = self.cluster
        assert cluster is not None
        half_id = encode_msg_id(self.half.topic_id, 0, h.offset)
        fut: asyncio.Future[m.EndHalfResponse] = asyncio.get_running_loop().create_future()
        self.book.step(h, HalfEvent.COMMIT)
        self._ending[h.offset] = fut

        async def copy() -> None:
            try:
                offset = await cluster.produce(qs, batch)
            except BrokerError as exc:
                self._ending.pop(h.offset, None)
                if self.book.get(h.offset) is h:  # pending again: a later commit or check
                    self.book.step(h, HalfEvent.COPY_LOST)
                if not fut.done():
                    fut.set_exception(exc)
                return
            self._ending.pop(h.offset, None)
            if self.book.get(h.offset) is not h:
                out = self._outcome(h.offset)
            else:
                out = self._write_op(h, OP_COMMIT, source, reason, offset,
                                     encode_msg_id(qs.topic_id, qs.queue, offset))
            self._settle(fut, out, half_id)

        task = asyncio.get_running_loop().create_task(copy())
        self._copies.add(task)
        task.add_done_callback(self._copies.discard)
        return fut

    def _rollback(self, h: PendingHalf, source: str, reason: str) -> Outcome:
        return self._write_op(h, OP_ROLLBACK, source, reason, -1, "")

    def _write_op(self, h: PendingHalf, op: str, source: str, reason: str, offset: int,
                  msg_id: str) -> Outcome:
        """Append the op record and forget the pending half message. A failed write is logged:
        the half message is pending again after a restart (checked back: at-least-once)."""
        props = {HALF_OP: op, HALF_OFFSET: str(h.offset), HALF_SOURCE: source,
                 HALF_REASON: reason[:MAX_REASON_CHARS]}
        if msg_id:
            props[HALF_MSGID] = msg_id
        now = self.clock.wall_ms()
        if not self.halflog.append_op(props, now):
            self._ops_due[h.offset] = (h, props)
            log.error("half messages: cannot record %s of %s@%d yet; written once space is back "
                      "(or checked again after a restart)", op, self.half, h.offset)
        out = outcome_of(h.group, h.topic, h.queue, props, now)
        self.book.resolve(h, out)
        if op == OP_COMMIT:
            self.committed += 1
        else:
            self.rolled_back += 1
            log.info("half messages: %s@%d rolled back (%s: %s)", self.half, h.offset, source,
                     reason)
        return out

    def _retry_ops(self) -> None:
        """Write the op records a full disk held back (tick, once space is back)."""
        for off, (_h, props) in list(self._ops_due.items()):
            if not self.halflog.append_op(props, self.clock.wall_ms()):
                return
            del self._ops_due[off]
            log.warning("half messages: %s of %s@%d recorded after the disk was full",
                        props[HALF_OP], self.half, off)

    # -- check-back ------------------------------------------------------------------------------

    def poll(
        self, req: m.HalfCheckPollRequest,
    ) -> m.HalfCheckPollResponse | asyncio.Future[m.HalfCheckPollResponse]:
        """A producer of ``req.group`` waits up to ``wait_ms`` for checks to answer."""
        return self.pollers.poll(req, self.config.max_fetch_wait_ms)

    def tick(self) -> None:
        """Hand out due checks; roll back half messages that ran out of checks."""
        if self.cluster is not None and not self.cluster.leads:
            return
        answered: list[Poller] = []
        for h, out_of_checks in self.book.due(self.clock.monotonic()):
            if out_of_checks:
                self._rollback(h, "max_checks",
                               f"no COMMIT or ROLLBACK after {h.checks} check-backs of producer "
                               f"group {h.group!r} (last: {h.last_answer or 'no answer'})")
                continue
            p = self.pollers.next(h.group)
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
                self.pollers.full(p)
            elif p not in answered:
                answered.append(p)
        for p in answered:
            self.pollers.answer(p)
        if self._ops_due and self.flusher.space_back:
            self._retry_ops()
        self._checkpoint()

    def _check_of(self, h: PendingHalf) -> m.HalfCheck:
        rec = self.halflog.read_half(h.offset)
        half_id = encode_msg_id(self.half.topic_id, 0, h.offset)
        batch = encode_batch([RecordInput(
            rec.body, rec.timestamp, rec.tag, rec.sharding_key, rec.keys,
            encode_properties(committed_properties(rec.properties, half_id)))])
        return (half_id, h.topic, h.queue, bytes(batch), h.checks)

    # -- status ----------------------------------------------------------------------------------

    def is_half(self, msg_id: str) -> bool:
        """Whether ``msg_id`` names a message of the half topic."""
        try:
            tid, _q, _off = decode_msg_id(msg_id)
        except ValueError:
            return False
        return self.halflog.exists and tid == self.half.topic_id

    def status(self, msg_id: str) -> m.MessageStatusResponse:
        """``message status`` of a half id: PREPARED (checks so far, next check),
        COMMITTED (the committed copy) or ROLLED_BACK (why).

        Raises:
            UnknownHalfMessageError: not a half message (or removed by retention).
        """
        off = self._offset_of(msg_id)
        h = self.book.get(off)
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
            raise UnknownHalfMessageError(f"no half message {msg_id}")
        if out.state == COMMITTED:
            detail = f"committed by the {out.source} as message {out.msg_id}"
        else:
            detail = f"rolled back by the {out.source}: {out.reason or '-'}"
        return m.MessageStatusResponse(out.topic, out.queue, out.offset, [
            (out.group, out.state, "", -1, 0, -1, detail, out.at_ms)])

    def _offset_of(self, half_id: str) -> int:
        try:
            tid, q, off = decode_msg_id(half_id)
        except ValueError:
            raise InvalidRequestError(f"not a half id: {half_id[:64]!r}") from None
        if not self.halflog.exists or tid != self.half.topic_id or q != 0:
            raise UnknownHalfMessageError(f"{half_id} is not a half message's id")
        return off

    def _outcome(self, off: int) -> Outcome | None:
        """The outcome of the half message at ``off`` (memory, else the half topic)."""
        out = self.book.outcome(off)
        if out is None:
            out = self.halflog.find_outcome(off)
            if out is not None:
                self.book.remember(off, out)
        return out


def _half_of(off: int, append_ms: int, props: dict[str, str], now: float,
             wall: int) -> PendingHalf | None:
    """The pending half message a half-topic record read at start stands for."""
    try:
        after, interval, max_checks = (int(x) for x in props[HALF_CHECK].split(","))
        h = PendingHalf(off, props[HALF_GROUP], props.get(HALF_CLIENT, ""), props[HALF_TARGET_TOPIC],
                        int(props[HALF_TARGET_QUEUE]), append_ms, after, interval, max_checks, 0.0)
    except (KeyError, ValueError):
        log.warning("half messages: %s@%d is not a half message; ignored", HALF_TOPIC, off)
        return None
    h.next_check = now + max(0, append_ms + after - wall) / 1000
    return h


def _response(out: Outcome, sync: bool) -> m.EndHalfResponse:
    durability = (Durability.FSYNCED if sync else Durability.WRITTEN) if out.msg_id else 0
    return m.EndHalfResponse(out.state, out.msg_id, out.topic, out.queue, out.offset,
                             durability)
