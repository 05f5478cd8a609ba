"""Kafka's administration APIs on the Kafka port: CreateTopics, DeleteTopics and DeleteGroups
through FerryMQ's own CREATE_TOPIC, DELETE_TOPIC and DELETE_GROUP (the same checks, limits and
ACLs: admin rights), DescribeConfigs and DescribeCluster.

A Kafka topic's partitions are FerryMQ queues (``num_partitions`` -1: the broker's
``default_queues``); a replication factor above 1 is refused (one broker); Kafka's topic
configs are FerryMQ's topic settings with dots for underscores (``retention.ms`` is
``retention_ms``, also ``retention.bytes``, ``segment.bytes``, ``segment.ms``,
``dedup.window.ms``), anything else INVALID_CONFIG naming it. ``validate_only`` runs the checks
and creates nothing. DescribeConfigs answers a topic's settings under those names (the topic's
own value, else the broker's default), DescribeCluster this broker. Deleting a group deletes
the FerryMQ group of that name (its committed offsets) and the Kafka port's membership record;
a group with live Kafka or FerryMQ members is NON_EMPTY_GROUP.
"""

from __future__ import annotations

import datetime
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kio.schema.errors import ErrorCode as KafkaError

from ferrymq.broker.handlers import admin, consumer_groups
from ferrymq.broker.topic_settings import BOOLEAN_TOPIC_SETTINGS, TOPIC_SETTINGS
from ferrymq.errors import (
    BrokerError,
    InvalidConfigError,
    InvalidReplicationFactorError,
    UnknownGroupError,
)
from ferrymq.kafka import cluster as kafka_cluster
from ferrymq.kafka.rights import authorize
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.kafka import apis
from ferrymq.protocol.messages import ApiKey

if TYPE_CHECKING:
    from ferrymq.kafka.handlers import KafkaPeer

_NO_TIME = datetime.timedelta(0)


def _error(exc: BrokerError) -> KafkaError:
    return apis.kafka_error(exc.code)


Pending = list[tuple[dict[str, Any], Awaitable[Any]]]
"""Result rows whose operation a cluster completes later, with its awaitable."""


def _answer(pending: Pending, respond: Callable[[], Any]) -> Any:
    """``respond()`` now, or once every pending operation is done (a failed one sets its row's
    error)."""
    if not pending:
        return respond()

    async def finish() -> Any:
        for row, operation in pending:
            try:
                await operation
            except BrokerError as exc:
                row.update(error_code=_error(exc), error_message=str(exc)[:1024])
        return respond()

    return finish()


