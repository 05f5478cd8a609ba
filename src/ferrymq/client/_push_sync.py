"""The blocking push consumer: :class:`PushConsumer`, plain handler functions on a thread pool.

Theory of operation
-------------------
:class:`PushConsumer` is :class:`~ferrymq.client.push.AsyncPushConsumer` run on the sync
clients' loop thread (:mod:`ferrymq.client.sync`), with its handlers on a pool of daemon threads
(:mod:`ferrymq.client._threads`) that only the consumer stops, so the interpreter's exit never
pulls the pool from under the workers. Fetching, acks, lease renewal and heartbeats stay on the
loop thread: a slow handler never starves them.

Interrupting (Ctrl-C): leaving a ``with`` block (or ``try``/``finally``) on the
``KeyboardInterrupt`` closes the consumer gracefully; a second Ctrl-C during
:meth:`PushConsumer.close` stops waiting for the running handlers (they are abandoned, their
messages go back with the leave) and still leaves the group. A consumer the program never
closed is closed by an exit hook (``atexit``) the same way.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, overload

from ferrymq.client._push_results import is_async
from ferrymq.client._renamed import rename_options
from ferrymq.client._threads import HandlerThreads
from ferrymq.errors import ConfigError

if TYPE_CHECKING:
    from ferrymq.client.push import AsyncPushConsumer

log = logging.getLogger("ferrymq.client")

ABANDON_WAIT_S = 10.0
"""After a second Ctrl-C in :meth:`PushConsumer.close`, how long it still waits for the last
acks and the leave before it gives up."""
SH = TypeVar("SH", bound=Callable[..., Any])


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
        from ferrymq.client.push import AsyncPushConsumer  # (it re-exports this class)

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
        if is_async(handler):
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
