"""The producer's accumulator: per-queue buffers of messages not sent yet, and queue choice.

Theory of operation
-------------------
``send*`` hands each message to :meth:`Accumulator.enqueue` as a :class:`Unit` (the messages of
one call that share a result future). The accumulator chooses its queue (the user's selector, a
stable hash of the sharding key, or a sticky round robin: keyless messages stay on one queue
until ``sticky_queue_bytes`` went to it, like Kafka's uniform sticky partitioner, see
:mod:`ferrymq.client.partitioner`), checks its size and delay against the broker's limits and
appends it to that queue's :class:`QueueBuffer`. A message for a topic the client has no
metadata for yet waits in ``unresolved`` while one task asks for it and for its queues'
leaders; later messages for that topic wait behind it until both came back, so none overtakes
an earlier one.

A buffer is *ready* when it is full (``batch_max_bytes``, ``batch_max_records``), when
``linger_ms`` passed since its first message, at once for a plain ``send`` (which awaits its
result anyway), and at once while a ``flush`` runs (also for messages that waited for their
topic's metadata until then, as Kafka's ``flush`` does); then the shared ``wake`` event tells the sender
(:mod:`ferrymq.client._sender`), which takes whole units out of it with :meth:`Accumulator.drain`.

Scheduled messages (``ATTR_SCHEDULED``) and dedup-keyed messages for a topic with a dedup
window (``ATTR_DEDUP``) travel in batches of their own: a buffer never mixes kinds in one batch,
and a change of kind makes the buffer ready at once, so what was buffered before it ships.

Back-pressure: while more than ``max_buffer_bytes`` wait, :meth:`Accumulator.wait_for_space`
waits until the sender drained some.

A :class:`QueueBuffer` is the one record the producer keeps per queue: the fields above its
``outstanding`` belong to the accumulator, the others (batches in flight, sequence numbers, the
queue's own epoch) to the sender, which alone changes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ferrymq._time import Clock
from ferrymq.client._cluster import Cluster
from ferrymq.client._session import Session, TopicInfo
from ferrymq.client.message import Message
from ferrymq.client.partitioner import QueueSelector, RoundRobin, queue_for_key
from ferrymq.errors import (
    BrokerError,
    ClientError,
    FerryMQError,
    InvalidRequestError,
    MessageTooLargeError,
    UnknownQueueError,
)
from ferrymq.protocol.records import ATTR_DEDUP, ATTR_SCHEDULED, RECORD_PREFIX_SIZE, RecordInput
from ferrymq.protocol.schedule import DEFAULT_MAX_DELAY_MS

if TYPE_CHECKING:
    from ferrymq.client._sender import Batch
    from ferrymq.client._txn_manager import TxnManager

log = logging.getLogger("ferrymq.client")

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""The largest message until the broker's HELLO says its ``max_message_bytes``."""


@dataclass(eq=False, slots=True)
class Unit:
    """Messages of one ``send`` call that share a result future (None: oneway)."""

    count: int
    future: asyncio.Future[Any] | None
    many: bool
    nbytes: int = 0  # bodies plus record prefixes, counted once in add()
    attrs: int = 0  # ATTR_SCHEDULED / ATTR_DEDUP: a batch holds units of one kind only


@dataclass(eq=False)
class QueueBuffer:
    """One queue's messages waiting to be sent, and what the sender tracks for the queue."""

    topic: TopicInfo
    queue: int
    records: list[RecordInput] = field(default_factory=list)
    units: list[Unit] = field(default_factory=list)
    nbytes: int = 0
    ready: bool = False
    first_at: float = 0.0
    timer: asyncio.TimerHandle | None = None
    # -- the sender's (see ferrymq.client._sender) --
    outstanding: list[Batch] = field(default_factory=list)  # sent, or waiting to be resent
    retrying: int = 0  # of those, how many wait in the retry list
    next_seq: int = 0
    epoch: int | None = None  # this queue's own epoch once it needed a new one (not transactional)
    pid: int | None = None  # this queue's own producer id once its epochs ran out
    gap: bool = False  # a sequenced batch was given up: the queue needs a new epoch
    held: list[Batch] = field(default_factory=list)  # refused behind the gap, await the epoch


