"""The push consumer (RocketMQ's PushConsumer): handlers are called for you, acks are automatic.

Theory of operation
-------------------
A push consumer is a member of a delivery group (see :mod:`ferrymq.client._delivery`) that runs
four kinds of tasks on its event loop, all owned by the consumer and stopped by :meth:`close`:

* the **fetcher** keeps the prefetch buffer filled: when at least half of ``prefetch`` (or of
  ``prefetch_bytes``) is free it sends one long-polling RECEIVE for up to
  ``MAX_RECEIVE_BATCH`` messages; it never has more than one RECEIVE in flight;
* ``concurrency`` **workers** take messages from the buffer (``batch_size`` at a time, all of one
  topic), call the topic's handler and turn its result into an ack or a nack. For
  :class:`PushConsumer` a worker runs the handler in a pool thread, several calls per hop to
  the thread when many messages wait; the thread posts each outcome back to the loop as it
  has it (one wake-up for however many arrive together);
* the **flusher** sends what the workers decided: acks are collected for ``ACK_LINGER_S`` (or
  until ``ACK_BATCH`` are waiting) and sent as one ACK request, nacks likewise as NACK requests,
  with at most ``MAX_ACKS_IN_FLIGHT`` requests in flight;
* the **renewer** extends the lease of every message this member holds (buffered or being
  handled) once a third of ``invisible_duration`` has passed since it was leased, so a long
  handler never loses its message. A renewal changes the message's receipt, so acks and nacks
  of messages whose renewal is in flight wait for it (``_renewing``).

Heartbeats come from the delivery core's own task. With :class:`AsyncPushConsumer` the handlers
run on the same event loop: an ``async def`` handler that blocks (``time.sleep``, CPU work,
blocking I/O) stalls fetching, acking, lease renewal *and heartbeats*, and the broker evicts the
member after ``session_timeout_s``; run blocking work with ``asyncio.to_thread`` or use the
thread-pool :class:`PushConsumer`, whose handlers run in worker threads while the loop thread
keeps fetching, acking and heartbeating.

:meth:`AsyncPushConsumer.close` is graceful: fetching stops (a RECEIVE in flight may still
bring messages; they are handed back as they come), buffered messages that no handler started
go back to the group at once (a NACK that does not count as an attempt), running handlers get
``timeout`` seconds to finish while their leases are still renewed, the last acks and nacks
are sent, and the member leaves the group (which hands back anything still leased, again
without counting).

Interrupting (Ctrl-C) a :class:`PushConsumer`: its handlers run on daemon threads that only
the consumer stops (:mod:`ferrymq.client._threads`), so the interpreter's exit never pulls the
pool from under the workers. Leaving a ``with`` block (or ``try``/``finally``) on the
``KeyboardInterrupt`` closes as above; a second Ctrl-C during :meth:`PushConsumer.close` stops
waiting for the running handlers (they are abandoned, their messages go back with the leave)
and still leaves the group. A consumer the program never closed is closed by an exit hook
(``atexit``) the same way.

Starting: :meth:`AsyncPushConsumer.start` connects first, so a wrong address fails with the
connection error; then the member joins its group with its subscriptions. A subscribed topic
that does not exist yet is waited for (one warning; ``require_topic=True`` makes it an
``UnknownTopicError``), see :mod:`ferrymq.client._delivery`. A start that fails leaves the
group again: nothing of it stays on the broker.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import enum
import functools
import inspect
import itertools
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar, overload

from ferrymq.client._delivery import DeliveryCore, LeasedMessage
from ferrymq.client._renamed import rename_options, renamed
from ferrymq.client._session import Auth, Session, TLSOption
from ferrymq.client._threads import HandlerThreads, PoolClosedError
from ferrymq.client.retry import Backoff
from ferrymq.errors import BrokerError, ConfigError, FerryMQError
from ferrymq.protocol.letters import delivery_group_name_problem

log = logging.getLogger("ferrymq.client")

MAX_RECEIVE_BATCH = 1024
"""Most messages one RECEIVE asks for (the broker caps it too); big enough to amortise the
request, small enough that one answer is a few hundred KiB of 100-byte messages."""
MIN_RECEIVE_BYTES = 256 * 1024
"""Smallest ``max_bytes`` of a RECEIVE (a producer's batch of a thousand small messages)."""
LONG_POLL_S = 2.0
"""How long one RECEIVE waits on the broker when nothing is there."""
ACK_LINGER_S = 0.005
"""How long acks and nacks are collected before they are sent (unless ACK_BATCH are waiting)."""
ACK_BATCH = 1024
"""Acks (or nacks) waiting that make the flusher send at once, without lingering."""
MAX_ACK_ENTRIES = 4096
"""Most receipts in one ACK, NACK or CHANGE_INVISIBLE request (keeps frames far below the cap)."""
MAX_ACKS_IN_FLIGHT = 4
"""ACK/NACK requests in flight at once; more acks wait and go out in bigger requests."""
THREAD_CALLS_PER_HOP = 64
"""Most handler calls one hop to a pool thread makes (when many messages wait)."""
THREAD_HOP_BUDGET_S = 0.05
"""A hop to a pool thread starts no new handler call after this long; the rest of its messages
go back to the buffer, so one slow handler does not hold up messages other threads could run."""
YIELD_EVERY = 64
"""A worker whose handlers never suspend yields to the loop after this many messages, so the
fetcher, the flusher and the heartbeat keep running."""
ABANDON_WAIT_S = 10.0
"""After a second Ctrl-C in :meth:`PushConsumer.close`, how long it still waits for the last
acks and the leave before it gives up."""
_GROUP_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_MAX_GROUP_CHARS = 200


class ConsumeResult(enum.Enum):
    """What a handler returns.

    * ``SUCCESS`` (or returning ``None``): the message is acked and never delivered to the
      group again.
    * ``LATER``: redeliver after the group's retry ladder (``retry_delays``); counts as a
      failed attempt. ``ConsumeResult.later(seconds)`` asks for its own delay instead.
    * ``FAILURE``: the handler failed; same treatment as ``LATER`` (retried after the ladder,
      counted), with "handler returned FAILURE" as the recorded reason.

    A handler that raises counts as ``LATER``; the exception is logged and its text is the
    reason recorded with the retry (and shown in the dead-letter queue). A message that fails
    again after ``max_reconsume`` redeliveries goes to the group's dead-letter queue
    ``%DLQ%<group>`` (``max_reconsume=2``: three deliveries in all).

    Batch handlers (``batch_size > 1``) may also return an ``int`` ``n``: the first ``n``
    messages of the batch succeeded (are acked) and the rest are retried as ``LATER``
    (RocketMQ's ackIndex, as a count: ``return 0`` retries all, ``return len(msgs)`` acks all;
    values outside ``0..len(msgs)`` are clamped).
    """

    SUCCESS = "success"
    LATER = "later"
    FAILURE = "failure"

    @staticmethod
    def later(seconds: float, reason: str = "") -> Later:
        """A LATER with its own delay: redeliver ``seconds`` from now (counts as an attempt).

        Raises:
            ConfigError: ``seconds`` is negative.
        """
        return Later(seconds, reason)


@dataclass(frozen=True, slots=True)
class Later:
    """A handler's request to retry after ``delay`` seconds (see :meth:`ConsumeResult.later`).

    Attributes:
        delay: seconds until the message is delivered again (0: at once).
        reason: recorded with the retry (shown in the dead-letter queue).
    """

    delay: float
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.delay >= 0:
            raise ConfigError(f"retry delay must be >= 0 seconds, not {self.delay}")


HandlerResult = ConsumeResult | Later | int | None
"""What a handler may return (``int``: batch handlers only, see :class:`ConsumeResult`)."""
AH = TypeVar("AH", bound=Callable[..., Awaitable[Any]])
SH = TypeVar("SH", bound=Callable[..., Any])


@dataclass(slots=True)
class _Subscription:
    topic: str
    tags: str
    handler: Callable[[Any], Any]  # async def (AsyncPushConsumer) or plain (thread pool)


def default_instance_name() -> str:
    """``<hostname>-<pid>``: this process (see :func:`next_instance_name`)."""
    return f"{socket.gethostname()}-{os.getpid()}"


_instances: dict[str, itertools.count[int]] = {}
_instances_lock = threading.Lock()


def next_instance_name(group: str) -> str:
    """``<hostname>-<pid>-<n>``: the name of the n-th broadcasting consumer of ``group``
    created in this process without an ``instance_name`` (n from 1), so that each consumer
    object is a member of its own."""
    with _instances_lock:
        n = next(_instances.setdefault(group, itertools.count(1)))
    return f"{default_instance_name()}-{n}"


def broadcast_group(group: str, instance_name: str) -> str:
    """The delivery group of one broadcasting member: ``<group>.<instance_name>``, with
    characters outside ``[A-Za-z0-9._-]`` replaced by ``_`` and cut to 200 characters."""
    return _GROUP_CHARS.sub("_", f"{group}.{instance_name}")[:_MAX_GROUP_CHARS]


class AsyncPushConsumer:
    """A push consumer for ``async def`` handlers (asyncio).

    Subscribe handlers, then :meth:`start` (or ``async with``); handlers are called with each
    :class:`~ferrymq.client._delivery.LeasedMessage` (``reconsume_times`` says how many
    earlier attempts failed) and return a :class:`ConsumeResult` (see there for the rules,
    batch handlers and ``ConsumeResult.later(seconds)``)::

        consumer = AsyncPushConsumer("127.0.0.1:9876", "billing")

        @consumer.subscribe("orders", "created || paid")
        async def handle(msg: LeasedMessage) -> ConsumeResult:
            await bill(msg.body)
            return ConsumeResult.SUCCESS

        async with consumer:
            await stop_requested.wait()

    **Clustering** (the default): the members of ``group`` share the messages, each message
    handled by one member at a time, retried (``retry_delays``, at most ``max_reconsume``
    times) and then dead-lettered to ``%DLQ%<group>``. **Broadcasting**: every member gets every
    message. Each consumer object is a member of its own delivery group, named
    ``<group>.<instance_name>`` (sanitized to ``[A-Za-z0-9._-]``), with its own progress,
    retries and dead-letter queue ``%DLQ%<group>.<instance_name>``. Without ``instance_name``
    the name is ``<hostname>-<pid>-<n>`` (the n-th such consumer of ``group`` in this
    process) and the group is ephemeral: the broker removes it (progress, retry queue) once
    the consumer closes or its session times out, unless it holds dead letters; a restarted
    process is a new member, starting at the end of each queue. Give a stable
    ``instance_name`` to keep progress across restarts (the group is then durable); the broker
    refuses a second live consumer with the same name
    (:class:`~ferrymq.errors.MemberConflictError`). A new
    broadcasting group starts at the end of each queue (``start_from="latest"``); a clustering
    group at the beginning.

    Handlers run on the event loop: a handler that blocks stalls fetching, acks, lease renewal
    and heartbeats (see the module docstring); use :class:`PushConsumer` for blocking code.

    Args:
        servers: ``host:port`` (or a list) of brokers.
        group: the consumer group.
        mode: ``"clustering"`` or ``"broadcasting"``.
        concurrency: handlers running at once.
        max_reconsume: redeliveries of a failing message before it is dead-lettered (the
            group's setting: the last member to heartbeat wins; None keeps the group's).
        retry_delays: the group's retry ladder in seconds (None: keep the group's; RocketMQ's
            10s 30s 1m ... 2h for a new group).
        prefetch: most messages buffered ahead of the handlers.
        prefetch_bytes: most bytes buffered ahead of the handlers.
        invisible_duration: seconds a leased message stays invisible to the rest of the group;
            renewed while this member holds it, so it matters only when the member dies.
        batch_size: messages per handler call; above 1 handlers receive a ``list`` (of one
            topic, possibly shorter than ``batch_size``).
        session_timeout_s: seconds without a heartbeat after which the broker evicts the member.
        consume_timeout: seconds a message may stay with this member (buffered plus handled)
            before its lease is no longer renewed (RocketMQ's consumeTimeout, 15 min): a
            handler that hangs then loses the message, which is redelivered (counted as a
            failure) and the hung handler's late result is refused.
        instance_name: this member's name (broadcasting: part of its group's name, which is
            then durable; without it the group is ephemeral, see above).
        start_from: where a *new* group starts: ``"earliest"``, ``"latest"`` or a timestamp
            in ms (default: ``"earliest"`` clustering, ``"latest"`` broadcasting).
        orderly: messages of one sharding key are handled one at a time, in send order,
            across members and rebalances; a failing message is retried in place (after the
            broker's ``orderly_retry_ms``, 1 s, unless the handler returns ``later(s)``) and
            blocks only its own key; past ``max_reconsume`` it is dead-lettered and the key
            moves on. Fixed when the group is created.
        require_topic: a subscribed topic that does not exist is an ``UnknownTopicError`` at
            :meth:`start` (default: the consumer logs a warning, waits for it and consumes it
            from its first message once it exists).
        client_id: sent to the broker (shown in ``ferrymq group describe``).
        request_timeout_s: seconds to wait for a broker answer.
        connect_timeout_s: seconds the first connection may take before :meth:`start` fails
            with ``ConnectionClosedError`` ("cannot connect to HOST:PORT").
        reconnect_timeout_s: seconds to keep trying to reconnect before a request fails.
        session_timeout, request_timeout, reconnect_timeout: deprecated names of the options
            above with ``_s`` (the names every client uses); they warn.

    Raises:
        ConfigError: an option is out of range, or ``group`` is not a valid group name.
    """

    def __init__(
        self,
        servers: str | list[str] = "127.0.0.1:9876",
        group: str = "default",
        *,
        mode: str = "clustering",
        concurrency: int = 16,
        max_reconsume: int | None = 16,
        retry_delays: Sequence[float] | None = None,
        prefetch: int = 2048,
        prefetch_bytes: int = 64 << 20,
        invisible_duration: float = 30.0,
        batch_size: int = 1,
        session_timeout_s: float = 30.0,
        consume_timeout: float = 900.0,
        instance_name: str | None = None,
        start_from: str | int | None = None,
        orderly: bool = False,
        require_topic: bool = False,
        client_id: str = "ferrymq-push-consumer",
        request_timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        reconnect_timeout_s: float = 60.0,
        session_timeout: float | None = None,
        request_timeout: float | None = None,
        reconnect_timeout: float | None = None,
        auth: Auth | None = None,
        tls: TLSOption = None,
    ) -> None:
        session_timeout_s = renamed("session_timeout", session_timeout, session_timeout_s)
        request_timeout_s = renamed("request_timeout", request_timeout, request_timeout_s)
        reconnect_timeout_s = renamed("reconnect_timeout", reconnect_timeout, reconnect_timeout_s)
        if mode not in ("clustering", "broadcasting"):
            raise ConfigError(f"mode must be 'clustering' or 'broadcasting', not {mode!r}")
        if concurrency < 1 or batch_size < 1 or prefetch < 1 or prefetch_bytes < 1:
            raise ConfigError("concurrency, batch_size, prefetch and prefetch_bytes must be >= 1")
        if not invisible_duration > 0:
            raise ConfigError("invisible_duration must be positive")
        if not consume_timeout > 0:
            raise ConfigError("consume_timeout must be positive")
        self.consume_timeout = float(consume_timeout)
        self.group = group
        self.mode = mode
        broadcasting = mode == "broadcasting"
        self.instance_name = instance_name or (
            next_instance_name(group) if broadcasting else default_instance_name())
        self.delivery_group = (
            broadcast_group(group, self.instance_name) if broadcasting else group
        )
        problem = delivery_group_name_problem(self.delivery_group)
        if problem is not None:
            raise ConfigError(problem)
        self.require_topic = require_topic
        if start_from is None:
            start_from = "latest" if broadcasting else "earliest"
        self.concurrency = concurrency
        self.batch_size = batch_size
        self.prefetch = prefetch
        self.prefetch_bytes = prefetch_bytes
        self.invisible_duration = float(invisible_duration)
        self._session = Session(servers, client_id=client_id, request_timeout_s=request_timeout_s,
                                connect_timeout_s=connect_timeout_s,
                                reconnect_timeout_s=reconnect_timeout_s, auth=auth, tls=tls)
        self._core = DeliveryCore(self._session, self.delivery_group,
                                  session_timeout_s=session_timeout_s, retry_delays=retry_delays,
                                  max_reconsume=max_reconsume, start_from=start_from,
                                  orderly=orderly, exclusive=broadcasting,
                                  ephemeral=broadcasting and not instance_name)
        self._subs: dict[str, _Subscription] = {}
        # the buffer: (message, bytes charged to prefetch_bytes), in delivery order
        self._buffer: collections.deque[tuple[LeasedMessage, int]] = collections.deque()
        self._buffered_bytes = 0
        self._receive_min = max(1, min(MAX_RECEIVE_BATCH, prefetch) // 2)
        self._refill_at = prefetch - self._receive_min  # wake the fetcher at or below this
        self._refill_bytes_at = prefetch_bytes // 2
        self._bytes_per_message = 1024  # running estimate (whole batches come: an upper bound)
        # every leased message this member holds and has not settled -> local lease deadline
        self._held: dict[LeasedMessage, float] = {}
        self._held_since: dict[LeasedMessage, float] = {}  # when each held message arrived
        self._renewing: set[LeasedMessage] = set()
        self._acks: list[LeasedMessage] = []
        self._nacks: list[tuple[LeasedMessage, float | None, str, bool]] = []
        self._sends: set[asyncio.Task[None]] = set()
        # asyncio primitives bind to the loop on first use (the loop of start())
        self._send_slots = asyncio.Semaphore(MAX_ACKS_IN_FLIGHT)
        self._ready = asyncio.Event()  # messages in the buffer (idle workers wait on it)
        self._fetch_wake = asyncio.Event()
        self._flush_wake = asyncio.Event()
        self._fetcher_idle = False
        self._fetcher: asyncio.Task[None] | None = None
        self._workers: list[asyncio.Task[None]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
        self._renew_busy = False  # a renewal is in flight: let it finish, do not cancel it
        self._draining = False  # close(): the flusher sends everything, then returns
        self._stopping = False
        self._abandoned = False  # close() waits for no running handler (_abandon_handlers)
        self._closed = False
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: concurrent.futures.Executor | None = None  # set by PushConsumer
        # handler outcomes posted by pool threads, settled on the loop thread
        self._outcomes: collections.deque[tuple[str, list[LeasedMessage], object]] = (
            collections.deque())
        self._drain_scheduled = False
        self.stats = collections.Counter[str]()
        """Counters: ``received``, ``acked``, ``nacked``, ``returned`` (handed back unstarted),
        ``renewed``, ``handler_errors``, ``rejected`` (acks/nacks the broker refused)."""

    # -- public API ----------------------------------------------------------------------------

    @property
    def member_id(self) -> str:
        """This member's id in its delivery group (empty before :meth:`start`)."""
        return self._core.member_id

    @overload
    def subscribe(self, topic: str, tags: str = "*", handler: None = None) -> Callable[[AH], AH]:
        ...

    @overload
    def subscribe(self, topic: str, tags: str, handler: AH) -> AH:
        ...

    def subscribe(
        self, topic: str, tags: str = "*", handler: AH | None = None
    ) -> AH | Callable[[AH], AH]:
        """Call ``handler`` for the messages of ``topic`` whose tag matches ``tags``.

        Without ``handler`` this is a decorator. One handler per topic: subscribing a topic
        again replaces its tags and handler. Subscriptions made after :meth:`start` take effect
        with the next fetch (a refused one is logged, not raised; so is a missing topic with
        ``require_topic=True``).

        Raises:
            ConfigError: ``handler`` is not an ``async def`` function.
            LocalProtocolError: ``tags`` is not a valid tag expression.
        """
        if handler is None:
            return functools.partial(self._subscribe_decorator, topic, tags)
        if not _is_async(handler):
            raise ConfigError(
                f"AsyncPushConsumer handlers must be 'async def' ({handler!r} is not); "
                f"use PushConsumer for plain functions"
            )
        self._add_subscription(topic, tags, handler)
        return handler

    def _subscribe_decorator(self, topic: str, tags: str, handler: AH) -> AH:
        return self.subscribe(topic, tags, handler)

    async def start(self) -> AsyncPushConsumer:
        """Connect, join the group and start fetching and handling messages.

        A subscribed topic that does not exist yet is waited for (a warning is logged) unless
        ``require_topic``. If start fails, the member has left the group again; call
        :meth:`start` again or :meth:`close`.

        Raises:
            ConnectionClosedError: the broker cannot be reached (first connection).
            UnknownTopicError: a subscribed topic does not exist and ``require_topic`` is set.
            InvalidTopicNameError: a subscription names an impossible topic.
            MemberConflictError: broadcasting, and a live consumer of this group has the same
                ``instance_name``.
            AccessDeniedError: the user may not consume the topics or join the group.
        """
        if self._closed:
            raise ConfigError("this consumer is closed")
        if self._started:
            return self
        loop = asyncio.get_running_loop()
        self._loop = loop
        try:
            await self._session.connection()  # a wrong address fails here, as what it is
            if self._subs:
                await self._core.check_topics(list(self._subs), require=self.require_topic)
                await self._core.start()
                # one receive that does not wait, so the group's cursors exist when start()
                # returns (start_from="latest" counts from here)
                await self._fetch_once(0.0)
        except BaseException:
            await self._core.close()  # leave again (what the receive leased goes back)
            self._buffer.clear()
            self._buffered_bytes = 0
            self._held.clear()
            self._held_since.clear()
            raise
        self._started = True
        self._fetcher = loop.create_task(self._fetch_loop(), name="ferrymq-push-fetch")
        self._flusher = loop.create_task(self._flush_loop(), name="ferrymq-push-flush")
        self._renewer = loop.create_task(self._renew_loop(), name="ferrymq-push-renew")
        pool = self._pool
        self._workers = [
            loop.create_task(self._work() if pool is None else self._work_in_threads(pool),
                             name=f"ferrymq-push-worker-{i}")
            for i in range(self.concurrency)
        ]
        for t in (self._fetcher, self._flusher, self._renewer, *self._workers):
            t.add_done_callback(self._task_done)
        return self

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("push consumer %s: task %s crashed", self.delivery_group,
                      task.get_name(), exc_info=task.exception())

    async def close(self, timeout: float = 30.0) -> None:
        """Stop gracefully: stop fetching, hand back buffered messages no handler started,
        wait up to ``timeout`` seconds for running handlers (cancelling those still running
        then), send their acks and nacks, leave the group and disconnect."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        try:
            if self._started:
                await self._shutdown(timeout)
            await self._core.close()
        finally:
            await self._session.close()

    def _abandon_handlers(self) -> None:
        """While closing: stop waiting for running handlers (a second Ctrl-C). Their workers
        are cancelled; the messages go back to the group when the member leaves."""
        self._abandoned = True
        if self._stopping:
            for t in self._workers:
                t.cancel()

    async def __aenter__(self) -> AsyncPushConsumer:
        try:
            return await self.start()
        except BaseException:
            await self.close()  # no __aexit__ follows a failed __aenter__
            raise

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -- subscriptions -------------------------------------------------------------------------

    def _add_subscription(self, topic: str, tags: str, handler: Callable[[Any], Any]) -> None:
        self._core.subscribe(topic, tags)  # checks the tag expression
        self._subs[topic] = _Subscription(topic, tags, handler)
        if self._started and not self._stopping and self._loop is not None:
            self._loop.call_soon_threadsafe(self._subscribed)

    def _subscribed(self) -> None:
        assert self._loop is not None
        task = self._loop.create_task(self._join_quietly())
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _join_quietly(self) -> None:
        """After a subscription made after start(): join (or update) with it, then fetch."""
        try:
            await self._core.check_topics(list(self._subs), require=self.require_topic)
            if self._core.registered:
                await self._core.heartbeat()
            else:
                await self._core.start()
        except FerryMQError as exc:
            log.error("push consumer %s: subscription rejected: %s", self.delivery_group, exc)
            return
        self._fetch_wake.set()

    # -- fetching ------------------------------------------------------------------------------

    async def _fetch_once(self, wait_s: float) -> None:
        loop = asyncio.get_running_loop()
        room = min(self.prefetch - len(self._buffer), MAX_RECEIVE_BATCH)
        # Ask for about what ``room`` messages take: the broker reads up to max_bytes from
        # disk per queue whatever the message count, so prefetch_bytes would cost it megabytes
        # of reads for a few hundred KiB of messages.
        byte_room = min(self.prefetch_bytes - self._buffered_bytes,
                        max(MIN_RECEIVE_BYTES, 2 * room * self._bytes_per_message))
        topics = [(t, s.tags) for t, s in self._subs.items()]
        sent = loop.time()
        msgs = await self._core.receive(room, self.invisible_duration, wait_s,
                                        max_bytes=byte_room, topics=topics)
        if not msgs:
            return
        if self._stopping:  # close() began while this receive was in flight
            self._nacks.extend((x, 0.0, "consumer closing", False) for x in msgs)
            self._wake_flusher()
            return
        deadline = sent + self.invisible_duration
        self._held.update(dict.fromkeys(msgs, deadline))
        self._held_since.update(dict.fromkeys(msgs, sent))
        # charge each message its share of the bytes received (whole batches may come)
        total = 0
        last: bytes | None = None
        for x in msgs:
            b = x._buf
            if b is not last:
                total += len(b)
                last = b
        each = total // len(msgs) + 1
        self._bytes_per_message = (self._bytes_per_message + each) // 2
        self._buffer.extend([(x, each) for x in msgs])
        self._buffered_bytes += each * len(msgs)
        self.stats["received"] += len(msgs)
        self._ready.set()

    async def _fetch_loop(self) -> None:
        backoff = Backoff(base_s=0.1, cap_s=5.0)
        failures = 0
        wake = self._fetch_wake
        while not self._stopping:
            if (not self._subs or self.prefetch - len(self._buffer) < self._receive_min
                    or self.prefetch_bytes - self._buffered_bytes < self._refill_bytes_at):
                wake.clear()
                self._fetcher_idle = True
                await wake.wait()
                self._fetcher_idle = False
                continue
            try:
                await self._fetch_once(LONG_POLL_S)
                failures = 0
            except FerryMQError as exc:
                failures += 1
                log.warning("push consumer %s: receive failed (attempt %d): %s",
                            self.delivery_group, failures, exc)
                await asyncio.sleep(backoff.delay(failures))

    # -- handling ------------------------------------------------------------------------------

    def _halting(self) -> bool:
        return self._stopping  # a method: mypy would keep a narrowed attribute across awaits

    def _take(self, calls: int) -> tuple[str, list[LeasedMessage], int]:
        """Pop the messages of up to ``calls`` handler calls (``batch_size`` each), all of the
        first message's topic, and the bytes they were charged; wake the fetcher when the
        buffer is low. The buffer is not empty."""
        buf = self._buffer
        first, charge = buf.popleft()
        topic = first.topic
        msgs = [first]
        limit = calls * self.batch_size
        while len(msgs) < limit and buf and buf[0][0].topic == topic:
            x, c = buf.popleft()
            msgs.append(x)
            charge += c
        self._buffered_bytes -= charge
        if (self._fetcher_idle and len(buf) <= self._refill_at
                and self._buffered_bytes <= self._refill_bytes_at):
            self._fetch_wake.set()
        return topic, msgs, charge

    def _handler(self, topic: str, msgs: list[LeasedMessage]) -> Callable[[Any], Any] | None:
        sub = self._subs.get(topic)
        if sub is not None:
            return sub.handler
        self._no_handler(topic, msgs)
        return None

    def _no_handler(self, topic: str, msgs: list[LeasedMessage]) -> None:
        # should not happen: the broker delivers the subscribed topics only
        log.warning("push consumer %s: no handler for topic %r; %d messages handed back",
                    self.delivery_group, topic, len(msgs))
        for x in msgs:
            self._settle_one(x, (0.0, "no handler for its topic", False))

    async def _work(self) -> None:
        """A worker for ``async def`` handlers: one handler call at a time."""
        buf = self._buffer
        ready = self._ready
        batched = self.batch_size > 1
        held = self._held
        since = self._held_since
        flush_wake = self._flush_wake
        success = ConsumeResult.SUCCESS
        subs = self._subs
        n = 0
        while True:
            if self._stopping:
                return
            if not buf:
                ready.clear()
                await ready.wait()
                continue
            if batched:
                topic, msgs, _ = self._take(1)
                first = msgs[0]
                arg: Any = msgs
            else:  # _take(1), inlined: this loop is the consumer's hot path
                first, charge = buf.popleft()
                topic = first.topic
                self._buffered_bytes -= charge
                if (self._fetcher_idle and len(buf) <= self._refill_at
                        and self._buffered_bytes <= self._refill_bytes_at):
                    self._fetch_wake.set()
                arg = first
            sub = subs.get(topic)
            if sub is None:
                self._no_handler(topic, msgs if batched else [first])
                continue
            try:
                res = await sub.handler(arg)
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # close() cancels this worker
                res = self._failed(topic, first, exc)  # the handler's own cancellation
            except Exception as exc:  # noqa: BLE001 - any handler failure means "retry later"
                res = self._failed(topic, first, exc)
            if batched:
                self._settle_batch(msgs, res)
            elif res is None or res is success:  # the hot path of _settle_one, inlined
                held.pop(first, None)
                since.pop(first, None)
                self._acks.append(first)
                if not flush_wake.is_set():
                    flush_wake.set()
            else:
                self._settle_one(first, _decision(res, 1))
            n += 1
            if n >= YIELD_EVERY:
                n = 0
                await asyncio.sleep(0)

    async def _work_in_threads(self, pool: concurrent.futures.Executor) -> None:
        """A worker for plain handlers, run in ``pool``.

        A hop to a pool thread costs far more than a fast handler, so when many messages wait
        one hop makes several handler calls (fewer when few wait, so slow handlers still spread
        over every thread). The thread hands each outcome back as soon as it has it
        (:meth:`_post_outcome`), so a handler that hangs never holds back the acks of the
        calls before it, and it stops after ``THREAD_HOP_BUDGET_S``: the calls it did not
        start go back to the front of the buffer for any worker to take.
        """
        loop = asyncio.get_running_loop()
        buf = self._buffer
        ready = self._ready
        share = self.concurrency * self.batch_size
        size = self.batch_size
        while True:
            if self._halting():
                return
            if not buf:
                ready.clear()
                await ready.wait()
                continue
            calls = max(1, min(THREAD_CALLS_PER_HOP, len(buf) // share))
            topic, msgs, charge = self._take(calls)
            handler = self._handler(topic, msgs)
            if handler is None:
                continue
            try:
                done = await loop.run_in_executor(
                    pool, _call_in_thread, self, loop, topic, handler, msgs, size)
            except PoolClosedError:  # a close() that was interrupted shut the threads down
                for x in msgs:
                    self._settle_one(x, (0.0, "consumer closing: never handled", False))
                return
            rest = msgs[done * size :]
            if not rest:
                continue
            if self._halting():  # close() began: not started, so back to the group
                for x in rest:
                    self._settle_one(x, (0.0, "consumer closing: never handled", False))
                continue
            each = charge // len(msgs)
            buf.extendleft((x, each) for x in reversed(rest))
            self._buffered_bytes += each * len(rest)
            ready.set()

    def _post_outcome(self, loop: asyncio.AbstractEventLoop, topic: str,
                      part: list[LeasedMessage], res: object) -> None:
        """From a pool thread: queue one handler outcome for the loop thread (one wake-up for
        however many outcomes arrive before the loop gets to them)."""
        self._outcomes.append((topic, part, res))
        if not self._drain_scheduled:
            self._drain_scheduled = True
            loop.call_soon_threadsafe(self._drain_outcomes)

    def _drain_outcomes(self) -> None:
        self._drain_scheduled = False  # before draining: a later append schedules again
        outcomes = self._outcomes
        while outcomes:
            topic, part, res = outcomes.popleft()
            if isinstance(res, _Caught):
                res = self._failed(topic, part[0], res.exc)
            if self.batch_size > 1:
                self._settle_batch(part, res)
            else:
                self._settle_one(part[0], _decision(res, 1))

    def _failed(self, topic: str, first: LeasedMessage, exc: BaseException) -> _Raised:
        self.stats["handler_errors"] += 1
        log.warning("push consumer %s: handler of %r failed (%s, reconsume_times=%d)",
                    self.delivery_group, topic, first.msg_id, first.reconsume_times,
                    exc_info=exc)
        return _Raised(f"handler raised {type(exc).__name__}: {exc}"[:1024])

    def _settle_one(self, msg: LeasedMessage, decision: tuple[float, str, bool] | None) -> None:
        """Ack (``decision`` None) or nack with (delay, reason, counts); delay -1: the ladder."""
        self._held.pop(msg, None)
        self._held_since.pop(msg, None)
        if decision is None:
            self._acks.append(msg)
            self._wake_flusher()
            return
        delay, reason, counts = decision
        self._nacks.append((msg, None if delay < 0 else delay, reason, counts))
        self._wake_flusher()

    def _settle_batch(self, batch: list[LeasedMessage], res: object) -> None:
        if type(res) is int:
            n = min(max(res, 0), len(batch))
            for x in batch[:n]:
                self._settle_one(x, None)
            reason = f"batch handler acknowledged {n} of {len(batch)} messages"
            for x in batch[n:]:
                self._settle_one(x, (-1.0, reason, True))
            return
        decision = _decision(res, len(batch))
        for x in batch:
            self._settle_one(x, decision)

    # -- acks, nacks, renewals -----------------------------------------------------------------

    def _wake_flusher(self) -> None:
        if not self._flush_wake.is_set():
            self._flush_wake.set()

    async def _flush_loop(self) -> None:
        wake = self._flush_wake
        while True:
            await wake.wait()
            if len(self._acks) < ACK_BATCH and not self._stopping:
                await asyncio.sleep(ACK_LINGER_S)
            wake.clear()
            await self._flush()  # never cancelled: it holds acks it has taken from the list
            if self._draining and not self._acks and not self._nacks:
                return

    async def _flush(self) -> None:
        """Send every pending ack and nack (those waiting for a renewal stay pending)."""
        while True:
            acks, self._acks = self._acks, []
            nacks, self._nacks = self._nacks, []
            if self._renewing:
                renewing = self._renewing
                self._acks = [x for x in acks if x in renewing]
                acks = [x for x in acks if x not in renewing]
                self._nacks = [e for e in nacks if e[0] in renewing]
                nacks = [e for e in nacks if e[0] not in renewing]
            if not acks and not nacks:
                return
            for i in range(0, len(acks), MAX_ACK_ENTRIES):
                await self._send_slots.acquire()
                self._spawn_send(self._send_acks(acks[i : i + MAX_ACK_ENTRIES]))
            if nacks:
                await self._send_slots.acquire()
                self._spawn_send(self._send_nacks(nacks))

    def _spawn_send(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._sends.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sends.discard(task)
        self._send_slots.release()

    async def _send_acks(self, msgs: list[LeasedMessage]) -> None:
        try:
            results = await self._core.ack(msgs)
        except FerryMQError as exc:
            log.error("push consumer %s: ack of %d messages failed (they will be redelivered "
                      "when their leases expire): %s", self.delivery_group, len(msgs), exc)
            return
        self.stats["acked"] += len(msgs) - self._count_rejected(msgs, results, "ack")

    async def _send_nacks(self, entries: list[tuple[LeasedMessage, float | None, str, bool]]
                          ) -> None:
        groups: dict[tuple[float | None, str, bool], list[LeasedMessage]] = {}
        for msg, delay, reason, counts in entries:
            groups.setdefault((delay, reason, counts), []).append(msg)
        for (delay, reason, counts), msgs in groups.items():
            for i in range(0, len(msgs), MAX_ACK_ENTRIES):
                part = msgs[i : i + MAX_ACK_ENTRIES]
                try:
                    results = await self._core.nack(part, delay_s=delay, reason=reason,
                                                    counts=counts)
                except FerryMQError as exc:
                    log.error("push consumer %s: nack of %d messages failed (they will be "
                              "redelivered when their leases expire): %s", self.delivery_group,
                              len(part), exc)
                    continue
                bad = self._count_rejected(part, results, "nack")
                self.stats["nacked" if counts else "returned"] += len(part) - bad

    def _count_rejected(self, msgs: list[LeasedMessage], results: list[BrokerError | None],
                        what: str) -> int:
        bad = [(x, e) for x, e in zip(msgs, results, strict=True) if e is not None]
        if bad:
            self.stats["rejected"] += len(bad)
            x, e = bad[0]
            log.warning("push consumer %s: %d %s(s) rejected, e.g. %s: %s (the lease had "
                        "expired: the message was redelivered)", self.delivery_group, len(bad),
                        what, x.msg_id, e)
        return len(bad)

    async def _renew_loop(self) -> None:
        loop = asyncio.get_running_loop()
        inv = self.invisible_duration
        interval = max(0.01, inv / 6)
        while not self._draining:
            await asyncio.sleep(interval)  # close() cancels the renewer only here
            now = loop.time()
            limit = now + inv * 2 / 3  # renew what was leased a third of a lease ago
            due = [x for x, dl in self._held.items() if dl <= limit]
            if due:
                due = self._drop_timed_out(due, now)
            if due:
                self._renew_busy = True
                try:
                    await self._renew(due, loop)
                finally:
                    self._renew_busy = False

    def _drop_timed_out(self, due: list[LeasedMessage], now: float) -> list[LeasedMessage]:
        """Stop renewing messages held past ``consume_timeout`` (their leases then expire)."""
        cutoff = now - self.consume_timeout
        since = self._held_since
        late = [x for x in due if since.get(x, now) < cutoff]
        if not late:
            return due
        for x in late:
            self._held.pop(x, None)
            since.pop(x, None)
        log.warning("push consumer %s: %d message(s) held longer than consume_timeout=%.0f s; "
                    "their leases are left to expire (redelivered as failures)",
                    self.delivery_group, len(late), self.consume_timeout)
        lateset = set(late)
        return [x for x in due if x not in lateset]

    async def _renew(self, due: list[LeasedMessage], loop: asyncio.AbstractEventLoop) -> None:
        inv = self.invisible_duration
        self._renewing.update(due)
        try:
            for i in range(0, len(due), MAX_ACK_ENTRIES):
                part = due[i : i + MAX_ACK_ENTRIES]
                sent = loop.time()
                try:
                    results = await self._core.change_invisible(part, inv)
                except FerryMQError as exc:
                    log.warning("push consumer %s: lease renewal of %d messages failed: %s",
                                self.delivery_group, len(part), exc)
                    continue
                held = self._held
                lost = 0
                for x, err in zip(part, results, strict=True):
                    if err is None:
                        if x in held:
                            held[x] = sent + inv
                    elif held.pop(x, None) is not None:
                        self._held_since.pop(x, None)
                        lost += 1
                self.stats["renewed"] += len(part) - lost
                if lost:
                    log.warning("push consumer %s: %d leases had expired before renewal (the "
                                "messages went back to the group)", self.delivery_group, lost)
        finally:
            self._renewing.difference_update(due)
            if self._acks or self._nacks:
                self._wake_flusher()

    # -- shutdown ------------------------------------------------------------------------------

    async def _shutdown(self, timeout: float) -> None:
        # The fetcher stops after its RECEIVE in flight, if any, and hands back what that
        # brings. It is not cancelled yet: the broker would still lease to the long poll
        # (the hand-back below wakes it), and a cancelled answer's messages would stay with
        # this member until it leaves, after the running handlers.
        self._fetch_wake.set()
        # hand back what no handler started, at once and without counting an attempt
        if self._buffer:
            for x, _ in self._buffer:
                self._held.pop(x, None)
                self._held_since.pop(x, None)
                self._nacks.append((x, 0.0, "consumer closing: never handled", False))
            self._buffer.clear()
            self._buffered_bytes = 0
        self._wake_flusher()
        self._ready.set()  # idle workers see _stopping and return
        workers = self._workers
        if workers:
            _, running = await asyncio.wait(workers, timeout=0 if self._abandoned else timeout)
            if running:
                log.warning("push consumer %s: %d handlers still running after %.3g s; "
                            "cancelled (their messages go back to the group)",
                            self.delivery_group, len(running), timeout)
                for t in running:
                    t.cancel()
                await asyncio.wait(running)
        fetcher = self._fetcher
        if fetcher is not None:  # still long-polling: what it gets back goes back on leave
            fetcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await fetcher
        # renewals end with the handlers (a renewal in flight finishes: the new receipts
        # matter for the last acks); then the flusher sends the last acks and nacks
        self._draining = True
        renewer = self._renewer
        if renewer is not None:
            if not self._renew_busy:
                renewer.cancel()
            await asyncio.wait({renewer})  # (a crash was logged by _task_done)
        self._wake_flusher()
        if self._flusher is not None:
            await asyncio.wait({self._flusher})
        if self._sends:
            await asyncio.wait(set(self._sends))


@dataclass(frozen=True, slots=True)
class _Raised:
    reason: str


@dataclass(frozen=True, slots=True)
class _Caught:
    exc: BaseException


def _call_in_thread(consumer: AsyncPushConsumer, loop: asyncio.AbstractEventLoop, topic: str,
                    handler: Callable[[Any], Any], msgs: list[LeasedMessage], size: int) -> int:
    """Runs in a pool thread: handler calls over ``msgs``, each outcome posted to the loop as
    it comes; returns how many calls were made (it stops early on close() or past the hop
    budget)."""
    t0 = time.monotonic()
    done = 0
    for i in range(0, len(msgs), size):
        if done and (consumer._stopping or time.monotonic() - t0 > THREAD_HOP_BUDGET_S):
            break
        part = msgs[i : i + size]
        try:
            res: object = handler(part[0] if size == 1 else part)
        except Exception as exc:  # noqa: BLE001 - settled (and logged) on the loop thread
            res = _Caught(exc)
        consumer._post_outcome(loop, topic, part, res)
        done += 1
    return done


def _decision(res: object, n: int) -> tuple[float, str, bool] | None:
    """None (ack) or (delay, reason, counts) for a handler's result; delay -1: the ladder."""
    if res is None or res is ConsumeResult.SUCCESS:
        return None
    if res is ConsumeResult.LATER:
        return (-1.0, "handler returned LATER", True)
    if res is ConsumeResult.FAILURE:
        return (-1.0, "handler returned FAILURE", True)
    if isinstance(res, Later):
        return (res.delay, res.reason or f"handler asked to retry in {res.delay:g} s", True)
    if isinstance(res, _Raised):
        return (-1.0, res.reason, True)
    log.error("push consumer handler returned %r; expected a ConsumeResult%s (retried later)",
              res, " or an int" if n > 1 else "")
    return (-1.0, f"handler returned {type(res).__name__}, not a ConsumeResult", True)


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


class PushConsumer:
    """A push consumer for plain (blocking) handler functions, run on a pool of ``threads``.

    The same options and rules as :class:`AsyncPushConsumer` (see it for clustering and
    broadcasting, results and batches), with ``threads`` instead of ``concurrency``. Fetching,
    acks, lease renewal and heartbeats run on the client's event-loop thread, so a slow handler
    never starves them::

        consumer = PushConsumer("127.0.0.1:9876", "billing", threads=8)

        @consumer.subscribe("orders", "created || paid")
        def handle(msg: LeasedMessage) -> ConsumeResult:
            bill(msg.body)
            return ConsumeResult.SUCCESS

        with consumer:
            stop_requested.wait()

    :meth:`close` waits up to ``timeout`` seconds for running handlers; a handler still running
    then keeps running in its (daemon) thread, but its result is ignored and its message goes
    back to the group when the member leaves. Use ``with`` (or ``try``/``finally``) so that
    Ctrl-C closes the consumer; one still running when the program exits is closed then.
    """

    def __init__(self, servers: str | list[str] = "127.0.0.1:9876", group: str = "default", *,
                 threads: int = 8, **options: Any) -> None:
        from ferrymq.client.sync import _run  # the shared loop thread of the sync clients

        if threads < 1:
            raise ConfigError("threads must be >= 1")
        if "concurrency" in options:
            raise ConfigError("PushConsumer takes threads=, not concurrency=")
        options = rename_options(options)
        self._run = _run
        self._async: AsyncPushConsumer = _run(self._make(servers, group, threads, options))
        self._pool = HandlerThreads(threads, f"ferrymq-push-{group}"[:40])
        self._async._pool = self._pool

    @staticmethod
    async def _make(servers: str | list[str], group: str, threads: int,
                    options: dict[str, Any]) -> AsyncPushConsumer:
        return AsyncPushConsumer(servers, group, concurrency=threads, **options)

    @property
    def group(self) -> str:
        """The consumer group."""
        return self._async.group

    @property
    def delivery_group(self) -> str:
        """The delivery group this member is in (``<group>.<instance>`` when broadcasting)."""
        return self._async.delivery_group

    @property
    def member_id(self) -> str:
        """This member's id in its delivery group."""
        return self._async.member_id

    @property
    def stats(self) -> collections.Counter[str]:
        """Counters (see :class:`AsyncPushConsumer`)."""
        return self._async.stats

    @overload
    def subscribe(self, topic: str, tags: str = "*", handler: None = None) -> Callable[[SH], SH]:
        ...

    @overload
    def subscribe(self, topic: str, tags: str, handler: SH) -> SH:
        ...

    def subscribe(
        self, topic: str, tags: str = "*", handler: SH | None = None
    ) -> SH | Callable[[SH], SH]:
        """Call ``handler`` (in a pool thread) for the messages of ``topic`` matching ``tags``;
        without ``handler`` this is a decorator (see :meth:`AsyncPushConsumer.subscribe`).

        Raises:
            ConfigError: ``handler`` is an ``async def`` function (use AsyncPushConsumer).
        """
        if handler is None:
            return functools.partial(self._subscribe_decorator, topic, tags)
        if _is_async(handler):
            raise ConfigError("PushConsumer handlers are plain functions; use AsyncPushConsumer "
                              "for 'async def' handlers")
        self._run(self._register(topic, tags, handler))
        return handler

    def _subscribe_decorator(self, topic: str, tags: str, handler: SH) -> SH:
        return self.subscribe(topic, tags, handler)

    async def _register(self, topic: str, tags: str, handler: Callable[..., Any]) -> None:
        self._async._add_subscription(topic, tags, handler)

    def start(self) -> PushConsumer:
        """Join the group and start handling messages (see :meth:`AsyncPushConsumer.start`)."""
        self._run(self._async.start())
        _closed_at_exit(self)
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Stop gracefully (see :meth:`AsyncPushConsumer.close`).

        A ``KeyboardInterrupt`` while this waits for running handlers (a second Ctrl-C)
        abandons them: the consumer still sends its last acks and leaves the group (for at
        most ``ABANDON_WAIT_S``), then the interrupt goes on.
        """
        from ferrymq.client.sync import _LoopThread

        with _live_lock:
            _live.discard(self)
        loop = _LoopThread.get().loop
        fut = asyncio.run_coroutine_threadsafe(self._async.close(timeout), loop)
        try:
            try:
                fut.result()
            except KeyboardInterrupt:
                log.warning("push consumer %s: interrupted while closing; running handlers "
                            "are abandoned (their messages go back to the group)",
                            self.delivery_group)
                loop.call_soon_threadsafe(self._async._abandon_handlers)
                with contextlib.suppress(TimeoutError):
                    fut.result(ABANDON_WAIT_S)
                raise
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> PushConsumer:
        try:
            return self.start()
        except BaseException:
            self.close()  # no __exit__ follows a failed __enter__
            raise

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


_live: set[PushConsumer] = set()
"""Started PushConsumers not closed yet (closed at exit: see :func:`_close_live`)."""
_live_lock = threading.Lock()
_live_pid = 0  # the process whose exit hook is registered (a forked child registers its own)


def _closed_at_exit(consumer: PushConsumer) -> None:
    """Have ``consumer`` closed when the program exits, unless it is closed before."""
    global _live_pid
    with _live_lock:
        _live.add(consumer)
        if _live_pid != os.getpid():
            _live.intersection_update({consumer})  # a forked child: the parent's are not ours
            _live_pid = os.getpid()
            atexit.register(_close_live)


def _close_live() -> None:
    """At exit: close the push consumers the program left running (Ctrl-C outside a ``with``),
    so that they hand their messages back and leave their groups instead of holding leases
    until they expire."""
    with _live_lock:
        if _live_pid != os.getpid():
            return
        live = list(_live)
    for c in live:
        log.info("push consumer %s: still running at exit; closing it", c.delivery_group)
        with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: close() hurried up
            c.close()
