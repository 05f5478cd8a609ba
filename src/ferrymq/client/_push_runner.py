"""A running push consumer's tasks: the fetch and work loops, and the graceful shutdown.

Theory of operation
-------------------
:class:`PushRunner` owns what a started :class:`~ferrymq.client.push.AsyncPushConsumer` runs
on its event loop (the consumer's module docstring tells the whole story):

* the **fetcher** (:meth:`PushRunner.fetch_once`) keeps the prefetch buffer filled: when at
  least half of ``prefetch`` (or of ``prefetch_bytes``) is free it sends one long-polling
  RECEIVE for up to ``MAX_RECEIVE_BATCH`` messages; it never has more than one in flight;
* ``concurrency`` **workers** take messages from the buffer (``batch_size`` at a time, all of
  one topic), call the topic's handler and turn its result into an ack or a nack
  (:func:`ferrymq.client._push_results.decision`). For
  :class:`~ferrymq.client.push.PushConsumer` a worker runs the handler in a pool thread
  (:func:`call_in_thread`), several calls per hop when many messages wait; the thread posts
  each outcome back to the loop as it has it (one wake-up for however many arrive together);
* the flusher and the renewer, which send the acks and nacks and keep the leases of the held
  messages, belong to :class:`~ferrymq.client._push_leases.Leases`.

:meth:`PushRunner.shutdown` stops them in an order that loses nothing: fetching first (what no
handler started goes back at once, uncounted), then the handlers (``timeout``), then the
renewals, and the flusher last, with the final acks and nacks.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ferrymq.client._delivery import DeliveryCore, LeasedMessage
from ferrymq.client._push_leases import Leases
from ferrymq.client._push_results import Caught, ConsumeResult, Raised, decision
from ferrymq.client._threads import PoolClosedError
from ferrymq.client.retry import Backoff
from ferrymq.errors import FerryMQError

log = logging.getLogger("ferrymq.client")

MAX_RECEIVE_BATCH = 1024
"""Most messages one RECEIVE asks for (the broker caps it too); big enough to amortise the
request, small enough that one answer is a few hundred KiB of 100-byte messages."""
MIN_RECEIVE_BYTES = 256 * 1024
"""Smallest ``max_bytes`` of a RECEIVE (a producer's batch of a thousand small messages)."""
LONG_POLL_S = 2.0
"""How long one RECEIVE waits on the broker when nothing is there."""
THREAD_CALLS_PER_HOP = 64
"""Most handler calls one hop to a pool thread makes (when many messages wait)."""
THREAD_HOP_BUDGET_S = 0.05
"""A hop to a pool thread starts no new handler call after this long; the rest of its messages
go back to the buffer, so one slow handler does not hold up messages other threads could run."""
YIELD_EVERY = 64
"""A worker whose handlers never suspend yields to the loop after this many messages, so the
fetcher, the flusher and the heartbeat keep running."""


@dataclass(slots=True)
class Subscription:
    """A subscribed topic: its tag expression and its handler."""

    topic: str
    tags: str
    handler: Callable[[Any], Any]  # async def (AsyncPushConsumer) or plain (thread pool)


class PushRunner:
    """The fetch and work tasks of one push consumer, its prefetch buffer, and its
    :class:`~ferrymq.client._push_leases.Leases` (acks, nacks, renewals).

    Args:
        core: the member's delivery core (RECEIVE, ACK, NACK, CHANGE_INVISIBLE).
        subs: the consumer's subscriptions by topic (the same dict: changes take effect with
            the next fetch).
        delivery_group: the member's delivery group (for the logs).
        concurrency, batch_size, prefetch, prefetch_bytes, invisible_duration,
            consume_timeout: as :class:`~ferrymq.client.push.AsyncPushConsumer`'s options.
    """

    def __init__(self, core: DeliveryCore, subs: dict[str, Subscription], delivery_group: str,
                 *, concurrency: int, batch_size: int, prefetch: int, prefetch_bytes: int,
                 invisible_duration: float, consume_timeout: float) -> None:
        self._core = core
        self._subs = subs
        self.delivery_group = delivery_group
        self.concurrency = concurrency
        self.batch_size = batch_size
        self.prefetch = prefetch
        self.prefetch_bytes = prefetch_bytes
        self.invisible_duration = invisible_duration
        # the buffer: (message, bytes charged to prefetch_bytes), in delivery order
        self._buffer: collections.deque[tuple[LeasedMessage, int]] = collections.deque()
        self._buffered_bytes = 0
        self._receive_min = max(1, min(MAX_RECEIVE_BATCH, prefetch) // 2)
        self._refill_at = prefetch - self._receive_min  # wake the fetcher at or below this
        self._refill_bytes_at = prefetch_bytes // 2
        self._bytes_per_message = 1024  # running estimate (whole batches come: an upper bound)
        self.stats = collections.Counter[str]()
        self._leases = Leases(core, delivery_group, self.stats,
                              invisible_duration=invisible_duration,
                              consume_timeout=consume_timeout)
        # asyncio primitives bind to the loop on first use (the loop of start())
        self._ready = asyncio.Event()  # messages in the buffer (idle workers wait on it)
        self._fetch_wake = asyncio.Event()
        self._fetcher_idle = False
        self._fetcher: asyncio.Task[None] | None = None
        self._workers: list[asyncio.Task[None]] = []
        self.stopping = False  # close() began: no new fetch, no new handler call
        self._abandoned = False  # close() waits for no running handler (abandon)
        # handler outcomes posted by pool threads, settled on the loop thread
        self._outcomes: collections.deque[tuple[str, list[LeasedMessage], object]] = (
            collections.deque())
        self._drain_scheduled = False

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop,
              pool: concurrent.futures.Executor | None) -> None:
        """Start the fetcher, flusher, renewer and workers (handlers run in ``pool`` if
        given, else on the loop)."""
        self._fetcher = loop.create_task(self._fetch_loop(), name="ferrymq-push-fetch")
        background = self._leases.start(loop)
        self._workers = [
            loop.create_task(self._work() if pool is None else self._work_in_threads(pool),
                             name=f"ferrymq-push-worker-{i}")
            for i in range(self.concurrency)
        ]
        for t in (self._fetcher, *background, *self._workers):
            t.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("push consumer %s: task %s crashed", self.delivery_group,
                      task.get_name(), exc_info=task.exception())

    def forget(self) -> None:
        """Drop what a failed start received (the member left: its leases went back)."""
        self._buffer.clear()
        self._buffered_bytes = 0
        self._leases.forget()

    def keep(self, task: asyncio.Task[None]) -> None:
        """Hold ``task`` until it is done; :meth:`shutdown` waits for it."""
        self._leases.keep(task)

    def wake_fetcher(self) -> None:
        """Fetch now (a subscription changed)."""
        self._fetch_wake.set()

    def begin_close(self) -> None:
        """close() began: no new fetch, no new handler call, acks without lingering."""
        self.stopping = self._leases.stopping = True

    def abandon(self) -> None:
        """While closing: stop waiting for running handlers (a second Ctrl-C). Their workers
        are cancelled; the messages go back to the group when the member leaves."""
        self._abandoned = True
        if self.stopping:
            for t in self._workers:
                t.cancel()

    # -- fetching ------------------------------------------------------------------------------

    async def fetch_once(self, wait_s: float) -> None:
        """One RECEIVE (waiting up to ``wait_s`` on the broker) into the buffer."""
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
        if self.stopping:  # close() began while this receive was in flight
            self._leases.hand_back(msgs, "consumer closing")
            self._leases.wake_flusher()
            return
        self._leases.hold(msgs, sent)
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
        while not self.stopping:
            if (not self._subs or self.prefetch - len(self._buffer) < self._receive_min
                    or self.prefetch_bytes - self._buffered_bytes < self._refill_bytes_at):
                wake.clear()
                self._fetcher_idle = True
                await wake.wait()
                self._fetcher_idle = False
                continue
            try:
                await self.fetch_once(LONG_POLL_S)
                failures = 0
            except FerryMQError as exc:
                failures += 1
                log.warning("push consumer %s: receive failed (attempt %d): %s",
                            self.delivery_group, failures, exc)
                await asyncio.sleep(backoff.delay(failures))

    # -- handling ------------------------------------------------------------------------------

    def _halting(self) -> bool:
        return self.stopping  # a method: mypy would keep a narrowed attribute across awaits

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
            self._leases.settle_one(x, (0.0, "no handler for its topic", False))

    async def _work(self) -> None:
        """A worker for ``async def`` handlers: one handler call at a time."""
        buf = self._buffer
        ready = self._ready
        batched = self.batch_size > 1
        leases = self._leases
        held = leases.held
        since = leases.held_since
        flush_wake = leases.flush_wake
        success = ConsumeResult.SUCCESS
        subs = self._subs
        n = 0
        while True:
            if self.stopping:
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
                leases.settle_batch(msgs, res)
            elif res is None or res is success:  # the hot path of Leases.settle_one, inlined
                held.pop(first, None)
                since.pop(first, None)
                leases.acks.append(first)
                if not flush_wake.is_set():
                    flush_wake.set()
            else:
                leases.settle_one(first, decision(res, 1))
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
                    pool, call_in_thread, self, loop, topic, handler, msgs, size)
            except PoolClosedError:  # a close() that was interrupted shut the threads down
                for x in msgs:
                    self._leases.settle_one(x, (0.0, "consumer closing: never handled", False))
                return
            rest = msgs[done * size :]
            if not rest:
                continue
            if self._halting():  # close() began: not started, so back to the group
                for x in rest:
                    self._leases.settle_one(x, (0.0, "consumer closing: never handled", False))
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
            if isinstance(res, Caught):
                res = self._failed(topic, part[0], res.exc)
            if self.batch_size > 1:
                self._leases.settle_batch(part, res)
            else:
                self._leases.settle_one(part[0], decision(res, 1))

    def _failed(self, topic: str, first: LeasedMessage, exc: BaseException) -> Raised:
        self.stats["handler_errors"] += 1
        log.warning("push consumer %s: handler of %r failed (%s, reconsume_times=%d)",
                    self.delivery_group, topic, first.msg_id, first.reconsume_times,
                    exc_info=exc)
        return Raised(f"handler raised {type(exc).__name__}: {exc}"[:1024])

    # -- shutdown ------------------------------------------------------------------------------

    async def shutdown(self, timeout: float) -> None:
        """Stop every task gracefully (see :meth:`AsyncPushConsumer.close`); ``stopping`` is
        set."""
        # The fetcher stops after its RECEIVE in flight, if any, and hands back what that
        # brings. It is not cancelled yet: the broker would still lease to the long poll
        # (the hand-back below wakes it), and a cancelled answer's messages would stay with
        # this member until it leaves, after the running handlers.
        self._fetch_wake.set()
        # hand back what no handler started, at once and without counting an attempt
        leases = self._leases
        if self._buffer:
            leases.hand_back([x for x, _ in self._buffer], "consumer closing: never handled")
            self._buffer.clear()
            self._buffered_bytes = 0
        leases.wake_flusher()
        self._ready.set()  # idle workers see ``stopping`` and return
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
        # renewals end with the handlers; then the flusher sends the last acks and nacks
        await leases.finish()


def call_in_thread(runner: PushRunner, loop: asyncio.AbstractEventLoop, topic: str,
                   handler: Callable[[Any], Any], msgs: list[LeasedMessage], size: int) -> int:
    """Runs in a pool thread: handler calls over ``msgs``, each outcome posted to the loop as
    it comes; returns how many calls were made (it stops early on close() or past the hop
    budget)."""
    t0 = time.monotonic()
    done = 0
    for i in range(0, len(msgs), size):
        if done and (runner.stopping or time.monotonic() - t0 > THREAD_HOP_BUDGET_S):
            break
        part = msgs[i : i + size]
        try:
            res: object = handler(part[0] if size == 1 else part)
        except Exception as exc:  # noqa: BLE001 - settled (and logged) on the loop thread
            res = Caught(exc)
        runner._post_outcome(loop, topic, part, res)
        done += 1
    return done