def create_topics(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """Create each topic (or only check it, ``validate_only``), one result per topic. On a
    cluster, with ``replication_factor`` replicas (-1: ``default_replicas``) and the config
    ``min.insync.replicas`` as the topic's ``min_insync``; a single broker refuses more than
    one replica."""
    srv = peer.conn.server
    rows: list[dict[str, Any]] = []
    pending: Pending = []
    for t in req.topics:
        queues = t.num_partitions if t.num_partitions > 0 else srv.config.default_queues
        config = {c.name.replace(".", "_"): c.value for c in t.configs if c.value is not None}
        row: dict[str, Any] = {"name": t.name, "error_code": KafkaError.none,
                               "error_message": None, "num_partitions": queues,
                               "replication_factor": 1, "configs": ()}
        rows.append(row)
        try:
            min_insync = _min_insync(config)
            freq = m.CreateTopicRequest(t.name, queues, config, t.replication_factor,
                                        min_insync)
            authorize(peer, ApiKey.CREATE_TOPIC, freq)
            if srv.cluster is None and (t.replication_factor > 1 or min_insync > 1):
                raise InvalidReplicationFactorError(
                    f"replication factor {t.replication_factor}, min.insync.replicas "
                    f"{min_insync}: this broker is alone (no cluster)")
            if getattr(req, "validate_only", False):
                srv.topics.check_new_topic(t.name, queues, config)
                continue
            answer = admin.create_topic(peer.conn, freq)
            if not isinstance(answer, m.CreateTopicResponse):  # a cluster's, through the store
                row["replication_factor"] = t.replication_factor
                pending.append((row, answer))
        except BrokerError as exc:
            row.update(error_code=_error(exc), error_message=str(exc)[:1024])

    def respond() -> Any:
        if srv.cluster is not None:  # the replicas the cluster gave the topics
            for row in rows:
                made = srv.cluster.node.view.topics.get(row["name"])
                if made is not None and row["error_code"] == KafkaError.none:
                    row["replication_factor"] = made.replicas
        return apis.build(cls, {"throttle_time": _NO_TIME, "topics": rows})

    return _answer(pending, respond)


def _min_insync(config: dict[str, str]) -> int:
    """Kafka's ``min.insync.replicas`` taken out of a new topic's ``config`` (-1: not set).

    Raises:
        InvalidConfigError: it is not a positive number.
    """
    text = config.pop("min_insync_replicas", None)
    if text is None:
        return -1
    if not text.isdigit() or int(text) < 1:
        raise InvalidConfigError(f"min.insync.replicas must be a positive number, not {text!r}")
    return int(text)


def delete_topics(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """Delete each topic with its data and the groups' offsets on it."""
    rows: list[dict[str, Any]] = []
    pending: Pending = []
    for name in req.topic_names:
        freq = m.DeleteTopicRequest(name)
        row: dict[str, Any] = {"name": name, "error_code": KafkaError.none,
                               "error_message": None}
        rows.append(row)
        try:
            authorize(peer, ApiKey.DELETE_TOPIC, freq)
            answer = admin.delete_topic(peer.conn, freq)
            if not isinstance(answer, m.Empty):  # a cluster's, through the store
                pending.append((row, answer))
        except BrokerError as exc:
            row.update(error_code=_error(exc), error_message=str(exc)[:1024])
    return _answer(pending, lambda: apis.build(cls, {"throttle_time": _NO_TIME,
                                                      "responses": rows}))


def delete_groups(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """Delete each group's committed offsets (and its Kafka membership record) when it has no
    live member (on a cluster, at the group's coordinator: NOT_COORDINATOR elsewhere)."""
    rows: list[dict[str, Any]] = []
    pending: Pending = []
    for name in req.groups_names:
        freq = m.DeleteGroupRequest(name, False)
        error = KafkaError.none
        row: dict[str, Any] = {"group_id": name}
        try:
            authorize(peer, ApiKey.DELETE_GROUP, freq)
            kafka_group = peer.groups.groups.get(name)
            if kafka_group is not None and kafka_group.members:
                error = KafkaError.non_empty_group
            else:
                peer.groups.groups.pop(name, None)
                try:
                    answer = consumer_groups.delete_group(peer.conn, freq)
                    if not isinstance(answer, m.DeleteGroupResponse):  # a cluster's, replicated
                        pending.append((row, answer))
                except UnknownGroupError:
                    if kafka_group is None:
                        raise
        except BrokerError as exc:
            error = _error(exc)
            if exc.code == ErrorCode.ACCESS_DENIED:
                error = KafkaError.group_authorization_failed
        row["error_code"] = error
        rows.append(row)
    return _answer(pending, lambda: apis.build(cls, {"throttle_time": _NO_TIME,
                                                      "results": rows}))


_TOPIC = 2
_BROKER = 4
_SOURCE_TOPIC = 1  # Kafka's ConfigSource.TOPIC_CONFIG
_SOURCE_DEFAULT = 5  # DEFAULT_CONFIG


def describe_configs(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """A topic's settings in Kafka's names (dots for underscores); a broker's: none listed."""
    srv = peer.conn.server
    results: list[dict[str, Any]] = []
    for r in req.resources:
        row: dict[str, Any] = {"error_code": KafkaError.none, "error_message": None,
                               "resource_type": r.resource_type,
                               "resource_name": r.resource_name, "configs": []}
        if r.resource_type == _TOPIC:
            try:
                authorize(peer, ApiKey.DESCRIBE_TOPIC, m.DescribeTopicRequest(r.resource_name))
                topic = srv.topics.get(r.resource_name)
            except BrokerError as exc:
                row.update(error_code=_error(exc), error_message=str(exc)[:1024])
                results.append(row)
                continue
            wanted = set(r.configuration_keys or ())
            for name in sorted(set(TOPIC_SETTINGS) | BOOLEAN_TOPIC_SETTINGS):
                kafka_name = name.replace("_", ".")
                if wanted and kafka_name not in wanted:
                    continue
                own = topic.config.get(name)
                default = getattr(srv.config, name, None)
                if own is None and default is None:
                    continue
                row["configs"].append({
                    "name": kafka_name, "value": str(own if own is not None else default),
                    "read_only": True, "is_default": own is None,
                    "config_source": _SOURCE_TOPIC if own is not None else _SOURCE_DEFAULT,
                    "is_sensitive": False, "synonyms": (), "config_type": 0,
                    "documentation": None})
        elif r.resource_type != _BROKER:
            row.update(error_code=KafkaError.invalid_request,
                       error_message=f"resource type {r.resource_type}: only topics (2) and "
                                     "brokers (4)")
        results.append(row)
    return apis.build(cls, {"throttle_time": _NO_TIME, "results": results})


def describe_cluster(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """The live brokers with a Kafka port and the controller (:mod:`ferrymq.kafka.cluster`;
    on a single broker, this one)."""
    return apis.build(cls, {"throttle_time": _NO_TIME, "error_code": KafkaError.none,
                            "error_message": None, "cluster_id": kafka_cluster.cluster_id(peer),
                            "controller_id": kafka_cluster.controller_id(peer), "brokers": [
                                {"broker_id": b.node_id, "host": b.host, "port": b.port,
                                 "rack": None} for b in kafka_cluster.brokers(peer)]})
