"""Which broker a Spark worker sends a queue's requests to: its leader.

Theory of operation
-------------------
On a cluster a queue is read from and written to its leader only (others answer NOT_LEADER).
A :class:`Router` per :class:`~ferrymq.spark._wire.WireConfig` and process (:func:`router`)
keeps the leader table the asyncio clients use (:class:`ferrymq.protocol.leaders.Leaders`), fed
with CLUSTER_METADATA answers asked of the bootstrap connection (any broker answers; the
connection goes to the first of ``servers`` that is up), and hands out the cached blocking
connection to a queue's leader (:meth:`Router.connection`): the bootstrap connection itself when
the leader is the broker it is connected to, so a single broker, which answers as a cluster of
one, keeps its one connection; otherwise a connection to the leader's advertised address with
the same security options.

A consumer group's requests (FETCH_OFFSETS, COMMIT_OFFSETS) go to its coordinator
(:meth:`Router.group_request`): the bootstrap connection first, as on a single broker; on
NOT_COORDINATOR or a lost connection, the leader of the group's queue of the offsets topic
(:mod:`ferrymq.protocol.coordinator`), as the asyncio clients find it. Transaction requests
(INIT_TXN, END_TXN, DESCRIBE_TXNS, COMMIT_STAGED, ABORT_STAGED) go to the transaction
coordinator the same way (:meth:`Router.txn_request`: the leader of ``%TXN%state``).

Callers refresh (:meth:`Router.refresh`) when an answer says the view is stale
(:data:`~ferrymq.protocol.leaders.STALE_VIEW_CODES`) or a leader's connection is lost, and send
again within their own time limits. Refreshes are at least ``MIN_REFRESH_INTERVAL_S`` apart, so
the tasks of a worker hitting a failover together cost one metadata request, not one each.

A leader that died is still named by every broker until its lease runs out and another replica
takes over (seconds): meanwhile connecting to it is refused. :meth:`Router.split` therefore
counts such a queue with those that have no leader (the caller refreshes and tries it again),
as a refused connection is just what a failover looks like from outside; only the caller's
time limit, a :class:`RetryWindow` (the source's option ``retryTimeout``), turns a failover
that does not end into an error. The bootstrap brokers may be among the dead: a leader is
reached at its advertised address when none of them answers, and metadata is asked of any
broker the table knows (:meth:`Router.ask`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, TypeVar

from ferrymq.errors import (
    BrokerError,
    ConnectionClosedError,
    FerryMQError,
    FerryMQTimeoutError,
    LeaderNotAvailableError,
    NotCoordinatorError,
    UnknownTopicError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, TXN_TOPIC, coordinator_queue
from ferrymq.protocol.leaders import (
    MIN_REFRESH_INTERVAL_S,
    STALE_VIEW_CODES,
    Leaders,
    split_by_route,
)
from ferrymq.spark import _wire

log = logging.getLogger("ferrymq.spark")
T = TypeVar("T", bound=tuple[Any, ...])  # (topic, queue, ...)
B = TypeVar("B", bound=m.Body)


def _server(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Router:
    """The leaders of the queues a process uses, and connections to them (module docstring)."""

    def __init__(self, wire: _wire.WireConfig) -> None:
        self.wire = wire
        self.leaders = Leaders()
        self._wanted: set[str] = set()
        self._last_refresh = float("-inf")
        self.refreshes = 0
        """Metadata answers received (tests and diagnostics)."""
        self.unreachable: dict[int, FerryMQError] = {}
        """Brokers whose connection failed at the last attempt, with the error (for messages)."""

    def connection(self, topic: str, queue: int) -> _wire.BlockingConnection | None:
        """The connection to the leader of ``queue`` of ``topic`` (a refresh first if the
        topic is new here); None: no live leader known now.

        Raises:
            UnknownTopicError: the brokers do not know ``topic`` (deleted, or never created).
            ConnectionClosedError, FerryMQTimeoutError: no broker answered the refresh, or the
                leader did not answer (it may have died: refresh, then try again).
            AuthenticationFailedError: a broker refused the user.
        """
        if not self.leaders.knows(topic):
            self.refresh([topic], paced=False)
            if not self.leaders.knows(topic):
                raise UnknownTopicError(f"unknown topic {topic[:249]!r} on {self.wire}")
        leader = self.leaders.leader(topic, queue)
        return None if leader is None else self.broker(leader)

    def broker(self, broker_id: int) -> _wire.BlockingConnection:
        """The connection to live broker ``broker_id``: the bootstrap connection when that is
        the broker it reached, else one to the broker's advertised address.

        Raises:
            ConnectionClosedError, FerryMQTimeoutError: the broker did not answer.
            AuthenticationFailedError: it refused the user.
        """
        try:
            boot: _wire.BlockingConnection | None = _wire.connection(self.wire)
        except (ConnectionClosedError, FerryMQTimeoutError):
            boot = None  # every bootstrap broker is down; the leader need not be
        try:
            if boot is not None and boot.hello is not None and boot.hello.broker_id == broker_id:
                conn = boot
            else:
                host, port = self.leaders.brokers[broker_id]
                conn = _wire.connection(replace(self.wire, servers=_server(host, port)))
        except (ConnectionClosedError, FerryMQTimeoutError) as exc:
            self.unreachable[broker_id] = exc
            raise
        self.unreachable.pop(broker_id, None)
        return conn

    def split(self, items: Iterable[T]) -> tuple[dict[_wire.BlockingConnection, list[T]], list[T]]:
        """``items`` (each starting with topic and queue) grouped by their leader's connection,
        and those whose queue has no leader reachable now: none known, or its broker (or, for
        a topic new here, every broker) did not answer; the caller refreshes and tries those
        again (:meth:`no_route` says why). A dead broker is tried once per call.

        Raises:
            UnknownTopicError: the brokers do not know a topic of ``items``.
            AuthenticationFailedError: a broker refused the user.
        """
        down: set[int] = set()

        def route(topic: str, queue: int) -> _wire.BlockingConnection | None:
            leader = self.leaders.leader(topic, queue)
            if leader in down:
                return None
            try:
                return self.connection(topic, queue)
            except (ConnectionClosedError, FerryMQTimeoutError) as exc:
                if leader is not None:
                    down.add(leader)
                log.info("no route to %s/%d (%s); will retry", topic, queue, exc)
                return None

        return split_by_route(items, route)

    def no_route(self, topic: str, queue: int) -> LeaderNotAvailableError:
        """The error of a request to ``queue`` of ``topic`` that found no leader to go to:
        none known, or the one known does not answer."""
        leader = self.leaders.leader(topic, queue)
        if leader is None:
            return LeaderNotAvailableError(f"no live leader of {topic}/{queue} known")
        host, port = self.leaders.brokers[leader]
        why = self.unreachable.get(leader, "no answer")
        return LeaderNotAvailableError(f"the leader of {topic}/{queue}, broker {leader} at "
                                       f"{_server(host, port)}, is unreachable: {why}")

    def refresh(self, topics: Iterable[str] = (), *, paced: bool = True) -> None:
        """Ask a broker who leads the queues of ``topics`` and of every topic asked about
        before (``paced``: not sooner than ``MIN_REFRESH_INTERVAL_S`` after the last refresh).

        Raises:
            ConnectionClosedError, FerryMQTimeoutError: no broker answered.
            AuthenticationFailedError: a broker refused the user.
        """
        self._wanted.update(topics)
        wait = self._last_refresh + MIN_REFRESH_INTERVAL_S - time.monotonic()
        if paced and wait > 0:
            time.sleep(wait)
        req = m.ClusterMetadataRequest(sorted(self._wanted))
        try:
            resp = self.ask(req, m.ClusterMetadataResponse)
        finally:
            self._last_refresh = time.monotonic()
        moved = self.leaders.update(resp)
        self.refreshes += 1
        if moved:
            log.info("leaders moved: %s", self.leaders.describe_moves(moved))

    def refresh_quietly(self, topics: Iterable[str]) -> None:
        """:meth:`refresh` after a stale answer; a failed one is logged and left to the
        caller's next attempt (during a failover no broker may answer for a moment)."""
        try:
            self.refresh(topics)
        except (ConnectionClosedError, FerryMQTimeoutError) as exc:
            log.info("leader refresh failed (%s); retrying", exc)
            time.sleep(0.2)

    def request(self, topic: str, queue: int, req: m.Request, resp_type: type[B], *,
                code: Callable[[B], int], timeout_s: float) -> B:
        """Send ``req`` (safe to repeat) to the leader of ``queue`` of ``topic`` and return the
        answer, looking the leader up again while ``code(answer)`` says the view is stale or
        the leader is unreachable, for up to ``timeout_s``.

        Raises:
            LeaderNotAvailableError, NotLeaderError, ...: still no leader answered in time.
            ConnectionClosedError, FerryMQTimeoutError: likewise.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            err: FerryMQError
            try:
                conn = self.connection(topic, queue)
                if conn is None:
                    err = self.no_route(topic, queue)
                else:
                    resp = conn.request(req, resp_type)
                    c = code(resp)
                    if c not in STALE_VIEW_CODES:
                        return resp
                    err = error_for_code(c, f"{topic}/{queue}")
            except (ConnectionClosedError, FerryMQTimeoutError) as exc:
                err = exc
            if time.monotonic() >= deadline:
                raise err
            time.sleep(0.1)
            self.refresh_quietly([topic])

    def group_request(self, group: str, req: m.Request, resp_type: type[B], *,
                      timeout_s: float) -> B:
        """Send ``req`` (safe to repeat) to ``group``'s coordinator and return the answer
        (see the module docstring), for up to ``timeout_s``.

        Raises:
            NotCoordinatorError, ConnectionClosedError, FerryMQTimeoutError: still no
                coordinator answered in time; BrokerError: the coordinator's refusal.
        """
        return self._coordinator_request(OFFSETS_TOPIC, group, req, resp_type, timeout_s)

    def txn_request(self, req: m.Request, resp_type: type[B], *, timeout_s: float) -> B:
        """Send ``req`` to the transaction coordinator (the leader of ``%TXN%state``), as
        :meth:`group_request` does for a group. A request that is not safe to repeat is sent
        again only after NOT_COORDINATOR (nothing done) or a lost connection (its callers
        take the second answer for the first: a repeated COMMIT_STAGED is
        BATCH_ALREADY_COMMITTED, a repeated stage or abort is answered as the first).

        Raises:
            As :meth:`group_request`.
        """
        return self._coordinator_request(TXN_TOPIC, "", req, resp_type, timeout_s)

    def _coordinator_request(self, topic: str, key: str, req: m.Request, resp_type: type[B],
                             timeout_s: float) -> B:
        deadline = time.monotonic() + timeout_s
        conn = _wire.connection(self.wire)
        while True:
            try:
                return conn.request(req, resp_type, attempts=1)
            except (NotCoordinatorError, ConnectionClosedError, FerryMQTimeoutError):
                if time.monotonic() >= deadline:
                    raise
            time.sleep(0.1)
            self.refresh_quietly([topic])
            n = self.leaders.queue_count(topic)
            try:
                coordinator = (self.connection(topic, coordinator_queue(key, n))
                               if n else None)
            except (ConnectionClosedError, FerryMQTimeoutError):
                coordinator = None  # gone: the bootstrap broker, then look again
            conn = coordinator or _wire.connection(self.wire)

    def ask(self, req: m.Request, resp_type: type[B]) -> B:
        """Send ``req`` (metadata: any broker answers) to the bootstrap connection, else to any
        broker the table knows (the bootstrap list may name only brokers that are down now).

        Raises:
            ConnectionClosedError, FerryMQTimeoutError: no broker answered (the bootstrap
                connection's error).
            BrokerError: the broker's refusal.
        """
        try:
            return _wire.connection(self.wire).request(req, resp_type)
        except (ConnectionClosedError, FerryMQTimeoutError) as exc:
            first: FerryMQError = exc
        for host, port in list(self.leaders.brokers.values()):
            try:
                conn = _wire.connection(replace(self.wire, servers=_server(host, port)))
                return conn.request(req, resp_type, attempts=1)
            except (ConnectionClosedError, FerryMQTimeoutError):
                continue
        raise first


class RetryWindow:
    """How long a worker keeps retrying one piece of work through a failover: from the first
    failure of a run of failures, ``timeout_s`` (the source's option ``retryTimeout``); a
    success closes the run. Past it, :meth:`failed` raises the last failure, saying so."""

    def __init__(self, what: str, timeout_s: float) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self._until = 0.0

    def failed(self, exc: FerryMQError) -> None:
        """Note a failed attempt (``exc``: a lost connection, a timeout or a retriable broker
        error); the caller refreshes and tries again.

        Raises:
            the kind of ``exc``: the window is over (the message names ``what``, the time and
                the option, then ``exc``'s).
        """
        now = time.monotonic()
        self._until = self._until or now + self.timeout_s
        if now < self._until:
            log.info("%s failed (%s); retrying", self.what, exc)
            return
        msg = (f"{self.what}: still failing after {self.timeout_s:g} s of retries "
               f"(option 'retryTimeout'): {exc}")
        if isinstance(exc, BrokerError):
            raise error_for_code(exc.code, msg) from exc
        if isinstance(exc, FerryMQTimeoutError):
            raise FerryMQTimeoutError(msg) from exc
        raise ConnectionClosedError(msg) from exc

    def succeeded(self) -> None:
        """An attempt worked: a later failure starts a new window."""
        self._until = 0.0


_ROUTERS: dict[_wire.WireConfig, Router] = {}


def router(target: _wire.WireConfig | str) -> Router:
    """The router of this process for ``target`` (kept across tasks, as connections are)."""
    wire = target if isinstance(target, _wire.WireConfig) else _wire.WireConfig(target)
    r = _ROUTERS.get(wire)
    if r is None:
        r = _ROUTERS[wire] = Router(wire)
    return r


def forget(wire: _wire.WireConfig) -> None:
    """Drop the router for ``wire`` and close its connections (bootstrap and leaders)."""
    r = _ROUTERS.pop(wire, None)
    _wire.forget(wire)
    if r is not None:
        for host, port in r.leaders.brokers.values():
            _wire.forget(replace(wire, servers=_server(host, port)))
