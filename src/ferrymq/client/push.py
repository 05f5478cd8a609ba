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

Where each part lives: this module is the public surface (:class:`AsyncPushConsumer`: options,
subscriptions, start and close; the names of broadcasting members); what handlers return is
:mod:`ferrymq.client._push_results`; the fetcher and the workers are
:mod:`ferrymq.client._push_runner`; the flusher and the renewer
:mod:`ferrymq.client._push_leases`; the blocking :class:`PushConsumer` is
:mod:`ferrymq.client._push_sync`. All of them are importable from here.

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
import collections
import concurrent.futures
import functools
import itertools
import logging
import os
import re
import socket
import threading
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar, overload

from ferrymq import tracing
from ferrymq.client._delivery import DeliveryCore
from ferrymq.client._push_results import ConsumeResult, HandlerResult, Later, is_async
from ferrymq.client._push_runner import PushRunner, Subscription
from ferrymq.client._push_sync import PushConsumer
from ferrymq.client._renamed import renamed
from ferrymq.client._session import Auth, Session, TLSOption
from ferrymq.errors import ConfigError, FerryMQError
from ferrymq.protocol.letters import delivery_group_name_problem

__all__ = [
    "AsyncPushConsumer",
    "ConsumeResult",
    "HandlerResult",
    "Later",
    "PushConsumer",
    "broadcast_group",
    "default_instance_name",
    "next_instance_name",
]

log = logging.getLogger("ferrymq.client")

_GROUP_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_MAX_GROUP_CHARS = 200

AH = TypeVar("AH", bound=Callable[..., Awaitable[Any]])


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
        self._subs: dict[str, Subscription] = {}
        self._runner = PushRunner(self._core, self._subs, self.delivery_group,
                                  concurrency=concurrency, batch_size=batch_size,
                                  prefetch=prefetch, prefetch_bytes=prefetch_bytes,
                                  invisible_duration=self.invisible_duration,
                                  consume_timeout=self.consume_timeout)
        self._closed = False
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: concurrent.futures.Executor | None = None  # set by PushConsumer
        self.stats: collections.Counter[str] = self._runner.stats
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
        if not is_async(handler):
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
                await self._runner.fetch_once(0.0)
        except BaseException:
            await self._core.close()  # leave again (what the receive leased goes back)
            self._runner.forget()
            raise
        self._started = True
        self._runner.start(loop, self._pool)
        return self

    async def close(self, timeout: float = 30.0) -> None:
        """Stop gracefully: stop fetching, hand back buffered messages no handler started,
        wait up to ``timeout`` seconds for running handlers (cancelling those still running
        then), send their acks and nacks, leave the group and disconnect."""
        if self._closed:
            return
        self._closed = True
        self._runner.begin_close()
        try:
            if self._started:
                await self._runner.shutdown(timeout)
            await self._core.close()
        finally:
            await self._session.close()

    def _abandon_handlers(self) -> None:
        """While closing: stop waiting for running handlers (a second Ctrl-C). Their workers
        are cancelled; the messages go back to the group when the member leaves."""
        self._runner.abandon()

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
        if tracing.ENABLED:  # wrapped once here: the workers' hot path stays as it is
            handler = tracing.traced_handler(handler, self.group)
        self._subs[topic] = Subscription(topic, tags, handler)
        if self._started and not self._runner.stopping and self._loop is not None:
            self._loop.call_soon_threadsafe(self._subscribed)

    def _subscribed(self) -> None:
        assert self._loop is not None
        self._runner.keep(self._loop.create_task(self._join_quietly()))

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
        self._runner.wake_fetcher()