class Accumulator:
    """Per-queue buffers of the messages ``send*`` handed over, until the sender drains them.

    Args:
        session: the producer's session (topic metadata).
        cluster: the leaders (learnt for a topic before its first batch is sent).
        wake: set when a buffer becomes ready (the sender waits on it).
        linger_s: how long a buffer of ``send_nowait`` messages waits for company.
        batch_max_bytes, batch_max_records: a batch's limits (a buffer this full is ready).
        max_buffer_bytes: ``wait_for_space`` waits while more than this is buffered.
        selector: the user's queue selector, if any.
        sticky_queue_bytes: the sticky round robin's share per queue.
        auto_create: ask the broker to create unknown topics.
        clock: born timestamps (and scheduled messages' due times).
    """

    def __init__(self, session: Session, cluster: Cluster, wake: asyncio.Event, *,
                 linger_s: float, batch_max_bytes: int, batch_max_records: int,
                 max_buffer_bytes: int, selector: QueueSelector | None, sticky_queue_bytes: int,
                 auto_create: bool, clock: Clock) -> None:
        self._session = session
        self._cluster = cluster
        self._wake = wake
        self._linger_s = linger_s
        self.batch_max_bytes = batch_max_bytes
        self._batch_max_records = batch_max_records
        self._max_buffer_bytes = max_buffer_bytes
        self._selector = selector
        self._rr = RoundRobin(sticky_queue_bytes)
        self._auto_create = auto_create
        self._clock = clock
        self.max_message_bytes = DEFAULT_MAX_MESSAGE_BYTES
        self.max_delay_ms = DEFAULT_MAX_DELAY_MS
        self.txn: TxnManager | None = None  # set by a transactional producer
        self.buffers: dict[tuple[str, int], QueueBuffer] = {}
        self.unresolved: dict[str, list[tuple[Message, Unit]]] = {}
        self.buffered_bytes = 0
        self.flushing = 0
        """Flushes in progress: while one runs, a buffer is ready as soon as it holds messages
        (also those that waited for their topic's metadata, see :meth:`mark_ready`)."""
        self.closed = False
        self._space = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()  # metadata look-ups (strong references)

    # -- taking messages in --------------------------------------------------------------------

    async def wait_for_space(self) -> None:
        """Wait while more than ``max_buffer_bytes`` are buffered.

        Raises:
            ClientError: the producer is closed.
        """
        while self.buffered_bytes > self._max_buffer_bytes and not self.closed:
            self._space.clear()
            await self._space.wait()
        if self.closed:
            raise ClientError("producer is closed")

    def enqueue(self, msg: Message, unit: Unit, *, immediate: bool) -> None:
        """Buffer one message (its unit settles with an error it cannot be sent for);
        ``immediate``: its buffer is ready at once."""
        if self.closed:
            settle(unit, exc=ClientError("producer is closed"))
            return
        if self.txn is not None:
            try:
                self.txn.check_send(msg)
            except (ClientError, ValueError) as exc:
                settle(unit, exc=exc)
                return
        info = self._known(msg.topic)
        if info is None:
            pending = self.unresolved.get(msg.topic)
            if pending is None:
                self.unresolved[msg.topic] = [(msg, unit)]
                task = asyncio.get_running_loop().create_task(self._resolve(msg.topic, immediate))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                pending.append((msg, unit))
            return
        try:
            q = self.choose_queue(msg, info)
            now = self._clock.wall_ms()
            rec = msg.to_record(now)
            self.check_size(rec)
            self.check_delay(msg, now)
            unit.attrs = _kind(msg, info, now)
        except (ValueError, TypeError, BrokerError) as exc:
            settle(unit, exc=exc)
            return
        self.add(self.buffer(info, q), [rec], unit, immediate=immediate)

    def enqueue_batch(self, msgs: Sequence[Message]) -> list[tuple[list[int], asyncio.Future[Any]]]:
        """Buffer ``msgs`` (one ``send_batch`` call) in as few units as possible: keyless
        messages share one queue per topic (and count toward its sticky share together),
        the others go to their own queue; scheduled and dedup messages make units of their own.
        Returns each unit's message indexes and result future (a list of results, or one
        result for a message whose topic was not known yet)."""
        loop = asyncio.get_running_loop()
        groups: dict[tuple[str, int, int] | str, list[int]] = {}
        shared: dict[str, int] = {}  # keyless messages of one call share a queue per topic
        shared_bytes: dict[str, int] = {}  # and count toward its sticky share once, together
        now = self._clock.wall_ms()
        for i, msg in enumerate(msgs):
            info = self._known(msg.topic)
            key: tuple[str, int, int] | str
            if info is None:
                key = msg.topic
            else:
                kind = 0 if msg._due is None and msg.dedup_key is None else _kind(msg, info, now)
                if _routing_key(msg, info) is None and self._selector is None:
                    q = shared.get(msg.topic)
                    if q is None:
                        q = shared[msg.topic] = self._rr.pick(info.name, info.queues)
                    shared_bytes[info.name] = shared_bytes.get(info.name, 0) + len(msg.body)
                    key = (msg.topic, q, kind)
                else:
                    key = (msg.topic, self.choose_queue(msg, info), kind)
            groups.setdefault(key, []).append(i)
        for topic, nbytes in shared_bytes.items():
            self._rr.sent(topic, nbytes)
        futs: list[tuple[list[int], asyncio.Future[Any]]] = []
        for key, idxs in groups.items():
            if isinstance(key, str):  # topic not known yet: one by one through metadata
                for i in idxs:
                    f = loop.create_future()
                    self.enqueue(msgs[i], Unit(1, f, False), immediate=True)
                    futs.append(([i], f))
                continue
            f = loop.create_future()
            unit = Unit(len(idxs), f, True, attrs=key[2])
            buf = self.buffer(self._session.topics[key[0]], key[1])
            try:
                recs = [msgs[i].to_record(now) for i in idxs]
                for r in recs:
                    self.check_size(r)
                if key[2] & ATTR_SCHEDULED:
                    for i in idxs:
                        self.check_delay(msgs[i], now)
            except (ValueError, MessageTooLargeError, InvalidRequestError) as exc:
                f.set_exception(exc)
                futs.append((idxs, f))
                continue
            self.add(buf, recs, unit, immediate=True)
            futs.append((idxs, f))
        return futs

    def _known(self, topic: str) -> TopicInfo | None:
        """``topic``'s metadata, or None while a message for it must wait in ``unresolved``:
        none yet, or earlier messages still wait there (for its leaders, once the metadata
        came back), which a later one must not overtake."""
        return None if topic in self.unresolved else self._session.topics.get(topic)

    async def _resolve(self, topic: str, immediate: bool) -> None:
        try:
            await self._session.topic(topic, auto_create=self._auto_create)
            with contextlib.suppress(FerryMQError):  # else its batches wait for a refresh
                await self._cluster.ensure(topic)
        except FerryMQError as exc:
            for _, unit in self.unresolved.pop(topic, []):
                settle(unit, exc=exc)
            self._wake.set()
            return
        for msg, unit in self.unresolved.pop(topic, []):
            self.enqueue(msg, unit, immediate=immediate)
        self._wake.set()

    # -- checks and queue choice ---------------------------------------------------------------

    def check_delay(self, msg: Message, now_ms: int) -> bool:
        """Whether ``msg`` is sent as a scheduled message at ``now_ms``.

        Raises:
            InvalidRequestError: its delay exceeds the broker's ``max_delay_ms``.
        """
        if msg._due is None:
            return False
        delay = msg.scheduled_delay_ms(now_ms)
        if delay is None:
            return False
        if delay > self.max_delay_ms:
            raise InvalidRequestError(
                f"delay of {delay} ms exceeds the broker's max_delay_ms {self.max_delay_ms}")
        return True

    def choose_queue(self, msg: Message, info: TopicInfo) -> int:
        """The queue of ``msg``: the selector's, its sharding key's, or the round robin's.

        Raises:
            UnknownQueueError: the selector chose a queue the topic does not have.
        """
        if self._selector is not None:
            q = int(self._selector(msg, info.queues))
            if not 0 <= q < info.queues:
                raise UnknownQueueError(f"selector chose queue {q} of {info.queues}")
            return q
        key = _routing_key(msg, info)
        if key is not None:
            return queue_for_key(key, info.queues)
        return self._rr(info.name, info.queues, len(msg.body))

    def check_size(self, r: RecordInput) -> None:
        """Raises MessageTooLargeError past the broker's ``max_message_bytes``."""
        size = RECORD_PREFIX_SIZE + len(r.body)
        if r.properties or r.keys or r.sharding_key or r.tag:
            size += len(r.tag) + len(r.sharding_key) + len(r.keys) + len(r.properties)
        if size > self.max_message_bytes:
            raise MessageTooLargeError(
                f"message of {size} bytes exceeds the broker's max_message_bytes "
                f"{self.max_message_bytes}"
            )

    # -- buffers -------------------------------------------------------------------------------

    def buffer(self, info: TopicInfo, queue: int) -> QueueBuffer:
        """The buffer of ``info``'s ``queue`` (made on first use)."""
        key = (info.name, queue)
        b = self.buffers.get(key)
        if b is None:
            b = self.buffers[key] = QueueBuffer(info, queue)
        return b

    def add(self, b: QueueBuffer, recs: list[RecordInput], unit: Unit, *, immediate: bool) -> None:
        """Append ``unit``'s records to ``b``; mark it ready (and wake the sender) when due."""
        # a change of kind (plain, scheduled, dedup) closes the open batch: ship it now
        kind_changed = bool(b.units) and b.units[-1].attrs != unit.attrs
        if not b.records:
            b.first_at = asyncio.get_running_loop().time()
            if not immediate and self._linger_s > 0:
                b.timer = asyncio.get_running_loop().call_later(self._linger_s, self._linger_done, b)
        b.records.extend(recs)
        b.units.append(unit)
        n = unit.nbytes = sum(len(r.body) for r in recs) + RECORD_PREFIX_SIZE * len(recs)
        b.nbytes += n
        self.buffered_bytes += n
        if immediate or kind_changed or self.flushing or self._linger_s == 0 or (
            b.nbytes >= self.batch_max_bytes) or len(b.records) >= self._batch_max_records:
            b.ready = True
            self._wake.set()

    def _linger_done(self, b: QueueBuffer) -> None:
        b.timer = None
        if b.records:
            b.ready = True
            self._wake.set()

    def drain(self, b: QueueBuffer) -> tuple[list[RecordInput], list[Unit], int, int]:
        """Take the next batch's worth out of ``b`` (which holds records): whole units of one
        kind, within both batch limits (a single oversized unit goes alone). Returns its
        records, units, bytes and batch attributes (the units' kind)."""
        units: list[Unit] = []
        n = 0
        nbytes = 0
        attrs = b.units[0].attrs
        for u in b.units:
            if units and (n + u.count > self._batch_max_records
                          or nbytes + u.nbytes > self.batch_max_bytes
                          or u.attrs != attrs):
                break
            units.append(u)
            n += u.count
            nbytes += u.nbytes
        records = b.records[:n]
        del b.records[:n]
        del b.units[: len(units)]
        b.nbytes -= nbytes
        self.buffered_bytes -= nbytes
        self._space.set()
        if not b.records:
            b.ready = False
            if b.timer is not None:
                b.timer.cancel()
                b.timer = None
        return records, units, nbytes, attrs

    def mark_ready(self) -> None:
        """Make every buffer that holds messages ready (a flush, which also raises
        :attr:`flushing` while it waits: messages buffered meanwhile, such as those whose
        topic's metadata arrives then, do not wait out ``linger_ms`` either, as in Kafka)."""
        for b in self.buffers.values():
            if b.records:
                b.ready = True

    def drop_unsent(self, exc: BaseException) -> None:
        """Fail the buffered messages of every queue with nothing in flight (an abort)."""
        for b in self.buffers.values():
            if b.records and not b.outstanding:
                for u in b.units:
                    settle(u, exc=exc)
                self.buffered_bytes -= b.nbytes
                b.records.clear()
                b.units.clear()
                b.nbytes = 0
                b.ready = False

    def fail_buffered(self, exc: BaseException) -> None:
        """Fail every buffered message and every message waiting for its topic (a close)."""
        for b in self.buffers.values():
            for u in b.units:
                settle(u, exc=exc)
            b.records.clear()
            b.units.clear()
        for pending in self.unresolved.values():
            for _, u in pending:
                settle(u, exc=exc)
        self.unresolved.clear()


def _kind(msg: Message, info: TopicInfo, now_ms: int) -> int:
    """The batch attributes ``msg`` needs when sent now (its batch holds its kind only)."""
    attrs = 0
    if msg._due is not None and msg.scheduled_delay_ms(now_ms) is not None:
        attrs |= ATTR_SCHEDULED
    if msg.dedup_key is not None and info.dedup_window_ms:
        attrs |= ATTR_DEDUP
    return attrs


def settle(unit: Unit, *, exc: BaseException) -> None:
    """Fail ``unit``'s future with ``exc`` (a oneway send's failure is logged)."""
    if unit.future is None:
        log.warning("oneway send failed: %s", exc)
    elif not unit.future.done():
        unit.future.set_exception(exc)


def _routing_key(msg: Message, info: TopicInfo) -> str | None:
    """What picks ``msg``'s queue by hash: its sharding key, else its dedup key in a topic with
    a dedup window (so that one key always meets the same queue's window: on a cluster each
    queue's leader holds the keys of its queue), else None (round robin)."""
    if msg.sharding_key is not None:
        return msg.sharding_key
    if msg.dedup_key is not None and info.dedup_window_ms:
        return msg.dedup_key
    return None
