"""Where a consumer group's requests go: the group's coordinator.

Theory of operation
-------------------
A single broker coordinates every group, so a client sends a group's requests (JOIN_GROUP,
HEARTBEAT, LEAVE_GROUP, COMMIT_OFFSETS, FETCH_OFFSETS, ...) through its bootstrap session, and
keeps doing so as long as no broker refuses them: one broker costs nothing more than before.

In a cluster the coordinator is the leader of the group's queue of ``%GROUPS%offsets``
(:mod:`ferrymq.protocol.coordinator`; the broker side is :mod:`ferrymq.broker.cluster_groups`).
Another broker answers NOT_COORDINATOR; then :class:`CoordinatorRoute` refreshes the cluster
metadata of that topic (through the client's :class:`~ferrymq.client._cluster.Cluster`: paced
and coalesced with its other refreshes), computes the group's queue from the group name, sends
the request to that queue's leader, and keeps that session for the group's next requests. The
same happens when the coordinator's connection is lost or it does not answer (it may have
died: the next leader of the queue takes over), until the request's deadline; a request that
ran out of time so makes the next one look for the coordinator first (a broker that hangs with
its connection open, the bootstrap one too, would otherwise take every request's whole
timeout). There is no FIND_COORDINATOR request: docs/design.md says why.

Transactions follow their coordinator the same way: the leader of ``%TXN%state``
(:data:`~ferrymq.protocol.coordinator.TXN_TOPIC`, one queue), with the transactional id in
place of the group name (``CoordinatorRoute(cluster, tid, TXN_TOPIC)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TypeVar

from ferrymq.client._cluster import Cluster
from ferrymq.client._session import Session
from ferrymq.errors import (
    BrokerError,
    ConnectionClosedError,
    FerryMQError,
    FerryMQTimeoutError,
    NotCoordinatorError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, TXN_TOPIC, coordinator_queue
from ferrymq.protocol.letters import RETRY_TOPIC_PREFIX

log = logging.getLogger("ferrymq.client")
B = TypeVar("B", bound=m.Body)


def _retry_codes() -> frozenset[int]:
    out = set()
    for code in ErrorCode:
        exc = error_for_code(code, "") if code else None
        if isinstance(exc, BrokerError) and exc.retriable and code != ErrorCode.NOT_COORDINATOR:
            out.add(int(code))
    return frozenset(out)


SAME_COORDINATOR_RETRY_CODES = _retry_codes()
"""The retriable codes a group request retries on the same broker; NOT_COORDINATOR means
another broker coordinates the group now: find it instead."""


class CoordinatorRoute:
    """The session that reaches ``group``'s coordinator (see the module docstring): the leader
    of queue ``coordinator_queue(group, n)`` of ``topic`` (of ``n`` queues), by default the
    group's queue of ``%GROUPS%offsets``; a delivery group's is its retry queue
    (:func:`delivery_route`)."""

    def __init__(self, cluster: Cluster, group: str, topic: str = OFFSETS_TOPIC, *,
                 queue_of: Callable[[str, int], int] = coordinator_queue) -> None:
        self._cluster = cluster
        self.group = group
        self.topic = topic
        self._queue_of = queue_of
        self.session: Session = cluster.bootstrap
        """Where the group's requests go now (the bootstrap session until a refusal)."""
        self._lost = False
        """A request to :attr:`session` got no answer or lost its connection: the next one
        looks for the coordinator first (it may have moved; the old one may hang)."""

    async def request(self, req: m.Request, resp_type: type[B], *,
                      timeout_s: float | None = None, retry: bool = True,
                      retry_codes: frozenset[int] | None = None) -> B:
        """``Session.request`` sent to the coordinator, found again (see the module
        docstring) while the deadline allows, even with ``retry=False``: NOT_COORDINATOR is
        answered before anything is done (a write whose coordinator moved during it may have
        been stored; sending it again stores the same offsets). A lost connection to the
        coordinator is followed to the next one only with ``retry``.

        Raises:
            BrokerError subclass, ConnectionClosedError, FerryMQTimeoutError.
        """
        loop = asyncio.get_running_loop()
        boot = self._cluster.bootstrap
        total = boot.request_timeout_s if timeout_s is None else timeout_s
        deadline = loop.time() + total
        codes = SAME_COORDINATOR_RETRY_CODES if retry_codes is None else (
            retry_codes - {ErrorCode.NOT_COORDINATOR})
        if self._lost:
            self._lost = False
            with contextlib.suppress(FerryMQError):
                await self.find()
        while True:
            s = self.session
            try:
                return await s.request(req, resp_type, retry=retry, retry_codes=codes,
                                       timeout_s=max(deadline - loop.time(), 0.001))
            except NotCoordinatorError:
                if loop.time() >= deadline:
                    raise
            except (ConnectionClosedError, FerryMQTimeoutError):
                if not retry or loop.time() >= deadline:
                    self._lost = True  # the next request looks for the coordinator first
                    raise
                # a coordinator lost or silent (the bootstrap's broker too: it may hang with
                # its connection open): the next leader of the group's queue takes over
            await self.find()

    @property
    def request_timeout_s(self) -> float:
        """The bootstrap session's request timeout."""
        return self._cluster.bootstrap.request_timeout_s

    @property
    def client_id(self) -> str:
        """The bootstrap session's client id."""
        return self._cluster.bootstrap.client_id

    async def find(self) -> None:
        """Refresh the leaders of the coordinators' topic and route to the group's queue's
        leader (the bootstrap session while none is known: its broker asks the cluster to
        create the topic, and answers NOT_COORDINATOR until then)."""
        cluster = self._cluster
        topic = self.topic
        await cluster.await_refresh([topic])  # paced: at most one per interval
        n = cluster.leaders.queue_count(topic)
        s = cluster.route(topic, self._queue_of(self.group, n)) if n else None
        if s is None:
            await asyncio.sleep(cluster.min_refresh_interval_s)
            s = cluster.bootstrap
        if s is not self.session:
            log.info("%s %s: coordinator at %s", "transactional id" if self.topic == TXN_TOPIC
                     else "group", self.group, s.addresses)
        self.session = s


def delivery_route(cluster: Cluster, group: str) -> CoordinatorRoute:
    """The route to delivery group ``group``'s coordinator: the leader of its retry queue
    ``%RETRY%<group>`` (one queue; :mod:`ferrymq.broker.cluster_delivery`)."""
    return CoordinatorRoute(cluster, group, topic=RETRY_TOPIC_PREFIX + group,
                            queue_of=lambda _group, _n: 0)
