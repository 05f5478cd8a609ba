"""The asyncio producer: batching, queue selection, idempotent retries.

Theory of operation
-------------------
``send*`` puts a message in its queue's buffer (after choosing the queue: the user's selector, a
stable hash of the sharding key, or a sticky round robin: keyless messages stay on one queue
until ``sticky_queue_bytes`` went to it, like Kafka's uniform sticky partitioner). The sender
task turns ready buffers into record batches and ships the ready batches of every queue in
PRODUCE requests of at most ``max_request_bytes``, writing each as soon as it is encoded, so the
broker stores one while the next is encoded. A buffer is ready when it is full, when
``linger_ms`` passed since its first message, or at once for a plain ``send`` (which awaits its
result anyway).

Scheduled messages (``Message(delay=...)``, ``deliver_at=``, ``delay_level=``) travel in batches
of their own (``ATTR_SCHEDULED``): a buffer never mixes them with plain messages, and a change of
kind ships what was buffered before it at once. So do messages with a dedup key sent to a topic
with a dedup window (``ATTR_DEDUP``; a topic without one just stores the key): the broker
acknowledges a record whose key it stored within the window as a duplicate and stores only the
new records of the batch, so such batches carry no producer id or sequence number (the keys make
a retry harmless). ``duplicates`` in the answer map back to the messages by their index.

Idempotence: the broker gives the producer an id; each batch carries the producer id, epoch and
the queue's next sequence number, fixed when the batch is built. A batch that fails with a
retriable error, a timeout or a dropped connection is sent again byte for byte after a backoff,
so the broker stores it once (it answers a duplicate with the first result). Up to
``max_in_flight_per_queue`` batches of a queue are on the wire at once; a retry goes out only
when nothing else of its queue is, lowest sequence first, and a batch refused as out of order
behind a failed one is retried after it, so retries never reorder a queue and messages of one
sharding key keep their send order. Retries stop at ``delivery_timeout_s``; then the messages
fail with the last error.

Giving up on a batch leaves its queue's sequence in doubt (the broker may or may not have
stored it), so the queue starts a new epoch (Kafka's KIP-360): once none of its batches is on
the wire, its next batches, and those refused as out of order behind the failed one, go out
under the producer id with the epoch raised by one, from sequence 0. The broker accepts a higher
epoch at sequence 0 and fences the old one, so a late retry of the old epoch cannot land behind
them. Only non-transactional producers do this: a transactional one aborts and re-initialises.

Transactions (``transactional_id=``, docs/exactly-once.md): ``start()`` sends INIT_TXN, which
fences older producers of the same id. Between ``begin()`` and ``commit()``/``abort()`` every
batch carries ``ATTR_TRANSACTIONAL``; the broker keeps the messages invisible to read_committed
consumers until the commit. ``commit()`` first flushes: if any send of the transaction failed,
it raises and the transaction must be aborted. ``send_offsets()`` adds consumer offsets that
commit with the messages. ``stage()`` ends a Spark sink task's transaction without committing
it (see :meth:`ferrymq.client.admin.AsyncAdminClient.commit_staged`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ferrymq._time import SYSTEM_CLOCK, Clock
from ferrymq.client._session import Auth, Session, TLSOption, TopicInfo
from ferrymq.client._transport import Transport
from ferrymq.client.message import (
    DURABILITY_BY_WIRE,
    Durability,
    Message,
    SendResult,
    SendResults,
)
from ferrymq.client.partitioner import (
    DEFAULT_STICKY_QUEUE_BYTES,
    QueueSelector,
    RoundRobin,
    queue_for_key,
)
from ferrymq.errors import (
    BrokerError,
    ClientError,
    ConfigError,
    ConnectionClosedError,
    FerryMQError,
    FerryMQTimeoutError,
    InvalidRequestError,
    MessageTooLargeError,
    OutOfOrderSequenceError,
    ProducerFencedError,
    TransactionStateError,
    TransactionTimedOutError,
    UnknownQueueError,
    UnknownTopicError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.records import (
    ATTR_DEDUP,
    ATTR_SCHEDULED,
    ATTR_TRANSACTIONAL,
    LARGE_BODY_BYTES,
    MAX_PRODUCER_EPOCH,
    NO_PRODUCER_EPOCH,
    NO_PRODUCER_ID,
    NO_SEQUENCE,
    RECORD_PREFIX_SIZE,
    BatchBuffers,
    RecordInput,
    encode_batch,
    encode_batch_buffers,
    restamp_producer,
)
from ferrymq.protocol.schedule import DEFAULT_MAX_DELAY_MS

log = logging.getLogger("ferrymq.client")

DEFAULT_LINGER_MS = 5
DEFAULT_BATCH_MAX_BYTES = 1024 * 1024
DEFAULT_BATCH_MAX_RECORDS = 16_384
DEFAULT_MAX_BUFFER_BYTES = 64 * 1024 * 1024
"""Bytes of messages waiting in the producer before ``send`` waits (back-pressure)."""
DEFAULT_MAX_REQUEST_BYTES = 1024 * 1024
"""Ready batches go out in PRODUCE requests of at most this many bytes (Kafka's
``max.request.size``); a single larger batch goes alone."""
DEFAULT_MAX_IN_FLIGHT_PER_QUEUE = 4
MAX_IN_FLIGHT_PER_QUEUE = 5
"""The broker remembers this many batches per producer and queue (its PRODUCER_BATCHES_CACHED)
to answer retries of them: more in flight could make a retry look like a gap."""
REQUEST_OVERHEAD_BYTES = 64 * 1024


class StagedHandle(NamedTuple):
    """A staged transaction (a Spark sink task's output), committed by the driver with
    :meth:`ferrymq.client.admin.AsyncAdminClient.commit_staged`. Picklable."""

    transactional_id: str
    producer_id: int
    producer_epoch: int


_READY, _IN_TXN, _FATAL = "ready", "in transaction", "fatal"


@dataclass(eq=False, slots=True)
class _Unit:
    """Messages of one ``send`` call that share a result future (None: oneway)."""

    count: int
    future: asyncio.Future[Any] | None
    many: bool
    nbytes: int = 0  # bodies plus record prefixes, counted once in _add
    attrs: int = 0  # ATTR_SCHEDULED / ATTR_DEDUP: a batch holds units of one kind only


@dataclass(eq=False)
class _QueueBuffer:
    topic: TopicInfo
    queue: int
    records: list[RecordInput] = field(default_factory=list)
    units: list[_Unit] = field(default_factory=list)
    nbytes: int = 0
    ready: bool = False
    first_at: float = 0.0
    outstanding: list[_Batch] = field(default_factory=list)  # sent, or waiting to be resent
    retrying: int = 0  # of those, how many wait in the retry list
    next_seq: int = 0
    timer: asyncio.TimerHandle | None = None
    epoch: int | None = None  # this queue's own epoch once it needed a new one (not transactional)
    pid: int | None = None  # this queue's own producer id once its epochs ran out
    gap: bool = False  # a sequenced batch was given up: the queue needs a new epoch
    held: list[_Batch] = field(default_factory=list)  # refused behind the gap, await the epoch


@dataclass(eq=False)
class _Batch:
    buf: _QueueBuffer
    data: bytearray | BatchBuffers
    units: list[_Unit]
    count: int
    deadline: float
    seq: int = NO_SEQUENCE
    attempts: int = 0
    last_error: BaseException | None = None
    not_before: float = 0.0


@dataclass(eq=False, slots=True)
class _Request:
    """The PRODUCE request the sender is filling."""

    batches: list[_Batch] = field(default_factory=list)
    nbytes: int = 0

    def take(self) -> list[_Batch]:
        """Its batches; it starts empty again."""
        out, self.batches, self.nbytes = self.batches, [], 0
        return out


class AsyncProducer:
    """Sends messages to a FerryMQ broker (asyncio).

    Args:
        servers: ``"host:port"`` (or several, comma separated).
        client_id: shown in the broker's logs and group listings.
        linger_ms: how long ``send_async``/``send_oneway`` messages wait for company.
        batch_max_bytes: close a batch at this size.
        batch_max_records: close a batch at this many messages.
        max_buffer_bytes: ``send`` waits while this much is buffered (back-pressure).
        delivery_timeout_s: give up on a message after this long (retries included).
        request_timeout_s: one request's deadline.
        connect_timeout_s: how long the first connection may take (every address tried; the
            constructor of the blocking ``Producer`` fails after it with
            ``ConnectionClosedError("cannot connect to HOST:PORT (connection refused) ...")``),
            and the longest single connection attempt later.
        reconnect_timeout_s: after a connection was lost, how long to keep trying to reconnect
            before the waiting request fails (None: ``delivery_timeout_s``; messages are retried
            until their own delivery timeout either way). One warning is logged per outage.
        idempotent: stamp producer id and sequence numbers so retries are stored once.
        max_request_bytes: ready batches go out in requests of at most this many bytes (a
            larger batch goes alone), each written as soon as it is encoded, so the broker
            stores the first while the next is encoded (Kafka's ``max.request.size``). Capped
            by the broker's ``max_frame_bytes``.
        max_in_flight_per_queue: batches of one queue sent before the first is answered
            (idempotent producers; others send one at a time so a retry cannot reorder).
            Retries go one at a time, in sequence order.
        queue_selector: ``selector(message, queue_count) -> queue`` overriding the default.
        sticky_queue_bytes: messages without a sharding key (and no selector) stay on one queue
            until this many body bytes went to it, then move to the next (Kafka's uniform sticky
            partitioner): fuller batches, and fewer queues to flush per message. 0: round
            robin per message (per call for ``send_batch``). Each topic starts at a random
            queue.
        auto_create_topics: ask the broker to create unknown topics.
        clock: injected clock (born timestamps).
        transactional_id: makes this a transactional producer (exactly-once); one live
            producer per id: starting a new one fences the old.
        txn_timeout_s: the broker aborts a transaction open longer than this (None: the
            broker's ``txn_default_timeout_ms``).
    """

    def __init__(
        self,
        servers: str | list[str] = "127.0.0.1:9876",
        *,
        client_id: str = "ferrymq-producer",
        linger_ms: float = DEFAULT_LINGER_MS,
        batch_max_bytes: int = DEFAULT_BATCH_MAX_BYTES,
        batch_max_records: int = DEFAULT_BATCH_MAX_RECORDS,
        max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
        delivery_timeout_s: float = 120.0,
        request_timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        reconnect_timeout_s: float | None = None,
        idempotent: bool = True,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_in_flight_per_queue: int = DEFAULT_MAX_IN_FLIGHT_PER_QUEUE,
        queue_selector: QueueSelector | None = None,
        sticky_queue_bytes: int = DEFAULT_STICKY_QUEUE_BYTES,
        auto_create_topics: bool = True,
        clock: Clock = SYSTEM_CLOCK,
        transactional_id: str | None = None,
        txn_timeout_s: float | None = None,
        auth: Auth | None = None,
        tls: TLSOption = None,
    ) -> None:
        if transactional_id is not None and not transactional_id:
            raise ConfigError("transactional_id must not be empty")
        if txn_timeout_s is not None and txn_timeout_s <= 0:
            raise ConfigError("txn_timeout_s must be > 0")
        if linger_ms < 0 or batch_max_bytes <= 0 or batch_max_records <= 0:
            raise ConfigError("linger_ms must be >= 0; batch limits must be > 0")
        if max_request_bytes <= 0:
            raise ConfigError("max_request_bytes must be > 0")
        if delivery_timeout_s <= 0 or request_timeout_s <= 0:
            raise ConfigError("timeouts must be > 0")
        if sticky_queue_bytes < 0:
            raise ConfigError("sticky_queue_bytes must be >= 0")
        if not 1 <= max_in_flight_per_queue <= MAX_IN_FLIGHT_PER_QUEUE:
            raise ConfigError(f"max_in_flight_per_queue must be 1..{MAX_IN_FLIGHT_PER_QUEUE}")
        self._session = Session(servers, client_id=client_id, request_timeout_s=request_timeout_s,
                                connect_timeout_s=connect_timeout_s,
                                reconnect_timeout_s=(delivery_timeout_s if reconnect_timeout_s
                                                     is None else reconnect_timeout_s),
                                auth=auth, tls=tls)
        self._linger_s = linger_ms / 1000
        self._batch_max_bytes = batch_max_bytes
        self._batch_max_records = batch_max_records
        self._max_buffer_bytes = max_buffer_bytes
        self._delivery_timeout_s = delivery_timeout_s
        self._request_timeout_s = request_timeout_s
        self._idempotent = idempotent or transactional_id is not None
        self._max_in_flight = max_in_flight_per_queue if self._idempotent else 1
        self._tid = transactional_id
        self._txn_timeout_ms = 0 if txn_timeout_s is None else int(txn_timeout_s * 1000)
        self._txn_state = _READY
        self._txn_error: BaseException | None = None
        self._txn_reinit = False  # the broker aborted on timeout, or a send failed: new epoch
        self._selector = queue_selector
        self._auto_create = auto_create_topics
        self._clock = clock
        self._rr = RoundRobin(sticky_queue_bytes)
        self._buffers: dict[tuple[str, int], _QueueBuffer] = {}
        self._unresolved: dict[str, list[tuple[Message, _Unit]]] = {}
        self._retry: list[_Batch] = []
        self._buffered_bytes = 0
        self._space = asyncio.Event()
        self._wake = asyncio.Event()
        self._in_flight_requests = 0
        self._idle = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # requests in flight (strong references)
        self._closed = False
        self.producer_id = NO_PRODUCER_ID
        self.producer_epoch = NO_PRODUCER_EPOCH
        self._max_message_bytes = 4 * 1024 * 1024
        self._request_bytes = max_request_bytes
        self._max_request_bytes = min(max_request_bytes, 8 * 1024 * 1024 - REQUEST_OVERHEAD_BYTES)
        self._max_delay_ms = DEFAULT_MAX_DELAY_MS

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> AsyncProducer:
        """Connect, learn the broker's limits and get a producer id."""
        await self._session.connection()
        hello = self._session.hello
        if hello is not None:
            self._max_message_bytes = hello.max_message_bytes
            self._max_delay_ms = hello.max_delay_ms or DEFAULT_MAX_DELAY_MS
            frame_room = hello.max_frame_bytes - REQUEST_OVERHEAD_BYTES
            self._max_request_bytes = min(self._request_bytes, frame_room)
            self._batch_max_bytes = min(self._batch_max_bytes, frame_room)
        if self._tid is not None:
            await self._init_txn(-1, -1)
        elif self._idempotent:
            resp = await self._session.request(m.InitProducerRequest(None), m.InitProducerResponse)
            self.producer_id, self.producer_epoch = resp.producer_id, resp.producer_epoch
        self._sender = asyncio.get_running_loop().create_task(self._send_loop())
        return self

    # -- transactions --------------------------------------------------------------------------

    async def _init_txn(self, expected_pid: int, expected_epoch: int) -> None:
        assert self._tid is not None
        resp = await self._session.request(
            m.InitTxnRequest(self._tid, self._txn_timeout_ms, expected_pid, expected_epoch),
            m.InitTxnResponse)
        self.producer_id, self.producer_epoch = resp.producer_id, resp.producer_epoch
        for b in self._buffers.values():  # a new epoch starts every queue at sequence 0
            b.next_seq = 0
        self._txn_reinit = False

    def _need_txn(self, what: str) -> None:
        if self._tid is None:
            raise TransactionStateError(f"{what} needs a transactional producer "
                                        "(transactional_id=...)")
        if self._txn_state == _FATAL:
            raise TransactionStateError(f"{what}: this producer was fenced; create a new one")

    async def begin(self) -> None:
        """Begin a transaction: sends from now on commit or abort together.

        Raises:
            TransactionStateError: not transactional, already in a transaction, or fenced.
            ProducerFencedError: the broker aborted the last transaction on timeout and another
                producer took the transactional id since.
        """
        self._need_txn("begin()")
        if self._txn_state == _IN_TXN:
            raise TransactionStateError("a transaction is already open: commit() or abort()")
        if self._txn_reinit:
            await self._fenced_guard(self._init_txn(self.producer_id, self.producer_epoch))
        self._txn_state = _IN_TXN
        self._txn_error = None

    async def send_offsets(self, group: str, offsets: dict[tuple[str, int], int], *,
                           consumer: Any = None) -> None:
        """Commit a consumer group's offsets with this transaction (``offsets``: the next
        offset to consume per (topic, queue), as ``consumer.position()`` gives). With
        ``consumer=`` (a group member), the broker also checks it still owns those queues.

        Raises:
            TransactionStateError: no transaction open.
            IllegalGenerationError / UnknownMemberError: the consumer lost its queues.
        """
        self._need_txn("send_offsets()")
        if self._txn_state != _IN_TXN:
            raise TransactionStateError("send_offsets() outside a transaction: begin() first")
        member, generation = "", -1
        if consumer is not None:
            inner = getattr(consumer, "_async", consumer)
            member, generation = inner._member_id, inner._generation
        req = m.TxnOffsetCommitRequest(
            self._tid or "", self.producer_id, self.producer_epoch, group, member, generation,
            sorted((t, q, o) for (t, q), o in offsets.items()))
        resp = await self._fenced_guard(self._session.request(req, m.CommitOffsetsResponse))
        for t, q, code in resp.results:
            if code:
                raise error_for_code(code, f"offset of {t}/{q} for group {group!r}")

    async def commit(self) -> None:
        """Flush and commit the transaction: its messages (and offsets) become visible
        together. Returns once the commit is durable.

        Raises:
            TransactionStateError: no transaction open.
            BrokerError subclass: a send of the transaction failed (the transaction is still
                open: ``abort()`` it), or the commit was refused.
            TransactionTimedOutError: the broker aborted it on timeout: ``abort()``, begin
                again.
            ProducerFencedError: a newer producer took the transactional id (fatal).
        """
        await self._flush_txn("commit()")
        await self._end(m.EndTxnAction.COMMIT)
        self._txn_state = _READY

    async def abort(self) -> None:
        """Abort the transaction: none of its messages or offsets become visible. Messages not
        yet sent are dropped (their sends fail); sends in flight are waited for."""
        self._need_txn("abort()")
        if self._txn_state != _IN_TXN:
            raise TransactionStateError("abort() with no transaction open")
        for b in self._buffers.values():
            if b.records and not b.outstanding:
                for u in b.units:
                    _settle(u, exc=TransactionStateError("the transaction was aborted"))
                self._buffered_bytes -= b.nbytes
                b.records.clear()
                b.units.clear()
                b.nbytes = 0
                b.ready = False
        with contextlib.suppress(FerryMQError):
            await self.flush()
        if self._txn_error is not None:
            self._txn_reinit = True  # sequences may be out of step: start a new epoch
        try:
            await self._end(m.EndTxnAction.ABORT)
        except TransactionTimedOutError:
            self._txn_reinit = True  # already aborted by the broker
        self._txn_state = _READY

    async def stage(self, sink_id: str, batch_id: int, *,
                    ttl_s: float | None = None) -> StagedHandle:
        """Flush and *stage* the transaction (a Spark sink task): it stays invisible until one
        ``commit_staged(sink_id, batch_id, handles)`` commits all of the batch's staged
        transactions at once; it is aborted after ``ttl_s`` (None: the broker's
        ``txn_staged_ttl_ms``) if nobody does.

        Raises:
            as :meth:`commit`.
        """
        await self._flush_txn("stage()")
        ttl_ms = 0 if ttl_s is None else max(1, int(ttl_s * 1000))
        await self._end(m.EndTxnAction.STAGE, sink_id, batch_id, ttl_ms)
        self._txn_state = _READY
        return StagedHandle(self._tid or "", self.producer_id, self.producer_epoch)

    async def _flush_txn(self, what: str) -> None:
        """Before commit/stage: the transaction is open, every send of it is answered, and
        none failed (else that error is raised: the transaction must be aborted)."""
        self._need_txn(what)
        if self._txn_state != _IN_TXN:
            raise TransactionStateError(f"{what} with no transaction open: begin() first")
        await self.flush()
        if self._txn_error is not None:
            raise self._txn_error

    async def _end(self, action: m.EndTxnAction, sink_id: str = "", batch_id: int = -1,
                   ttl_ms: int = 0) -> None:
        req = m.EndTxnRequest(self._tid or "", self.producer_id, self.producer_epoch,
                              int(action), sink_id, batch_id, ttl_ms)
        await self._fenced_guard(self._session.request(req, m.EndTxnResponse))

    async def _fenced_guard(self, coro: Any) -> Any:
        try:
            return await coro
        except ProducerFencedError:
            self._txn_state = _FATAL
            raise
        except TransactionTimedOutError:
            self._txn_reinit = True
            raise

    def _txn_check(self, msg: Message) -> None:
        """Raises unless ``msg`` may be sent now (transactional producers only)."""
        if self._txn_state != _IN_TXN:
            if self._txn_state == _FATAL:
                raise TransactionStateError("this producer was fenced; create a new one")
            raise TransactionStateError("a transactional producer sends only between begin() "
                                        "and commit()/abort()")
        if msg.dedup_key is not None:
            raise ValueError("dedup keys cannot be used inside a transaction (the transaction "
                             "itself makes the send exactly-once)")
        if msg._due is not None:
            raise ValueError("delayed messages cannot be sent inside a transaction yet")

    async def __aenter__(self) -> AsyncProducer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def flush(self) -> None:
        """Send everything buffered now and wait until all of it is answered."""
        for b in self._buffers.values():
            if b.records:
                b.ready = True
        self._wake.set()
        while self._pending_work():
            self._idle.clear()
            self._wake.set()
            await self._idle.wait()

    def _pending_work(self) -> bool:
        return bool(
            self._in_flight_requests or self._retry or self._unresolved
            or any(b.records or b.outstanding for b in self._buffers.values())
        )

    async def close(self) -> None:
        """Flush, then close the connection."""
        if self._closed:
            return
        with contextlib.suppress(FerryMQError):
            await asyncio.wait_for(self.flush(), self._delivery_timeout_s)
        self._closed = True
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
        self._fail_everything(ClientError("producer closed"))
        await self._session.close()

    # -- sending -------------------------------------------------------------------------------

    async def send(self, msg: Message) -> SendResult:
        """Send one message and wait until the broker stored it.

        A message with a dedup key that its topic stored within its dedup window is not stored
        again: the result has ``duplicate=True`` and names the stored message.

        Raises:
            BrokerError subclass: refused (too large, unknown topic, fenced, ...).
            FerryMQTimeoutError: not stored within ``delivery_timeout_s``.
        """
        await self._wait_for_space()
        fut: asyncio.Future[SendResult] = asyncio.get_running_loop().create_future()
        self._enqueue(msg, _Unit(1, fut, False), immediate=True)
        return await fut

    def send_nowait(self, msg: Message, *, oneway: bool = False) -> asyncio.Future[SendResult] | None:
        """Buffer one message (sent after ``linger_ms``); returns its result future (None when
        ``oneway``). Must be called on the producer's event loop."""
        fut: asyncio.Future[SendResult] | None = (
            None if oneway else asyncio.get_running_loop().create_future()
        )
        self._enqueue(msg, _Unit(1, fut, False), immediate=False)
        return fut

    async def send_oneway(self, msg: Message) -> None:
        """Send without waiting for (or learning) the result."""
        await self._wait_for_space()
        self.send_nowait(msg, oneway=True)

    async def send_batch(self, msgs: Sequence[Message]) -> Sequence[SendResult]:
        """Send many messages in as few batches as possible; results in input order.

        Messages without a sharding key go to one queue per call (the sticky round robin's
        current queue, see ``sticky_queue_bytes``), like a RocketMQ batch, so a call becomes one
        record batch; messages with a sharding key (or with a ``queue_selector``) go to their own
        queue. Scheduled messages and messages with a dedup key (for a topic with a dedup
        window) make batches of their own. A duplicate's result has ``duplicate=True`` and
        names the stored message.
        """
        if not msgs:
            return []
        if self._tid is not None:
            for msg in msgs:
                self._txn_check(msg)
        await self._wait_for_space()
        loop = asyncio.get_running_loop()
        groups: dict[tuple[str, int, int] | str, list[int]] = {}
        shared: dict[str, int] = {}  # keyless messages of one call share a queue per topic
        shared_bytes: dict[str, int] = {}  # and count toward its sticky share once, together
        now = self._clock.wall_ms()
        for i, msg in enumerate(msgs):
            info = self._session.topics.get(msg.topic)
            key: tuple[str, int, int] | str
            if info is None:
                key = msg.topic
            else:
                kind = 0 if msg._due is None and msg.dedup_key is None else _kind(msg, info, now)
                if msg.sharding_key is None and self._selector is None:
                    q = shared.get(msg.topic)
                    if q is None:
                        q = shared[msg.topic] = self._rr.pick(info.name, info.queues)
                    shared_bytes[info.name] = shared_bytes.get(info.name, 0) + len(msg.body)
                    key = (msg.topic, q, kind)
                else:
                    key = (msg.topic, self._choose_queue(msg, info), kind)
            groups.setdefault(key, []).append(i)
        for topic, nbytes in shared_bytes.items():
            self._rr.sent(topic, nbytes)
        results: list[SendResult | None] = [None] * len(msgs)
        futs: list[tuple[list[int], asyncio.Future[Any]]] = []
        for key, idxs in groups.items():
            if isinstance(key, str):  # topic not known yet: one by one through metadata
                for i in idxs:
                    f = loop.create_future()
                    self._enqueue(msgs[i], _Unit(1, f, False), immediate=True)
                    futs.append(([i], f))
                continue
            f = loop.create_future()
            unit = _Unit(len(idxs), f, True, attrs=key[2])
            buf = self._buffer(self._session.topics[key[0]], key[1])
            try:
                recs = [msgs[i].to_record(now) for i in idxs]
                for r in recs:
                    self._check_size(r)
                if key[2] & ATTR_SCHEDULED:
                    for i in idxs:
                        self._check_delay(msgs[i], now)
            except (ValueError, MessageTooLargeError, InvalidRequestError) as exc:
                f.set_exception(exc)
                futs.append((idxs, f))
                continue
            self._add(buf, recs, unit, immediate=True)
            futs.append((idxs, f))
        if len(futs) == 1 and len(futs[0][0]) == len(msgs):
            res = await futs[0][1]  # one run of one queue: results are made on access
            return [res] if isinstance(res, SendResult) else res
        for idxs, f in futs:
            res = await f
            if isinstance(res, SendResult):
                results[idxs[0]] = res
            else:
                for i, one in zip(idxs, res, strict=True):
                    results[i] = one
        return [r for r in results if r is not None]

    async def cancel(self, msg_id: str) -> None:
        """Cancel a scheduled message that is not yet due: it is never delivered.

        Args:
            msg_id: the id its send returned.

        Raises:
            NotScheduledError: not a pending scheduled message (already delivered, already
                cancelled, or not scheduled).
            InvalidRequestError: not a message id.
        """
        await self._session.request(m.CancelScheduledRequest(msg_id), m.Empty,
                                    retry_codes=frozenset())

    def _check_delay(self, msg: Message, now_ms: int) -> bool:
        """Whether ``msg`` is sent as a scheduled message at ``now_ms``.

        Raises:
            InvalidRequestError: its delay exceeds the broker's ``max_delay_ms``.
        """
        if msg._due is None:
            return False
        delay = msg.scheduled_delay_ms(now_ms)
        if delay is None:
            return False
        if delay > self._max_delay_ms:
            raise InvalidRequestError(
                f"delay of {delay} ms exceeds the broker's max_delay_ms {self._max_delay_ms}")
        return True

    async def _wait_for_space(self) -> None:
        while self._buffered_bytes > self._max_buffer_bytes and not self._closed:
            self._space.clear()
            await self._space.wait()
        if self._closed:
            raise ClientError("producer is closed")

    def _choose_queue(self, msg: Message, info: TopicInfo) -> int:
        if self._selector is not None:
            q = int(self._selector(msg, info.queues))
            if not 0 <= q < info.queues:
                raise UnknownQueueError(f"selector chose queue {q} of {info.queues}")
            return q
        if msg.sharding_key is not None:
            return queue_for_key(msg.sharding_key, info.queues)
        return self._rr(info.name, info.queues, len(msg.body))

    def _check_size(self, r: RecordInput) -> None:
        size = RECORD_PREFIX_SIZE + len(r.body)
        if r.properties or r.keys or r.sharding_key or r.tag:
            size += len(r.tag) + len(r.sharding_key) + len(r.keys) + len(r.properties)
        if size > self._max_message_bytes:
            raise MessageTooLargeError(
                f"message of {size} bytes exceeds the broker's max_message_bytes "
                f"{self._max_message_bytes}"
            )

    def _enqueue(self, msg: Message, unit: _Unit, *, immediate: bool) -> None:
        if self._closed:
            _settle(unit, exc=ClientError("producer is closed"))
            return
        if self._tid is not None:
            try:
                self._txn_check(msg)
            except (ClientError, ValueError) as exc:
                _settle(unit, exc=exc)
                return
        info = self._session.topics.get(msg.topic)
        if info is None:
            pending = self._unresolved.get(msg.topic)
            if pending is None:
                self._unresolved[msg.topic] = [(msg, unit)]
                task = asyncio.get_running_loop().create_task(self._resolve(msg.topic, immediate))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                pending.append((msg, unit))
            return
        try:
            q = self._choose_queue(msg, info)
            now = self._clock.wall_ms()
            rec = msg.to_record(now)
            self._check_size(rec)
            self._check_delay(msg, now)
            unit.attrs = _kind(msg, info, now)
        except (ValueError, TypeError, BrokerError) as exc:
            _settle(unit, exc=exc)
            return
        self._add(self._buffer(info, q), [rec], unit, immediate=immediate)

    async def _resolve(self, topic: str, immediate: bool) -> None:
        try:
            await self._session.topic(topic, auto_create=self._auto_create)
        except FerryMQError as exc:
            for _, unit in self._unresolved.pop(topic, []):
                _settle(unit, exc=exc)
            self._wake.set()
            return
        for msg, unit in self._unresolved.pop(topic, []):
            self._enqueue(msg, unit, immediate=immediate)
        self._wake.set()

    def _buffer(self, info: TopicInfo, queue: int) -> _QueueBuffer:
        key = (info.name, queue)
        b = self._buffers.get(key)
        if b is None:
            b = self._buffers[key] = _QueueBuffer(info, queue)
        return b

    def _add(self, b: _QueueBuffer, recs: list[RecordInput], unit: _Unit, *, immediate: bool) -> None:
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
        self._buffered_bytes += n
        if immediate or kind_changed or self._linger_s == 0 or (
            b.nbytes >= self._batch_max_bytes) or len(b.records) >= self._batch_max_records:
            b.ready = True
            self._wake.set()

    def _linger_done(self, b: _QueueBuffer) -> None:
        b.timer = None
        if b.records:
            b.ready = True
            self._wake.set()

    # -- the sender ----------------------------------------------------------------------------

    async def _send_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            now = loop.time()
            req = _Request()
            for bt in self._due_retries(now):
                self._add_to_request(req, bt)
            for b in self._buffers.values():
                if b.ready and b.records and not b.retrying and not b.gap and len(b.outstanding) < (
                        1 if b.units[0].attrs & ATTR_DEDUP else self._max_in_flight):
                    self._add_to_request(req, self._close_batch(b, now))
            if req.batches:
                self._ship(req.take())
            if not self._pending_work():
                self._idle.set()

    def _due_retries(self, now: float) -> list[_Batch]:
        """Retries to send now: per queue the one with the lowest sequence, once its wait is
        over and nothing else of its queue is on the wire (so they are stored in order)."""
        out: list[_Batch] = []
        if not self._retry:
            return out
        keep: list[_Batch] = []
        taken: set[int] = set()
        for rb in sorted(self._retry, key=lambda x: x.seq):
            b = rb.buf
            if (rb.not_before <= now and id(b) not in taken
                    and len(b.outstanding) == b.retrying + len(b.held)):
                taken.add(id(b))
                b.retrying -= 1
                out.append(rb)
            else:
                taken.add(id(b))  # a later retry of this queue waits for this one
                keep.append(rb)
        self._retry = keep
        return out

    def _close_batch(self, b: _QueueBuffer, now: float) -> _Batch:
        # whole units only, within both batch limits (a single oversized unit goes alone)
        units: list[_Unit] = []
        n = 0
        nbytes = 0
        attrs = b.units[0].attrs
        for u in b.units:
            if units and (n + u.count > self._batch_max_records
                          or nbytes + u.nbytes > self._batch_max_bytes
                          or u.attrs != attrs):
                break
            units.append(u)
            n += u.count
            nbytes += u.nbytes
        records = b.records[:n]
        del b.records[:n]
        del b.units[: len(units)]
        b.nbytes -= nbytes
        self._buffered_bytes -= nbytes
        self._space.set()
        seq = NO_SEQUENCE
        data: bytearray | BatchBuffers
        if attrs & ATTR_DEDUP:  # the broker may store fewer records: no sequence numbers
            data = encode_batch(records, attributes=attrs)
        else:
            if self._idempotent:
                seq = b.next_seq
                b.next_seq += len(records)
            if self._tid is not None:
                attrs |= ATTR_TRANSACTIONAL
            # large bodies are not copied into the batch: they go to the socket as they are
            encode = (encode_batch_buffers if nbytes >= len(records) * LARGE_BODY_BYTES
                      else encode_batch)
            data = encode(records, producer_id=self.producer_id if b.pid is None else b.pid,
                          producer_epoch=self.producer_epoch if b.epoch is None else b.epoch,
                          base_sequence=seq, attributes=attrs)
        if not b.records:
            b.ready = False
            if b.timer is not None:
                b.timer.cancel()
                b.timer = None
        bt = _Batch(b, data, units, len(records), now + self._delivery_timeout_s, seq)
        b.outstanding.append(bt)
        return bt

    def _add_to_request(self, req: _Request, bt: _Batch) -> None:
        """Add ``bt`` to the request being filled; ship the request once it is full (a batch
        that does not fit ships the request before it)."""
        n = len(bt.data)
        if req.batches and req.nbytes + n > self._max_request_bytes:
            self._ship(req.take())
        req.batches.append(bt)
        req.nbytes += n
        if req.nbytes >= self._max_request_bytes:
            self._ship(req.take())

    def _ship(self, batches: list[_Batch]) -> None:
        """Write a PRODUCE request of ``batches`` now if the connection is open (so the broker
        works on it while the next is encoded); a task awaits the answer (or connects)."""
        req = m.ProduceRequest(
            int(self._request_timeout_s * 1000),
            [(bt.buf.topic.name, bt.buf.queue, bt.data) for bt in batches],
        )
        sent: tuple[Transport, asyncio.Future[bytes | memoryview]] | None = None
        conn = self._session.open_connection
        if conn is not None:
            with contextlib.suppress(ConnectionClosedError):  # the task reconnects
                sent = (conn, conn.send(req))
        self._in_flight_requests += 1
        task = asyncio.get_running_loop().create_task(self._send_request(batches, req, sent))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_request(
        self, batches: list[_Batch], req: m.ProduceRequest,
        sent: tuple[Transport, asyncio.Future[bytes | memoryview]] | None,
    ) -> None:
        try:
            try:
                if sent is None:  # not written yet: (re)connect first
                    conn = await self._session.connection()
                    sent = (conn, conn.send(req))
                conn, fut = sent
                resp = await conn.response(fut, req, m.ProduceResponse, self._request_timeout_s)
            except (ConnectionClosedError, FerryMQTimeoutError) as exc:
                for bt in batches:
                    self._retry_or_fail(bt, exc)
                return
            except BrokerError as exc:
                for bt in batches:
                    self._retry_or_fail(bt, exc)
                return
            for bt, res in zip(batches, resp.results, strict=False):
                _t, _q, code, msg, base, _last, _ts, durability, topic_id, dups = res
                if code:
                    self._retry_or_fail(bt, error_for_code(code, msg))
                    continue
                self._complete(bt, base, DURABILITY_BY_WIRE.get(durability, Durability.NONE),
                               topic_id, dups)
        finally:
            self._in_flight_requests -= 1
            self._wake.set()

    def _complete(self, bt: _Batch, base: int, durability: Durability, topic_id: int,
                  dups: list[m.Duplicate]) -> None:
        bt.buf.outstanding.remove(bt)
        if bt.buf.gap:
            self._new_epoch_if_settled(bt.buf)
        topic, queue = bt.buf.topic.name, bt.buf.queue
        if dups:
            _complete_with_duplicates(bt, base, durability, topic_id, dups)
            return
        off = base
        for u in bt.units:
            if u.future is not None and not u.future.done():
                if u.many:
                    u.future.set_result(SendResults(topic, queue, off, u.count, durability,
                                                    topic_id))
                else:
                    u.future.set_result(SendResult(topic, queue, off, durability, topic_id))
            off += u.count

    def _retry_or_fail(self, bt: _Batch, exc: BaseException) -> None:
        loop = asyncio.get_running_loop()
        retriable = isinstance(exc, (ConnectionClosedError, FerryMQTimeoutError)) or (
            isinstance(exc, BrokerError) and exc.retriable
        ) or (isinstance(exc, OutOfOrderSequenceError)
              and any(o.seq < bt.seq for o in bt.buf.outstanding))  # an earlier one failed

        if isinstance(exc, UnknownTopicError):
            self._session.topics.pop(bt.buf.topic.name, None)
        bt.attempts += 1
        bt.last_error = exc
        b = bt.buf
        if (isinstance(exc, OutOfOrderSequenceError) and not retriable and self._tid is None
                and bt.seq != NO_SEQUENCE and not self._closed and loop.time() < bt.deadline):
            # a gap before it (an earlier batch given up, or the broker lost our state): it
            # goes again under the queue's next epoch
            b.gap = True
            b.held.append(bt)
            self._new_epoch_if_settled(b)
            return
        delay = self._session.backoff.delay_after(exc, bt.attempts)  # >= the broker's retry-after
        if retriable and not self._closed and loop.time() + delay < bt.deadline:
            bt.not_before = loop.time() + delay
            bt.buf.retrying += 1
            self._retry.append(bt)
            loop.call_later(delay, self._wake.set)
            return
        b.outstanding.remove(bt)
        if bt.seq != NO_SEQUENCE and self._tid is None:
            b.gap = True  # stored or not, nobody knows: the queue's sequence is in doubt
            self._new_epoch_if_settled(b)
        if retriable:
            what = (f"{exc.code.name}: " if isinstance(exc, BrokerError) else "")
            exc = FerryMQTimeoutError(
                f"not delivered within delivery_timeout_s={self._delivery_timeout_s:g} "
                f"({bt.attempts} attempts); last error: {what}{exc}")
        if self._tid is not None and self._txn_error is None:
            self._txn_error = exc  # the transaction cannot commit now
            if isinstance(exc, ProducerFencedError):
                self._txn_state = _FATAL
        for u in bt.units:
            _settle(u, exc=exc)

    def _new_epoch_if_settled(self, b: _QueueBuffer) -> None:
        """Start queue ``b`` on a new epoch once none of its batches is on the wire or waits
        for a retry (so no old-epoch batch can follow): the held batches, in their order, get
        sequences from 0 and are retried at once; the buffer's batches follow them."""
        if len(b.outstanding) != len(b.held) or b.pid == NO_PRODUCER_ID:
            return
        epoch = (self.producer_epoch if b.epoch is None else b.epoch) + 1
        if epoch > MAX_PRODUCER_EPOCH:  # 32,767 give-ups on one queue: a new producer id
            b.pid = NO_PRODUCER_ID  # asking (the buffer waits: gap stays set)
            task = asyncio.get_running_loop().create_task(self._new_producer_id(b))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._restart_queue(b, self.producer_id if b.pid is None else b.pid, epoch)

    async def _new_producer_id(self, b: _QueueBuffer) -> None:
        attempt = 0
        while not self._closed:
            try:
                resp = await self._session.request(m.InitProducerRequest(None),
                                                   m.InitProducerResponse)
            except FerryMQError as exc:
                attempt += 1
                await asyncio.sleep(self._session.backoff.delay_after(exc, attempt))
                continue
            self._restart_queue(b, resp.producer_id, resp.producer_epoch)
            return

    def _restart_queue(self, b: _QueueBuffer, pid: int, epoch: int) -> None:
        held = sorted(b.held, key=lambda x: x.seq)
        log.info("%s/%d: a batch was given up or refused out of order; producer %d goes on "
                 "at epoch %d from sequence 0 (%d batches re-sent)", b.topic.name, b.queue,
                 pid, epoch, len(held))
        b.held.clear()
        b.gap = False
        b.pid = None if pid == self.producer_id else pid
        b.epoch = epoch
        b.next_seq = 0
        now = asyncio.get_running_loop().time()
        for bt in held:
            restamp_producer(bt.data, pid, epoch, b.next_seq)
            bt.seq = b.next_seq
            b.next_seq += bt.count
            bt.not_before = now
            b.retrying += 1
            self._retry.append(bt)
        self._wake.set()

    def _fail_everything(self, exc: BaseException) -> None:
        for b in self._buffers.values():
            for u in b.units:
                _settle(u, exc=exc)
            b.records.clear()
            b.units.clear()
        for bt in self._retry:
            for u in bt.units:
                _settle(u, exc=exc)
            if bt in bt.buf.outstanding:
                bt.buf.outstanding.remove(bt)
        self._retry.clear()
        for b in self._buffers.values():
            b.retrying = 0
            for bt in b.held:
                for u in bt.units:
                    _settle(u, exc=exc)
                b.outstanding.remove(bt)
            b.held.clear()
        for pending in self._unresolved.values():
            for _, u in pending:
                _settle(u, exc=exc)
        self._unresolved.clear()


def _kind(msg: Message, info: TopicInfo, now_ms: int) -> int:
    """The batch attributes ``msg`` needs when sent now (its batch holds its kind only)."""
    attrs = 0
    if msg._due is not None and msg.scheduled_delay_ms(now_ms) is not None:
        attrs |= ATTR_SCHEDULED
    if msg.dedup_key is not None and info.dedup_window_ms:
        attrs |= ATTR_DEDUP
    return attrs


def _complete_with_duplicates(bt: _Batch, base: int, durability: Durability, topic_id: int,
                              dups: list[m.Duplicate]) -> None:
    """Settle the units of a dedup batch the broker stored only in part: a record listed in
    ``dups`` gets the stored original's place, the others the stored offsets in order."""
    topic, queue = bt.buf.topic.name, bt.buf.queue
    originals = {i: (q, off) for i, q, off in dups}
    stored = base
    i = 0
    for u in bt.units:
        out: list[SendResult] = []
        for _ in range(u.count):
            orig = originals.get(i)
            if orig is None:
                out.append(SendResult(topic, queue, stored, durability, topic_id))
                stored += 1
            else:
                out.append(SendResult(topic, orig[0], orig[1], durability, topic_id,
                                      duplicate=True))
            i += 1
        if u.future is not None and not u.future.done():
            u.future.set_result(out if u.many else out[0])


def _settle(unit: _Unit, *, exc: BaseException) -> None:
    if unit.future is None:
        log.warning("oneway send failed: %s", exc)
    elif not unit.future.done():
        unit.future.set_exception(exc)
