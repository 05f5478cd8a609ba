"""CLUSTER_METADATA, REPLICA_FETCH and OFFSET_FOR_EPOCH.

A single broker (no ``--metadata``) answers CLUSTER_METADATA with itself as the only broker and
the leader of every queue at epoch 0, so that clients take one path whether they talk to a
single broker or a cluster; it refuses the replicas' requests (it has no replicas).
"""

from __future__ import annotations

from ferrymq.broker.context import ClientConnection
from ferrymq.broker.topics import valid_topic_name
from ferrymq.errors import InvalidRequestError
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode


def cluster_metadata(conn: ClientConnection,
                     req: m.ClusterMetadataRequest) -> m.ClusterMetadataResponse:
    """Brokers, the controller and who leads each queue."""
    srv = conn.server
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


def replica_fetch(conn: ClientConnection, req: m.ReplicaFetchRequest) -> m.ReplicaFetchResponse:
    """A follower's fetch: only brokers of a cluster have followers."""
    raise InvalidRequestError("this broker is not part of a cluster (started without --metadata)")


def offset_for_epoch(conn: ClientConnection,
                     req: m.OffsetForEpochRequest) -> m.OffsetForEpochResponse:
    """A follower's question after a leader change: only brokers of a cluster have followers."""
    raise InvalidRequestError("this broker is not part of a cluster (started without --metadata)")
