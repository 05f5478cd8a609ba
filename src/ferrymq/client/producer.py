"""The asyncio producer: the public :class:`AsyncProducer` over its accumulator, sender and
transaction manager.

Theory of operation
-------------------
The producer is split as aiokafka's and Kafka's are; each part says more in its own module:

* :mod:`ferrymq.client._accumulator` takes messages in: it chooses each message's queue (the
  user's selector, a stable hash of the sharding key, or a sticky round robin, see
  :mod:`ferrymq.client.partitioner`), checks it against the broker's limits and buffers it per
  queue until the buffer is full, ``linger_ms`` passed, or at once for a plain ``send``;
  scheduled messages and dedup-keyed ones travel in batches of their own;
* :mod:`ferrymq.client._sender` turns ready buffers into record batches and ships them in
  PRODUCE requests of at most ``max_request_bytes``; it keeps up to
  ``max_in_flight_per_queue`` batches of a queue in flight, retries idempotently (producer id,
  epoch, sequence numbers: a retry is stored once and never reorders a queue) until
  ``delivery_timeout_s``, and starts a queue on a new epoch after giving up on a batch;
* :mod:`ferrymq.client._txn_manager` is the read-process-write transaction of a
  ``transactional_id`` (docs/exactly-once.md): INIT_TXN at ``start()``, ``begin()``,
  ``send_offsets()``, ``commit()``/``abort()`` and ``stage()`` for the Spark sink.

* :mod:`ferrymq.client._cluster` knows who leads each queue: the sender sends each queue's
  batches to its leader, and after NOT_LEADER, FENCED_LEADER_EPOCH, LEADER_NOT_AVAILABLE or a
  lost leader it refreshes the leaders and retries there (same bytes, same sequence numbers).
  A single broker is a cluster of one: the one connection is used for everything.

This module holds the facade: options, lifecycle (``start``, ``flush``, ``close``) and the
``send*`` calls, whose hot path is one accumulator call per message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any, NamedTuple

from ferrymq import tracing
from ferrymq._time import SYSTEM_CLOCK, Clock
from ferrymq.client._accumulator import Accumulator, Unit
from ferrymq.client._cluster import Cluster
from ferrymq.client._sender import Sender
from ferrymq.client._session import Auth, Session, TLSOption
from ferrymq.client._txn_manager import TxnManager
from ferrymq.client.message import Message, SendResult
from ferrymq.client.partitioner import DEFAULT_STICKY_QUEUE_BYTES, QueueSelector
from ferrymq.errors import ClientError, ConfigError, FerryMQError, TxnUsageError
from ferrymq.protocol import messages as m
from ferrymq.protocol.schedule import DEFAULT_MAX_DELAY_MS

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
ACKS = {"all": m.Acks.ALL, "leader": m.Acks.LEADER}
"""The producer's ``acks`` choices and what is sent for each."""


def check_acks(acks: object) -> int:
    """The wire value of the ``acks=`` option.

    Raises:
        ConfigError: not one of the choices.
    """
    if not isinstance(acks, str) or acks not in ACKS:
        raise ConfigError(f"acks must be one of {', '.join(map(repr, ACKS))}, not {acks!r}")
    return ACKS[acks]


class StagedHandle(NamedTuple):
    """A staged transaction (a Spark sink task's output), committed by the driver with
    :meth:`ferrymq.client.admin.AsyncAdminClient.commit_staged`. Picklable."""

    transactional_id: str
    producer_id: int
    producer_epoch: int


