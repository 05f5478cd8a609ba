"""HELLO, PING, topic metadata and administration, producer ids."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from ferrymq._version import __version__
from ferrymq.broker.acl import may
from ferrymq.broker.topics import valid_topic_name
from ferrymq.errors import InvalidTopicNameError, TopicAlreadyExistsError, UnknownTopicError
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode

if TYPE_CHECKING:
    from ferrymq.broker.context import ClientConnection

log = logging.getLogger("ferrymq.broker")


def hello(conn: ClientConnection, req: m.HelloRequest) -> m.HelloResponse:
    """Record who the client is; tell it our limits."""
    conn.client_id = req.client_id[:256]
    c = conn.server.config
    if log.isEnabledFor(logging.DEBUG):
        log.debug("connection %s: hello from client %r, FerryMQ %s%s", conn.peer,
                  conn.client_id, req.client_version[:64],
                  "" if conn.server.auth is not None else " (authentication off: no user)")
    return m.HelloResponse(__version__, c.broker_id, c.max_frame_bytes, c.max_message_bytes,
                           c.max_batch_records, c.flush, c.max_delay_ms)


def ping(conn: ClientConnection, req: m.PingRequest) -> m.Empty:
    """Keepalive."""
    return m.Empty()


def metadata(conn: ClientConnection,
             req: m.MetadataRequest) -> m.MetadataResponse | Awaitable[m.MetadataResponse]:
    """Topics with ids and queue counts; creates missing topics when asked and allowed.

    A name that is not valid is answered INVALID_TOPIC_NAME in its entry. A creation refused by
    a limit (``max_topics``, ``max_total_queues``, ``auto_create_topics_per_minute``) refuses
    the request with POLICY_VIOLATION, whose message names the topic and the limit (an entry
    carries no message); topics created before it in the same request stay.
    """
    srv = conn.server
    reg = srv.topics
    if srv.cluster is not None and req.topics is not None and req.auto_create \
            and srv.config.auto_create_topics and any(n not in reg.topics for n in req.topics):
        return _cluster_metadata_creating(conn, req)
    if req.topics is None:  # every topic the user may describe (Kafka's Metadata)
        who = conn.principal
        return m.MetadataResponse(
            [(t.name, t.topic_id, len(t.queues), 0, t.dedup_window_ms)
             for t in sorted(reg.topics.values(), key=lambda t: t.name)
             if may(srv, who, ("describe", t.name))]
        )
    out: list[m.TopicMeta] = []
    for name in req.topics:
        t = reg.topics.get(name)
        if t is None and req.auto_create and srv.config.auto_create_topics:
            try:
                t = reg.auto_create(name, srv.config.default_queues, srv.clock.wall_ms(),
                                    who=conn if conn.principal is None else conn.principal)
            except InvalidTopicNameError:
                out.append((name, -1, 0, ErrorCode.INVALID_TOPIC_NAME, 0))
                continue
        if t is None:  # a name that could never exist is told apart from one not created yet
            out.append((name, -1, 0, ErrorCode.UNKNOWN_TOPIC if valid_topic_name(name)
                        else ErrorCode.INVALID_TOPIC_NAME, 0))
        else:
            out.append((t.name, t.topic_id, len(t.queues), 0, t.dedup_window_ms))
    return m.MetadataResponse(out)


async def _cluster_metadata_creating(conn: ClientConnection,
                                     req: m.MetadataRequest) -> m.MetadataResponse:
    """METADATA on a cluster that must auto-create topics first: through the metadata store
    (the topic gets the cluster's default replicas), then answered as usual."""
    srv = conn.server
    assert srv.cluster is not None
    assert req.topics is not None
    for name in req.topics:
        if name in srv.topics.topics or not valid_topic_name(name):
            continue
        try:
            await srv.cluster.create_topic(name, srv.config.default_queues, {}, -1, -1)
        except TopicAlreadyExistsError:  # created through another broker: its record is on
            await srv.cluster.wait_for_topic(name)  # its way here (else: UNKNOWN_TOPIC below)
    answer = metadata(conn, m.MetadataRequest(req.topics, False))
    assert isinstance(answer, m.MetadataResponse)
    return answer


def create_topic(conn: ClientConnection, req: m.CreateTopicRequest
                 ) -> m.CreateTopicResponse | Awaitable[m.CreateTopicResponse]:
    """Create a topic (checked first: name, queues, settings, ``max_topics``,
    ``max_total_queues``); on a cluster through the metadata store, with ``replicas`` and
    ``min_insync``."""
    if conn.server.cluster is not None:
        return _cluster_create_topic(conn, req)
    t = conn.server.topics.create(req.name, req.queues, req.config, conn.server.clock.wall_ms())
    return m.CreateTopicResponse(t.topic_id, len(t.queues))


async def _cluster_create_topic(conn: ClientConnection,
                                req: m.CreateTopicRequest) -> m.CreateTopicResponse:
    assert conn.server.cluster is not None
    t = await conn.server.cluster.create_topic(req.name, req.queues, req.config, req.replicas,
                                               req.min_insync)
    return m.CreateTopicResponse(t.topic_id, t.queues)


def delete_topic(conn: ClientConnection, req: m.DeleteTopicRequest
                 ) -> m.Empty | Awaitable[m.Empty]:
    """Delete a topic, its data and the groups' offsets on it (on a cluster: on every
    broker, through the metadata store)."""
    if conn.server.cluster is not None:
        return _cluster_delete_topic(conn, req)
    topic_id = conn.server.topics.get(req.name).topic_id
    conn.server.topics.delete(req.name)
    conn.server.consumer_groups.forget_topic(req.name)
    conn.server.dedup.forget(topic_id)
    return m.Empty()


async def _cluster_delete_topic(conn: ClientConnection, req: m.DeleteTopicRequest) -> m.Empty:
    assert conn.server.cluster is not None
    await conn.server.cluster.delete_topic(req.name)
    return m.Empty()


def describe_topic(conn: ClientConnection, req: m.DescribeTopicRequest) -> m.DescribeTopicResponse:
    """Per-queue offsets, sizes and segment counts; pending scheduled messages; the dedup
    window and how many keys it holds."""
    t = conn.server.topics.topics.get(req.name)
    if t is None:
        raise UnknownTopicError(f"unknown topic {req.name[:249]!r}")
    queues: list[m.QueueInfo] = []
    for qs in t.queues:
        segs = qs.log.segments()
        last_append = max((s.max_append_time_ms or -1 for s in segs), default=-1)
        queues.append((qs.queue, qs.log.start_offset, qs.visible_end, qs.log.size_bytes,
                       len(segs), last_append))
    pending, next_due = conn.server.scheduler.topic_stats(t.topic_id)
    return m.DescribeTopicResponse(t.name, t.topic_id, queues, t.config, pending, next_due,
                                   t.dedup_window_ms, conn.server.dedup.keys(t.topic_id))


def init_producer(conn: ClientConnection, req: m.InitProducerRequest) -> m.InitProducerResponse:
    """A fresh producer id (epoch 0) for an idempotent producer."""
    return m.InitProducerResponse(conn.server.producer_ids.allocate(), 0)
