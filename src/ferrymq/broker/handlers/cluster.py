"""CLUSTER_METADATA, ELECT_PREFERRED_LEADERS, DRAIN_BROKER, REASSIGN_QUEUE, REPLICA_FETCH and
OFFSET_FOR_EPOCH.

A single broker (no ``--metadata``) answers CLUSTER_METADATA with itself as the only broker and
the leader of every queue at epoch 0, so that clients take one path whether they talk to a
single broker or a cluster; it answers ELECT_PREFERRED_LEADERS with 0 (its one replica always
leads) and refuses the replicas' requests (it has no replicas). In a cluster
the replicas' requests go to the replica manager (``server.replicas``,
:mod:`ferrymq.cluster.replication`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable

from ferrymq.broker.acl import may
from ferrymq.broker.context import ClientConnection
from ferrymq.broker.topics import valid_topic_name
from ferrymq.errors import InvalidRequestError, UnknownTopicError
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.messages import Body

NOT_A_CLUSTER = "this broker is not part of a cluster (started without --metadata)"


def cluster_metadata(conn: ClientConnection,
                     req: m.ClusterMetadataRequest) -> m.ClusterMetadataResponse:
    """Brokers, the controller and who leads each queue (asked for every topic: of the topics
    the user may describe)."""
    resp = _cluster_metadata(conn, req)
    if req.topics is None and conn.principal is not None:
        srv, who = conn.server, conn.principal
        resp = dataclasses.replace(resp, topics=[
            t for t in resp.topics if may(srv, who, ("describe", t[0]))])
    return resp


def _cluster_metadata(conn: ClientConnection,
                      req: m.ClusterMetadataRequest) -> m.ClusterMetadataResponse:
    srv = conn.server
    if srv.cluster is not None:
        return srv.cluster.cluster_metadata(req)
    reg = srv.topics
    names = sorted(reg.topics) if req.topics is None else req.topics
    topics: list[m.TopicLeadership] = []
    me = srv.config.broker_id
    for name in names:
        t = reg.topics.get(name)
        if t is None:
            code = ErrorCode.UNKNOWN_TOPIC if valid_topic_name(name) else ErrorCode.INVALID_TOPIC_NAME
            topics.append((name, code, -1, 1, []))
            continue
        topics.append((t.name, ErrorCode.NONE, t.topic_id, 1,
                       [(q, me, 0, [me], [me]) for q in range(len(t.queues))]))
    host, port = srv.address
    return m.ClusterMetadataResponse("", me, [(me, host, port)], topics)


def elect_preferred_leaders(conn: ClientConnection, req: m.ElectPreferredLeadersRequest
                            ) -> m.ElectPreferredLeadersResponse | Awaitable[Body]:
    """Move leadership back to the preferred replicas (any broker of a cluster runs it:
    :func:`ferrymq.cluster.controller.elect_preferred_leaders`); a single broker moves none."""
    srv = conn.server
    if srv.cluster is not None:
        return srv.cluster.elect_preferred_leaders(req.topics)
    for name in req.topics or ():
        if name not in srv.topics.topics:
            raise UnknownTopicError(f"unknown topic {name[:249]!r}")
    return m.ElectPreferredLeadersResponse(0)


def drain_broker(conn: ClientConnection, req: m.DrainBrokerRequest
                 ) -> m.DrainBrokerResponse | Awaitable[Body]:
    """Move every leadership of a broker to other in-sync replicas (any broker of a cluster
    runs it: :func:`ferrymq.cluster.controller.drain_leaders`); a single broker refuses."""
    srv = conn.server
    if srv.cluster is None:
        raise InvalidRequestError("this broker is not part of a cluster: there is no other "
                                  "broker to move its queues' leadership to")
    return srv.cluster.drain_broker(req.broker_id)


def reassign_queue(conn: ClientConnection, req: m.ReassignQueueRequest
                   ) -> m.ReassignQueueResponse | Awaitable[Body]:
    """Start moving a queue to other replicas (any broker of a cluster:
    :func:`ferrymq.cluster.controller.reassign_queue`); a single broker refuses."""
    srv = conn.server
    if srv.cluster is None:
        raise InvalidRequestError("this broker is not part of a cluster: its queues have no "
                                  "replicas to move")
    return srv.cluster.reassign_queue(req.topic, req.queue, req.replicas)


def replica_fetch(conn: ClientConnection,
                  req: m.ReplicaFetchRequest) -> Body | Awaitable[Body]:
    """A follower's fetch: answered by the replica manager (only brokers of a cluster have
    followers)."""
    replicas = conn.server.replicas
    if replicas is None:
        raise InvalidRequestError(NOT_A_CLUSTER)
    return replicas.replica_fetch(conn, req)


def offset_for_epoch(conn: ClientConnection, req: m.OffsetForEpochRequest) -> Body:
    """A follower's question after a leader change: answered by the replica manager."""
    replicas = conn.server.replicas
    if replicas is None:
        raise InvalidRequestError(NOT_A_CLUSTER)
    return replicas.offset_for_epoch(req)
