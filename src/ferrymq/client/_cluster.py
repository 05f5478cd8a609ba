"""A client's view of the cluster: who leads each queue, and one session per broker.

Theory of operation
-------------------
A client is given a bootstrap list (``"h1:9876,h2:9876,h3:9876"``), and its bootstrap
:class:`~ferrymq.client._session.Session` connects to one of them. :class:`Cluster` asks a
broker for CLUSTER_METADATA (the live brokers with their addresses and, per queue, the leader and
its epoch; :mod:`ferrymq.protocol.leaders` keeps the answers) and hands out the session to use
for a queue: :meth:`Cluster.route`. The producer sends each queue's batches, and the consumer
each queue's fetches, through the session of the queue's leader.

One session per broker id. The bootstrap session counts as the session of the broker it is
connected to (the broker id its HELLO answer gave), so a client of a single broker, which
answers as a cluster of one, keeps its one connection and routing costs two dict look-ups per
batch. Other brokers get a session of their own (:meth:`Session.for_broker`), made when a queue
is first routed to them; such a session gives up a lost connection after ``connect_timeout_s``,
and at once when the broker's port refuses it, since a leader that is gone is replaced by a
refresh, not waited for.

Refreshes happen on demand: when a topic is first used (:meth:`Cluster.ensure`, at once), and
when a request failed in a way that says the view is stale (NOT_LEADER, FENCED_LEADER_EPOCH,
LEADER_NOT_AVAILABLE, a lost connection to a leader: :meth:`Cluster.refresh_soon`). Concurrent
refreshes coalesce into one request, and those for errors are at least
``MIN_REFRESH_INTERVAL_S`` apart, so a burst of NOT_LEADER answers after a failover costs one
metadata request, not one per batch. The answer is asked of any live broker: the bootstrap
session if it is connected, else a broker session that is, else the bootstrap session, which
connects to one of the bootstrap list.

A consumer group's requests go to the group's coordinator
(:mod:`ferrymq.client._coordinator`, which routes through this class); other requests that are
not per queue (INIT_PRODUCER, transactions, admin) stay on the bootstrap session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from ferrymq.client._session import Session
from ferrymq.errors import (
    BrokerError,
    BrokerShuttingDownError,
    ConnectionClosedError,
    FencedLeaderEpochError,
    FerryMQError,
    FerryMQTimeoutError,
    LeaderNotAvailableError,
    NotLeaderError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.leaders import MIN_REFRESH_INTERVAL_S, Leaders, split_by_route

log = logging.getLogger("ferrymq.client")
T = TypeVar("T", bound=tuple[Any, ...])  # (topic, queue, ...)
R = TypeVar("R")

STALE_VIEW_ERRORS = (NotLeaderError, FencedLeaderEpochError, LeaderNotAvailableError,
                     ConnectionClosedError, BrokerShuttingDownError)
"""Errors of a per-queue request that say the client's view of the leaders may be stale (a
broker shutting down hands its queues over as it leaves)."""


def means_stale_view(exc: BaseException) -> bool:
    """Whether ``exc`` (a per-queue request's failure) calls for a metadata refresh."""
    return isinstance(exc, STALE_VIEW_ERRORS)


def _same_broker_retry_codes() -> frozenset[int]:
    out = set()
    for code in ErrorCode:
        exc = error_for_code(code, "") if code else None
        if isinstance(exc, BrokerError) and exc.retriable and not means_stale_view(exc):
            out.add(int(code))
    return frozenset(out)


SAME_BROKER_RETRY_CODES = _same_broker_retry_codes()
"""The retriable codes a per-queue request (FETCH, LIST_OFFSETS) retries on the same broker
(``Session.request(retry_codes=...)``); the others (NOT_LEADER, ...) mean another broker may
lead now: the caller refreshes the leaders instead."""


class Cluster:
    """Leaders and broker sessions of a client (see the module docstring).

    Args:
        bootstrap: the client's session over the bootstrap list (owned by the client: it
            closes it; :meth:`close` closes only the broker sessions made here).
        min_refresh_interval_s: least time between two refreshes asked for by errors.
    """

    def __init__(self, bootstrap: Session, *,
                 min_refresh_interval_s: float = MIN_REFRESH_INTERVAL_S) -> None:
        self.bootstrap = bootstrap
        self.leaders = Leaders()
        self.sessions: dict[int, Session] = {}
        """Sessions to brokers other than the bootstrap session's, by broker id."""
        self._min_interval_s = min_refresh_interval_s
        self._wanted: set[str] = set()  # topics to describe (the ones this client uses)
        self._refresh: asyncio.Task[None] | None = None
        self._again = False  # a refresh was asked for while one was in flight
        self._last_refresh = float("-inf")
        self._listeners: list[Callable[[], None]] = []
        self.refreshes = 0
        """Metadata answers received (tests and diagnostics)."""
        self._closed = False

    @property
    def min_refresh_interval_s(self) -> float:
        """Least time between two refreshes asked for by errors."""
        return self._min_interval_s

    # -- routing (the hot path) ----------------------------------------------------------------

    def route(self, topic: str, queue: int) -> Session | None:
        """The session to the leader of ``queue`` of ``topic`` (None: no live leader known;
        call :meth:`refresh_soon`)."""
        leader = self.leaders.leader(topic, queue)
        if leader is None:
            return None
        boot = self.bootstrap
        hello = boot.hello
        if hello is not None and hello.broker_id == leader:
            return boot
        s = self.sessions.get(leader)
        if s is None:
            if self._closed:  # no new session once closed (it would never be closed)
                return None
            s = self._session_for(leader)
        return s

    def split(self, items: Iterable[T]) -> tuple[dict[Session, list[T]], list[T]]:
        """``items`` (each starting with topic and queue) grouped by their leader's session,
        and those whose queue has no live leader known."""
        return split_by_route(items, self.route)

    async def split_routed(self, items: Iterable[T]) -> tuple[dict[Session, list[T]], list[T]]:
        """As :meth:`split`, after one refresh if some had no live leader known (a refresh
        that fails leaves them unrouted)."""
        groups, unrouted = self.split(items)
        if unrouted:
            topics = {str(item[0]) for item in unrouted}
            self._wanted.update(topics)
            with contextlib.suppress(FerryMQError):  # a topic's first use is not paced
                await self.refresh(paced=all(map(self.leaders.knows, topics)))
            more, unrouted = self.split(unrouted)
            for s, some in more.items():
                groups.setdefault(s, []).extend(some)
        return groups, unrouted

    async def every_broker(self) -> list[Session]:
        """A session to every live broker (the bootstrap one for its own broker), after a
        refresh; a single broker is a cluster of one.

        Raises:
            FerryMQError: no broker answered the refresh.
        """
        await self.refresh(paced=False)
        boot = self.bootstrap
        own = boot.hello.broker_id if boot.hello is not None else None
        out = [boot]
        for bid in sorted(self.leaders.brokers):
            if bid != own:
                out.append(self.sessions.get(bid) or self._session_for(bid))
        return out

    async def ask_leader(self, call: Callable[[Session], Awaitable[R]]) -> R:
        """``call`` through the bootstrap session and, when that broker answers NOT_LEADER
        (a request only a queue's leader answers, named by a message id: a topic id the
        client may not know by name), through every other live broker in turn, after one
        refresh; the first answer.

        Raises:
            NotLeaderError: no broker leads the queue now (a failover: retriable).
            BrokerError: another refusal, from the broker that leads the queue.
        """
        try:
            return await call(self.bootstrap)
        except (NotLeaderError, LeaderNotAvailableError) as exc:
            first = exc
        for s in (await self.every_broker())[1:]:
            try:
                return await call(s)
            except (NotLeaderError, LeaderNotAvailableError, ConnectionClosedError,
                    FerryMQTimeoutError):
                continue
        raise first

    def _session_for(self, broker_id: int) -> Session:
        host, port = self.leaders.brokers[broker_id]
        s = self.bootstrap.for_broker(host, port)
        self.sessions[broker_id] = s
        return s

    def _drop_moved_sessions(self) -> None:
        """Close sessions of brokers that left or now have another address."""
        for bid, s in list(self.sessions.items()):
            addr = self.leaders.brokers.get(bid)
            if addr is None or [addr] != s.addresses:
                del self.sessions[bid]
                task = asyncio.get_running_loop().create_task(s.close())
                task.add_done_callback(_ignore_result)

    # -- refreshing ----------------------------------------------------------------------------

    def on_refresh(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after every refresh (a producer's sender wakes up on it)."""
        self._listeners.append(callback)

    async def ensure(self, topic: str) -> None:
        """Know the leaders of ``topic``'s queues (one refresh if it is new to this client).

        Raises:
            FerryMQError: no broker answered within the request timeout.
        """
        if self.leaders.knows(topic):
            return
        self._wanted.add(topic)
        # a topic's first use is no error burst: it does not wait for the refresh interval
        await self.refresh(paced=False)
        if not self.leaders.knows(topic):  # the in-flight refresh did not ask for it
            await self.refresh(paced=False)

    def refresh_soon(self, topics: Iterable[str] = ()) -> None:
        """Ask for a refresh without waiting for it (coalesced with one in flight)."""
        self._wanted.update(topics)
        if self._closed:
            return
        if self._refresh is not None and not self._refresh.done():
            self._again = True
            return
        self._refresh = asyncio.get_running_loop().create_task(self._run_refresh())
        self._refresh.add_done_callback(_ignore_result)

    async def await_refresh(self, topics: Iterable[str]) -> None:
        """Refresh for ``topics`` (paced, coalesced with one in flight) and wait for it; a
        refresh that fails is left to the caller's next attempt. What a request refused for a
        stale view waits for before it is sent again."""
        self._wanted.update(topics)
        with contextlib.suppress(FerryMQError):
            await self.refresh()

    async def refresh(self, *, paced: bool = True) -> None:
        """Refresh (or join the refresh in flight, then run one more if others asked
        meanwhile) and wait for it; ``paced``: not sooner than ``min_refresh_interval_s``
        after the last one.

        Raises:
            FerryMQError: no broker answered within the request timeout.
        """
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.get_running_loop().create_task(self._run_refresh(paced))
            self._refresh.add_done_callback(_ignore_result)
        await asyncio.shield(self._refresh)

    async def _run_refresh(self, paced: bool = True) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._again = False
            wait = self._last_refresh + self._min_interval_s - loop.time()
            if wait > 0 and paced:
                await asyncio.sleep(wait)
            paced = True  # a refresh asked for meanwhile is paced
            try:
                resp = await self._ask()
            finally:
                self._last_refresh = loop.time()
            moved = self.leaders.update(resp)
            self.refreshes += 1
            if moved:
                log.info("leaders moved: %s", self.leaders.describe_moves(moved))
            self._drop_moved_sessions()
            for cb in self._listeners:
                cb()
            if not self._again or self._closed:
                return

    async def _ask(self) -> m.ClusterMetadataResponse:
        """CLUSTER_METADATA from any live broker (see the module docstring)."""
        req = m.ClusterMetadataRequest(sorted(self._wanted))
        boot = self.bootstrap
        candidates = [s for s in self.sessions.values() if s.open_connection is not None]
        if boot.open_connection is not None:
            candidates.insert(0, boot)
        if candidates and not self._closed:
            # then the other brokers the last answer listed: a bootstrap broker that hangs (its
            # connection open, no answer) must not hide the live ones from the client
            own = boot.hello.broker_id if boot.hello is not None else None
            candidates += [self.sessions.get(bid) or self._session_for(bid)
                           for bid in sorted(self.leaders.brokers) if bid != own
                           and (bid not in self.sessions
                                or self.sessions[bid].open_connection is None)]
        last: FerryMQError | None = None
        for s in candidates:
            try:  # a connected broker answers at once: a silent one must not hold the refresh
                return await s.request(req, m.ClusterMetadataResponse, retry=False,
                                       timeout_s=s.connect_timeout_s)
            except (ConnectionClosedError, FerryMQTimeoutError) as exc:
                last = exc
            except BrokerError as exc:  # shutting down, busy: another broker may answer
                if not exc.retriable:
                    raise
                last = exc
        try:
            return await boot.request(req, m.ClusterMetadataResponse)
        except FerryMQError as exc:
            raise exc from last

    async def close(self) -> None:
        """Stop refreshing; close the broker sessions (not the bootstrap one)."""
        self._closed = True
        if self._refresh is not None:
            self._refresh.cancel()
            with contextlib.suppress(BaseException):
                await self._refresh
        for s in self.sessions.values():
            await s.close()
        self.sessions.clear()


def _ignore_result(task: asyncio.Task[None]) -> None:
    """Done callback of a background task: its failure was logged or will be retried."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.debug("metadata refresh failed: %s", exc)
