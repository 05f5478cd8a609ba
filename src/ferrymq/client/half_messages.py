"""The half-message producer: RocketMQ's transactional messages (half message, commit or
rollback, check-back).

Theory of operation
-------------------
``send_in_transaction(msg, local_transaction)`` picks the message's queue like
:class:`~ferrymq.client.producer.AsyncProducer` (selector, sharding key hash, round robin) and
stores it as a *half message* (PREPARE_HALF): durable, invisible to consumers. Then it
runs ``local_transaction(msg)`` and reports its answer (END_HALF): COMMIT makes the
message visible in its queue, ROLLBACK discards it, UNKNOWN leaves it to the check-back. The
prepare is sent once (never retried: a retried prepare could store a second half message);
END_HALF is retried, the broker answers a repeated outcome with the first result.

Check-back: the producer keeps a HALF_CHECK_POLL long poll open. When a half message of its group
stays unresolved (this or another producer of the group returned UNKNOWN, crashed, or lost its
connection), the broker hands it to one polling producer, whose ``checker(msg)`` decides; the
first check comes ``check_after`` seconds after the half message was stored, then every
``check_interval``, at most ``max_checks`` times; then the broker rolls it back. A checker that
raises counts as UNKNOWN. Synchronous checkers run in a worker thread.

On a cluster the half messages are owned by the leader of the half topic: the requests go there
(:class:`~ferrymq.client._coordinator.CoordinatorRoute`, following it on NOT_COORDINATOR or a
lost connection), and the check-back poll moves to the new owner after a failover.

Tracing (:mod:`ferrymq.tracing`): the prepare is the message's ``send <topic>`` span; its W3C
``traceparent`` goes into the half message's properties, which the committed message keeps, so
its consumers continue the producer's trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

from ferrymq import _deprecated, tracing
from ferrymq._time import SYSTEM_CLOCK, Clock
from ferrymq.client._cluster import Cluster
from ferrymq.client._coordinator import CoordinatorRoute
from ferrymq.client._session import Auth, Session, TLSOption
from ferrymq.client.message import (
    DURABILITY_BY_WIRE,
    BatchContext,
    Message,
    ReceivedMessage,
    SendResult,
)
from ferrymq.client.partitioner import QueueSelector, RoundRobin, queue_for_key
from ferrymq.client.sync import _run
from ferrymq.errors import (
    ClientError,
    ConfigError,
    FerryMQError,
    InvalidRequestError,
    UnknownQueueError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.half_messages import COMMITTED, HALF_ID, HALF_TOPIC, PREPARED
from ferrymq.protocol.messages import HalfState
from ferrymq.protocol.records import (
    ATTR_SCHEDULED,
    decode_msg_id,
    encode_batch,
    iter_batches,
    walk_records,
)

log = logging.getLogger("ferrymq.client")

Checker = Callable[[ReceivedMessage], "HalfState | Awaitable[HalfState]"]
"""``checker(msg) -> HalfState``: the outcome of the local transaction that ``msg``
(a half message; ``msg.properties["%TXN_ID"]`` is its half id) belongs to."""
LocalTransaction = Callable[[Message], "HalfState | Awaitable[HalfState]"]

__all__ = ["AsyncHalfMessage", "AsyncHalfMessageProducer", "Checker", "HalfMessage",
           "HalfMessageProducer", "HalfMessageResult", "HalfState", "half_id"]


def half_id(msg: ReceivedMessage) -> str | None:
    """The half id of a committed message (or of a message given to a checker): the id of the
    half message it was committed from (its ``%TXN_ID`` property)."""
    return msg.properties.get(HALF_ID)


class HalfMessageResult:
    """A half message's state after its producer reported an outcome.

    Attributes:
        half_id: the half message's id (``ferrymq message status`` takes it; ``txn_id`` is its
            deprecated name).
        state: ``"COMMITTED"``, ``"ROLLED_BACK"`` or ``"PREPARED"`` (UNKNOWN was reported: the
            broker's check-back decides).
        send_result: where the committed message is (None unless committed).
    """

    __slots__ = ("half_id", "send_result", "state")

    def __init__(self, half_id: str, state: str, send_result: SendResult | None) -> None:
        self.half_id = half_id
        self.state = state
        self.send_result = send_result

    @property
    def committed(self) -> bool:
        """Whether the message was committed (it is visible, or will be when due)."""
        return self.state == COMMITTED

    @property
    def msg_id(self) -> str | None:
        """The committed message's id."""
        return None if self.send_result is None else self.send_result.msg_id

    @property
    def txn_id(self) -> str:
        """Deprecated name of :attr:`half_id`."""
        _deprecated.warn("the attribute", "txn_id", "half_id")
        return self.half_id

    def __repr__(self) -> str:
        return f"HalfMessageResult(half_id={self.half_id!r}, state={self.state!r}, " \
               f"msg_id={self.msg_id!r})"


class AsyncHalfMessageProducer:
    """Sends half messages (asyncio).

    Args:
        servers: ``"host:port"`` (or several, comma separated).
        group: the producer group: the broker asks any live producer of it about unresolved
            half messages of any other.
        checker: ``checker(msg) -> HalfState`` (or a coroutine function).
        check_after: seconds after a half message was stored before the first check-back.
        check_interval: seconds between check-backs.
        max_checks: check-backs before the broker rolls the message back.
        client_id: shown in ``message status`` (default ``ferrymq-half-producer``; it was
            ``ferrymq-txn-producer`` before issue 19).
        request_timeout_s: one request's deadline.
        connect_timeout_s: how long the first connection may take (the constructor of the
            blocking ``HalfMessageProducer`` fails after it with ``ConnectionClosedError``
            naming every address tried and why), and the longest single attempt later.
        reconnect_timeout_s: after a connection was lost, how long to keep trying to reconnect
            before the waiting request fails.
        queue_selector: ``selector(message, queue_count) -> queue`` overriding the default.
        auto_create_topics: ask the broker to create unknown topics.
        poll_wait_s: how long one check-back long poll waits.
        clock: injected clock (born timestamps).
    """

    def __init__(
        self,
        servers: str | list[str],
        group: str,
        checker: Checker,
        *,
        check_after: float = 6.0,
        check_interval: float = 30.0,
        max_checks: int = 15,
        client_id: str = "ferrymq-half-producer",
        request_timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        reconnect_timeout_s: float = 60.0,
        queue_selector: QueueSelector | None = None,
        auto_create_topics: bool = True,
        poll_wait_s: float = 5.0,
        clock: Clock = SYSTEM_CLOCK,
        auth: Auth | None = None,
        tls: TLSOption = None,
    ) -> None:
        if not group:
            raise ConfigError("a half-message producer needs a group")
        if check_after <= 0 or check_interval <= 0 or max_checks <= 0 or poll_wait_s <= 0:
            raise ConfigError("check_after, check_interval, max_checks and poll_wait_s must "
                              "be > 0")
        self.group = group
        self.client_id = client_id
        self._checker = checker
        self._check_after_ms = max(1, round(check_after * 1000))
        self._check_interval_ms = max(1, round(check_interval * 1000))
        self._max_checks = max_checks
        self._session = Session(servers, client_id=client_id, request_timeout_s=request_timeout_s,
                                connect_timeout_s=connect_timeout_s,
                                reconnect_timeout_s=reconnect_timeout_s,
                                auth=auth, tls=tls)
        self._owner = CoordinatorRoute(Cluster(self._session), group, HALF_TOPIC)
        """Where half-message requests go (on a cluster: the leader of the half topic)."""
        self._request_timeout_s = request_timeout_s
        self._selector = queue_selector
        self._auto_create = auto_create_topics
        self._poll_wait_s = poll_wait_s
        self._rr = RoundRobin()
        self._clock = clock
        self._checks: asyncio.Task[None] | None = None
        self._closed = False
        self.checks_answered = 0

    async def start(self) -> AsyncHalfMessageProducer:
        """Connect and start answering check-backs."""
        await self._session.connection()
        self._checks = asyncio.get_running_loop().create_task(self._check_loop())
        return self

    async def __aenter__(self) -> AsyncHalfMessageProducer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop answering check-backs and close the connection."""
        if self._closed:
            return
        self._closed = True
        if self._checks is not None:
            self._checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checks
        await self._session.close()

    # -- half messages ---------------------------------------------------------------------------

    async def prepare(self, msg: Message) -> str:
        """Store ``msg`` as a half message (durable, invisible); return its half id.

        Raises:
            BrokerError subclass: refused (unknown topic, too large, BUSY: too many pending).
            ConnectionClosedError, FerryMQTimeoutError: the half message may or may not be
                stored; if it is, the check-back resolves it.
        """
        if tracing.ENABLED:
            with tracing.send_span([msg]):  # the context goes into the stored half message
                return await self._prepare(msg)
        return await self._prepare(msg)

    async def _prepare(self, msg: Message) -> str:
        """:meth:`prepare`, untraced (the sync facade traces in its caller's thread)."""
        if self._closed:
            raise ClientError("producer is closed")
        info = await self._session.topic(msg.topic, auto_create=self._auto_create)
        if self._selector is not None:
            q = int(self._selector(msg, info.queues))
            if not 0 <= q < info.queues:
                raise UnknownQueueError(f"selector chose queue {q} of {info.queues}")
        elif msg.sharding_key is not None:
            q = queue_for_key(msg.sharding_key, info.queues)
        else:
            q = self._rr(info.name, info.queues)
        now = self._clock.wall_ms()
        try:
            rec = msg.to_record(now)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        scheduled = msg._due is not None and msg.scheduled_delay_ms(now) is not None
        batch = bytes(encode_batch([rec], attributes=ATTR_SCHEDULED if scheduled else 0))
        resp = await self._owner.request(
            m.PrepareHalfRequest(self.group, self.client_id, msg.topic, q, batch,
                                 self._check_after_ms, self._check_interval_ms, self._max_checks),
            m.PrepareHalfResponse, retry=False)
        return resp.half_id

    async def end(self, half_id: str, state: HalfState, *, reason: str = "",
                  from_check: bool = False) -> HalfMessageResult:
        """Report the outcome of half message ``half_id``.

        Raises:
            UnknownHalfMessageError: no such half message in this group.
            HalfMessageResolvedError: it was already resolved the other way.
        """
        resp = await self._owner.request(
            m.EndHalfRequest(self.group, half_id, int(state), from_check, reason),
            m.EndHalfResponse)
        result = None
        if resp.msg_id:
            result = SendResult(resp.topic, resp.queue, resp.offset,
                                DURABILITY_BY_WIRE.get(resp.durability, DURABILITY_BY_WIRE[1]),
                                decode_msg_id(resp.msg_id)[0])
        return HalfMessageResult(half_id, resp.state, result)

    async def commit(self, half_id: str) -> HalfMessageResult:
        """Commit: the message becomes visible (when due, if it has a delay)."""
        return await self.end(half_id, HalfState.COMMIT)

    async def rollback(self, half_id: str, reason: str = "") -> HalfMessageResult:
        """Roll back: the message is discarded."""
        return await self.end(half_id, HalfState.ROLLBACK, reason=reason)

    async def send_in_transaction(self, msg: Message,
                                  local_transaction: LocalTransaction) -> HalfMessageResult:
        """Store ``msg`` as a half message, run ``local_transaction(msg)`` and report its
        answer. If it raises, UNKNOWN is reported (its work may have happened: the check-back
        decides) and the exception propagates."""
        half_id = await self.prepare(msg)
        try:
            state = local_transaction(msg)
            if inspect.isawaitable(state):
                state = await state
        except BaseException as exc:
            await self.end(half_id, HalfState.UNKNOWN,
                           reason=f"local transaction raised {type(exc).__name__}")
            raise
        return await self.end(half_id, HalfState(state))

    def half_message(self, msg: Message) -> AsyncHalfMessage:
        """``async with producer.half_message(msg) as half:``: prepared on entry, committed on
        a normal exit, rolled back on an exception (unless ``half.commit()``/``half.rollback()``
        was called)."""
        return AsyncHalfMessage(self, msg)

    def transaction(self, msg: Message) -> AsyncHalfMessage:
        """Deprecated name of :meth:`half_message`."""
        _deprecated.warn("the method", "transaction()", "half_message()")
        return self.half_message(msg)

    # -- check-back ------------------------------------------------------------------------------

    async def _check_loop(self) -> None:
        wait_ms = round(self._poll_wait_s * 1000)
        while not self._closed:
            try:
                resp = await self._owner.request(
                    m.HalfCheckPollRequest(self.group, self.client_id, wait_ms, 100),
                    m.HalfCheckPollResponse, timeout_s=self._poll_wait_s + self._request_timeout_s)
            except FerryMQError as exc:
                log.debug("half-message check poll failed: %s", exc)
                await asyncio.sleep(0.2)
                continue
            for half_id, topic, queue, batch, n in resp.checks:
                await self._check(half_id, topic, queue, batch, n)

    async def _check(self, half_id: str, topic: str, queue: int, batch: bytes, n: int) -> None:
        reason = ""
        try:
            msg = _message_of(topic, queue, batch, self._session)
            if inspect.iscoroutinefunction(self._checker):
                state = await self._checker(msg)
            else:
                state = await asyncio.to_thread(self._checker, msg)
                if inspect.isawaitable(state):
                    state = await state
            state = HalfState(state)
        except Exception as exc:  # noqa: BLE001 - a checker's failure means UNKNOWN
            log.warning("half-message checker failed for %s: %s", half_id, exc)
            state, reason = HalfState.UNKNOWN, f"checker raised {type(exc).__name__}: {exc}"
        try:
            await self.end(half_id, state, reason=reason or f"check {n}", from_check=True)
            self.checks_answered += 1
        except FerryMQError as exc:
            log.warning("cannot answer the check of %s: %s", half_id, exc)


class AsyncHalfMessage:
    """One half message of ``async with producer.half_message(msg) as half``: its ``half_id``
    once prepared and its ``result`` once resolved (``txn_id``: deprecated name of ``half_id``)."""

    def __init__(self, producer: AsyncHalfMessageProducer, msg: Message) -> None:
        self._producer = producer
        self.message = msg
        self.half_id = ""
        self.result: HalfMessageResult | None = None

    async def __aenter__(self) -> AsyncHalfMessage:
        self.half_id = await self._producer.prepare(self.message)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.result is not None and self.result.state != PREPARED:
            return
        if exc_type is None:
            await self.commit()
        else:
            await self.rollback(f"{exc_type.__name__} in the transaction block")

    @property
    def txn_id(self) -> str:
        """Deprecated name of ``half_id``."""
        _deprecated.warn("the attribute", "txn_id", "half_id")
        return self.half_id

    async def commit(self) -> HalfMessageResult:
        """Commit now."""
        self.result = await self._producer.commit(self.half_id)
        return self.result

    async def rollback(self, reason: str = "") -> HalfMessageResult:
        """Roll back now."""
        self.result = await self._producer.rollback(self.half_id, reason)
        return self.result


def _message_of(topic: str, queue: int, batch: bytes, session: Session) -> ReceivedMessage:
    info = session.topics.get(topic)
    for pos, h in iter_batches(batch):
        ctx = BatchContext(topic, queue, info.topic_id if info else 0, h.first_timestamp,
                           h.first_timestamp)
        msgs = walk_records(batch, pos, h, 0, ReceivedMessage, ctx)
        if msgs:
            return msgs[0]
    raise InvalidRequestError("empty check-back message")


class HalfMessageProducer:
    """Sends half messages (blocking API). See :class:`AsyncHalfMessageProducer` for
    the arguments; ``checker`` runs in a worker thread, ``local_transaction`` in the caller's.

    Example::

        def checker(msg):  # asked when an outcome is unknown
            return HalfState.COMMIT if order_exists(msg.keys[0]) else \\
                HalfState.ROLLBACK

        with HalfMessageProducer(addr, "order-service", checker) as p:
            with p.half_message(Message("orders", b"...", keys=["o-1"])) as half:
                db.insert_order("o-1")  # an exception here rolls the message back
    """

    def __init__(self, servers: str | list[str], group: str, checker: Checker,
                 **options: Any) -> None:
        self._async = _run(self._make(servers, group, checker, options))

    @staticmethod
    async def _make(servers: str | list[str], group: str, checker: Checker,
                    options: dict[str, Any]) -> AsyncHalfMessageProducer:
        return await AsyncHalfMessageProducer(servers, group, checker, **options).start()

    @property
    def group(self) -> str:
        """The producer group."""
        return self._async.group

    def prepare(self, msg: Message) -> str:
        """Store a half message; its half id (see :meth:`AsyncHalfMessageProducer.prepare`)."""
        if tracing.ENABLED:  # here, in the caller's thread: its trace is the parent
            with tracing.send_span([msg]):
                return _run(self._async._prepare(msg))
        return _run(self._async._prepare(msg))

    def end(self, half_id: str, state: HalfState, *, reason: str = "") -> HalfMessageResult:
        """Report an outcome (COMMIT, ROLLBACK or UNKNOWN)."""
        return _run(self._async.end(half_id, state, reason=reason))

    def commit(self, half_id: str) -> HalfMessageResult:
        """Commit half message ``half_id``."""
        return _run(self._async.commit(half_id))

    def rollback(self, half_id: str, reason: str = "") -> HalfMessageResult:
        """Roll back half message ``half_id``."""
        return _run(self._async.rollback(half_id, reason))

    def send_in_transaction(
        self, msg: Message, local_transaction: Callable[[Message], HalfState],
    ) -> HalfMessageResult:
        """Store ``msg`` as a half message, run ``local_transaction(msg)`` (in this thread) and
        report its answer; if it raises, UNKNOWN is reported and the exception propagates."""
        half_id = self.prepare(msg)
        try:
            state = HalfState(local_transaction(msg))
        except BaseException as exc:
            self.end(half_id, HalfState.UNKNOWN,
                     reason=f"local transaction raised {type(exc).__name__}")
            raise
        return self.end(half_id, state)

    def half_message(self, msg: Message) -> HalfMessage:
        """``with producer.half_message(msg) as half:``: prepared on entry, committed on a
        normal exit, rolled back on an exception (unless ``half.commit()``/``half.rollback()``
        was called)."""
        return HalfMessage(self, msg)

    def transaction(self, msg: Message) -> HalfMessage:
        """Deprecated name of :meth:`half_message`."""
        _deprecated.warn("the method", "transaction()", "half_message()")
        return self.half_message(msg)

    def close(self) -> None:
        """Stop answering check-backs and close the connection."""
        _run(self._async.close())

    def __enter__(self) -> HalfMessageProducer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class HalfMessage:
    """One half message of ``with producer.half_message(msg) as half``: its ``half_id`` once
    prepared and its ``result`` once resolved (``txn_id``: deprecated name of ``half_id``)."""

    def __init__(self, producer: HalfMessageProducer, msg: Message) -> None:
        self._producer = producer
        self.message = msg
        self.half_id = ""
        self.result: HalfMessageResult | None = None

    def __enter__(self) -> HalfMessage:
        self.half_id = self._producer.prepare(self.message)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.result is not None and self.result.state != PREPARED:
            return
        if exc_type is None:
            self.commit()
        else:
            self.rollback(f"{exc_type.__name__} in the transaction block")

    @property
    def txn_id(self) -> str:
        """Deprecated name of ``half_id``."""
        _deprecated.warn("the attribute", "txn_id", "half_id")
        return self.half_id

    def commit(self) -> HalfMessageResult:
        """Commit now."""
        self.result = self._producer.commit(self.half_id)
        return self.result

    def rollback(self, reason: str = "") -> HalfMessageResult:
        """Roll back now."""
        self.result = self._producer.rollback(self.half_id, reason)
        return self.result