class AsyncProducer:
    """Sends messages to a FerryMQ broker or cluster (asyncio).

    Args:
        servers: ``"host:port"``, or a bootstrap list (``"h1:9876,h2:9876,h3:9876"``): the
            producer learns from any of them which broker leads each queue and sends each
            queue's messages to its leader; on a failover it finds the new leader by itself
            within ``delivery_timeout_s``.
        acks: when a send is answered. ``"all"`` (the default): once every in-sync replica of
            the queue has the message (fsynced on each, with a broker in ``--flush sync``)
            and the in-sync replicas are at least the topic's ``min_insync``; otherwise the
            broker answers ``NotEnoughReplicasError``, retried until ``delivery_timeout_s``.
            ``"leader"``: once the leader alone has it: faster, but **a message acknowledged
            this way can be lost** if the leader fails before a follower copied it. On a single
            broker both mean the same. ``SendResult.durability`` says what was reached
            (``Durability.REPLICATED`` for acks="all" on a replicated queue).
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
        acks: str = "all",
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
        wire_acks = check_acks(acks)
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
        self._delivery_timeout_s = delivery_timeout_s
        self._idempotent = idempotent or transactional_id is not None
        self._request_bytes = max_request_bytes
        self._cluster = Cluster(self._session)
        wake = asyncio.Event()  # the sender's: a buffer is ready, a retry is due, an answer came
        self._accumulator = Accumulator(
            self._session, self._cluster, wake, linger_s=linger_ms / 1000, batch_max_bytes=batch_max_bytes,
            batch_max_records=batch_max_records, max_buffer_bytes=max_buffer_bytes,
            selector=queue_selector, sticky_queue_bytes=sticky_queue_bytes,
            auto_create=auto_create_topics, clock=clock)
        self._sender = Sender(
            self._session, self._cluster, self._accumulator, wake,
            request_timeout_s=request_timeout_s, delivery_timeout_s=delivery_timeout_s,
            idempotent=self._idempotent,
            max_in_flight=max_in_flight_per_queue if self._idempotent else 1,
            max_request_bytes=min(max_request_bytes, 8 * 1024 * 1024 - REQUEST_OVERHEAD_BYTES),
            acks=wire_acks)
        self._cluster.on_refresh(self._sender.on_refresh)
        self._txn: TxnManager | None = None
        if transactional_id is not None:
            self._txn = TxnManager(self._cluster, self._accumulator, self._sender,
                                   transactional_id,
                                   0 if txn_timeout_s is None else int(txn_timeout_s * 1000))
            self._accumulator.txn = self._sender.txn = self._txn
        self._sender_task: asyncio.Task[None] | None = None

    @property
    def producer_id(self) -> int:
        """The broker-assigned producer id (-1 before :meth:`start`, or not idempotent)."""
        return self._sender.producer_id

    @property
    def producer_epoch(self) -> int:
        """The epoch of :attr:`producer_id` (a transactional producer's goes up when it is
        re-initialised)."""
        return self._sender.producer_epoch

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> AsyncProducer:
        """Connect, learn the broker's limits and get a producer id."""
        await self._session.connection()
        hello = self._session.hello
        acc = self._accumulator
        if hello is not None:
            acc.max_message_bytes = hello.max_message_bytes
            acc.max_delay_ms = hello.max_delay_ms or DEFAULT_MAX_DELAY_MS
            frame_room = hello.max_frame_bytes - REQUEST_OVERHEAD_BYTES
            self._sender.max_request_bytes = min(self._request_bytes, frame_room)
            acc.batch_max_bytes = min(acc.batch_max_bytes, frame_room)
        if self._txn is not None:
            await self._txn.init(-1, -1)
        elif self._idempotent:
            resp = await self._session.request(m.InitProducerRequest(None), m.InitProducerResponse)
            self._sender.producer_id = resp.producer_id
            self._sender.producer_epoch = resp.producer_epoch
        self._sender_task = asyncio.get_running_loop().create_task(self._sender.run())
        return self

    async def __aenter__(self) -> AsyncProducer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def flush(self) -> None:
        """Send everything buffered now and wait until all of it is answered."""
        await self._sender.flush()

    async def close(self) -> None:
        """Flush, then close the connection."""
        if self._accumulator.closed:
            return
        with contextlib.suppress(FerryMQError):
            await asyncio.wait_for(self.flush(), self._delivery_timeout_s)
        self._accumulator.closed = True
        if self._sender_task is not None:
            self._sender_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender_task
        self._sender.fail_everything(ClientError("producer closed"))
        await self._cluster.close()
        await self._session.close()

    # -- transactions --------------------------------------------------------------------------

    def _txn_manager(self, what: str) -> TxnManager:
        if self._txn is None:
            raise TxnUsageError(f"{what} needs a transactional producer "
                                "(transactional_id=...)")
        return self._txn

    async def begin(self) -> None:
        """Begin a transaction: sends from now on commit or abort together.

        Raises:
            TxnUsageError: not transactional, already in a transaction, or fenced.
            ProducerFencedError: the broker aborted the last transaction on timeout and another
                producer took the transactional id since.
        """
        await self._txn_manager("begin()").begin()

    async def send_offsets(self, group: str, offsets: dict[tuple[str, int], int], *,
                           consumer: Any = None) -> None:
        """Commit a consumer group's offsets with this transaction (``offsets``: the next
        offset to consume per (topic, queue), as ``consumer.position()`` gives). With
        ``consumer=`` (a group member), the broker also checks it still owns those queues.

        Raises:
            TxnUsageError: no transaction open.
            IllegalGenerationError / UnknownMemberError: the consumer lost its queues.
        """
        await self._txn_manager("send_offsets()").send_offsets(group, offsets, consumer)

    async def commit(self) -> None:
        """Flush and commit the transaction: its messages (and offsets) become visible
        together. Returns once the commit is durable.

        Raises:
            TxnUsageError: no transaction open.
            BrokerError subclass: a send of the transaction failed (the transaction is still
                open: ``abort()`` it), or the commit was refused.
            TransactionTimedOutError: the broker aborted it on timeout: ``abort()``, begin
                again.
            ProducerFencedError: a newer producer took the transactional id (fatal).
        """
        await self._txn_manager("commit()").commit()

    async def abort(self) -> None:
        """Abort the transaction: none of its messages or offsets become visible. Messages not
        yet sent are dropped (their sends fail); sends in flight are waited for."""
        await self._txn_manager("abort()").abort()

    async def stage(self, sink_id: str, batch_id: int, *,
                    ttl_s: float | None = None) -> StagedHandle:
        """Flush and *stage* the transaction (a Spark sink task): it stays invisible until one
        ``commit_staged(sink_id, batch_id, handles)`` commits all of the batch's staged
        transactions at once; it is aborted after ``ttl_s`` (None: the broker's
        ``txn_staged_ttl_ms``) if nobody does.

        Raises:
            as :meth:`commit`.
        """
        txn = self._txn_manager("stage()")
        await txn.stage(sink_id, batch_id, 0 if ttl_s is None else max(1, int(ttl_s * 1000)))
        return StagedHandle(txn.transactional_id, self.producer_id, self.producer_epoch)

    # -- sending -------------------------------------------------------------------------------

    async def send(self, msg: Message) -> SendResult:
        """Send one message and wait until the broker stored it.

        A message with a dedup key that its topic stored within its dedup window is not stored
        again: the result has ``duplicate=True`` and names the stored message.

        Raises:
            BrokerError subclass: refused (too large, unknown topic, fenced, ...).
            FerryMQTimeoutError: not stored within ``delivery_timeout_s``.
        """
        if tracing.ENABLED:
            with tracing.send_span([msg]) as span:
                result = await self._send(msg)
                tracing.record_result(span, result)
                return result
        return await self._send(msg)

    async def _send(self, msg: Message) -> SendResult:
        """:meth:`send`, untraced (the sync facade traces in its caller's thread)."""
        acc = self._accumulator
        await acc.wait_for_space()
        fut: asyncio.Future[SendResult] = asyncio.get_running_loop().create_future()
        acc.enqueue(msg, Unit(1, fut, False), immediate=True)
        return await fut

    def send_nowait(self, msg: Message, *, oneway: bool = False) -> asyncio.Future[SendResult] | None:
        """Buffer one message (sent after ``linger_ms``); returns its result future (None when
        ``oneway``). Must be called on the producer's event loop."""
        if not tracing.ENABLED:
            return self._send_nowait(msg, oneway=oneway)
        span = tracing.start_send(msg)
        try:
            fut = self._send_nowait(msg, oneway=oneway)
        except BaseException as exc:
            tracing.end_send(span, None, exc)
            raise
        if fut is None:
            tracing.end_send(span, None, None)
        else:
            tracing.end_when_done(span, fut)
        return fut

    def _send_nowait(self, msg: Message, *, oneway: bool = False) -> asyncio.Future[SendResult] | None:
        """:meth:`send_nowait`, untraced."""
        fut: asyncio.Future[SendResult] | None = (
            None if oneway else asyncio.get_running_loop().create_future()
        )
        self._accumulator.enqueue(msg, Unit(1, fut, False), immediate=False)
        return fut

    async def send_oneway(self, msg: Message) -> None:
        """Send without waiting for (or learning) the result."""
        await self._accumulator.wait_for_space()
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
        if tracing.ENABLED:
            with tracing.send_span(msgs):
                return await self._send_batch(msgs)
        return await self._send_batch(msgs)

    async def _send_batch(self, msgs: Sequence[Message]) -> Sequence[SendResult]:
        """:meth:`send_batch` of at least one message, untraced."""
        if self._txn is not None:
            for msg in msgs:
                self._txn.check_send(msg)
        await self._accumulator.wait_for_space()
        futs = self._accumulator.enqueue_batch(msgs)
        if len(futs) == 1 and len(futs[0][0]) == len(msgs):
            res = await futs[0][1]  # one run of one queue: results are made on access
            return [res] if isinstance(res, SendResult) else res
        results: list[SendResult | None] = [None] * len(msgs)
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
            NotLeaderError: on a cluster, no broker leads its queue now (a failover; retry).
            NotEnoughReplicasError: on a cluster, too few in-sync replicas, or the cancel was
                not committed in time (it may still stand).
        """
        await self._cluster.ask_leader(lambda s: s.request(
            m.CancelScheduledRequest(msg_id), m.Empty, retry_codes=frozenset()))
