"""The admin client's cluster calls: describe the cluster, elect preferred leaders, drain a
broker, reassign a queue (part of :class:`~ferrymq.client.admin.AsyncAdminClient`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ferrymq.client._admin_results import ClusterDescription, DrainResult, Reassignment
from ferrymq.protocol import messages as m

if TYPE_CHECKING:
    from ferrymq.client._session import Session


class ClusterAdminCalls:
    """Cluster calls of the admin client (mixed into ``AsyncAdminClient``, whose session they
    use)."""

    _session: Session

    async def cluster_describe(self) -> ClusterDescription:
        """The brokers (alive, with their addresses), the controller and, per queue, its
        leader, leader epoch, replicas and in-sync replicas; offline and under-replicated
        queues first. A single broker describes itself as a cluster of one."""
        return ClusterDescription.from_wire(await self._session.request(
            m.ClusterMetadataRequest(None), m.ClusterMetadataResponse))

    async def elect_preferred_leaders(self, topics: list[str] | None = None) -> int:
        """Move each queue's leadership (of ``topics``; None: of every topic) back to its
        preferred replica, the first of its replicas, where that broker is alive and in the
        ISR; the number of queues moved. Any broker of a cluster does it; a single broker
        moves none.

        Raises:
            UnknownTopicError: a named topic does not exist.
        """
        resp = await self._session.request(m.ElectPreferredLeadersRequest(topics),
                                           m.ElectPreferredLeadersResponse)
        return resp.moved

    async def drain_broker(self, broker_id: int) -> DrainResult:
        """Move the leadership of every queue broker ``broker_id`` leads to another replica
        alive and in its ISR, before maintenance of that broker (it stays a follower, and the
        leaderships stay moved until it restarts or :meth:`elect_preferred_leaders` runs). Any
        broker of a cluster does it.

        Returns:
            How many queues moved, and how many it still leads (no other replica alive and in
            sync: stopping it makes them unavailable until it is back).

        Raises:
            InvalidRequestError: ``broker_id`` is not a live broker, or this is a single broker.
        """
        resp = await self._session.request(m.DrainBrokerRequest(broker_id),
                                           m.DrainBrokerResponse)
        return DrainResult(resp.moved, resp.left)

    async def reassign_queue(self, topic: str, queue: int, replicas: Sequence[int]
                             ) -> Reassignment:
        """Start moving ``queue`` of ``topic`` to the brokers ``replicas`` (the first is the
        preferred leader), e.g. to replace a machine: the new brokers copy the queue as
        followers, and once every one is in sync the controller makes ``replicas`` the queue's
        replicas (leadership moves if the leader is not among them). Returns at once; the
        queue's replicas in :meth:`cluster_describe` show the old and new brokers until it is
        done. Any broker of a cluster does it.

        Raises:
            UnknownTopicError, UnknownQueueError: no such topic or queue.
            InvalidReplicationFactorError: ``replicas`` empty, repeating a broker, naming one
                that is not live, or fewer than the topic's ``min_insync``.
            InvalidRequestError: a single broker (no replicas to move).
        """
        resp = await self._session.request(
            m.ReassignQueueRequest(topic, queue, list(replicas)), m.ReassignQueueResponse)
        return Reassignment(resp.adding, resp.removing)
