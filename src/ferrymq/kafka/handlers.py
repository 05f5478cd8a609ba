"""The Kafka APIs FerryMQ serves, each translated onto FerryMQ's own handlers.

Theory of operation
-------------------
A Kafka request is decoded by ``kio`` (:mod:`ferrymq.protocol.kafka.apis`; Produce by
:mod:`~ferrymq.protocol.kafka.produce_codec`, and Fetch answered by
:mod:`~ferrymq.protocol.kafka.fetch_codec`: the hot path) and turned into the FerryMQ request
that means the same: Produce into PRODUCE (each partition's Kafka batch
stored as it came, in an envelope: :mod:`ferrymq.protocol.kafka.envelope`), Fetch into FETCH
(stored Kafka batches sent as they are, FerryMQ batches converted,
:func:`~ferrymq.protocol.kafka.envelope.kafka_pieces`),
ListOffsets into LIST_OFFSETS, Metadata into METADATA, InitProducerId (without a transactional
id) into INIT_PRODUCER, OffsetCommit and OffsetFetch into COMMIT_OFFSETS and FETCH_OFFSETS (a
Kafka group's offsets are the FerryMQ consumer group's of the same name; FindCoordinator names
this broker). JoinGroup, SyncGroup, Heartbeat and LeaveGroup are the Kafka port's own
membership (:mod:`ferrymq.kafka.groups`); the group APIs are in
:mod:`ferrymq.kafka.group_handlers`, the transactional ones in :mod:`ferrymq.kafka.txn`, the
admin ones in :mod:`ferrymq.kafka.admin`. The FerryMQ handler does the work, so
durability (acks, sync flush, group commit), long polling, watermarks, read_committed and topic
auto-creation behave exactly as on the native port. Its answer is mapped back to Kafka's
response of the version the client asked for (:func:`~ferrymq.protocol.kafka.apis.build`).

A Kafka topic is a FerryMQ topic and a partition is a queue; offsets are the queue's offsets.
Which brokers clients see, which leads each partition and which coordinates a group or the
transactions is :mod:`ferrymq.kafka.cluster`'s answer: this broker alone on a single broker,
the metadata store's view on a cluster. There a partition this broker does not lead is refused
by FerryMQ's handlers with NOT_LEADER (Kafka's NOT_LEADER_OR_FOLLOWER: clients refresh their
metadata) and a group it does not coordinate with NOT_COORDINATOR; Kafka group membership then
lives only on each group's coordinator.
"""

from __future__ import annotations

import datetime
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from kio.schema.errors import ErrorCode as KafkaError

from ferrymq.broker.handlers import admin, fetch, offsets, produce
from ferrymq.errors import AccessDeniedError, BrokerError, CorruptRecordError, MessageTooLargeError
from ferrymq.kafka import admin as kafka_admin
from ferrymq.kafka import cluster as kafka_cluster
from ferrymq.kafka import group_handlers
from ferrymq.kafka import txn as kafka_txn
from ferrymq.kafka.answers import later, then
from ferrymq.kafka.rights import authorize
from ferrymq.kafka.sasl import SaslPeer, sasl_authenticate, sasl_handshake
from ferrymq.protocol import messages as m
from ferrymq.protocol.kafka import apis, fetch_codec, produce_codec
from ferrymq.protocol.kafka.envelope import kafka_pieces, wrap
from ferrymq.protocol.kafka.produce_codec import PartitionResult
from ferrymq.protocol.messages import Acks, ApiKey, Isolation

if TYPE_CHECKING:
    from ferrymq.kafka.groups import KafkaGroupCoordinator

KafkaHandler = Callable[["KafkaPeer", type[Any], Any], "Any | Awaitable[Any] | None"]
"""``(connection, response class, request)`` -> a kio response, an awaitable of one, or None
(no response: a produce with ``acks=0``)."""

log = logging.getLogger("ferrymq.kafka")

_NO_TIME = datetime.timedelta(0)
_ACKS = {1: Acks.LEADER, -1: Acks.ALL}


class KafkaPeer(SaslPeer, Protocol):
    """What the Kafka handlers see of their connection."""

    @property
    def local_address(self) -> tuple[str, int]:
        """Host and port the client reached this listener at (what Metadata advertises)."""

    @property
    def groups(self) -> KafkaGroupCoordinator:
        """The Kafka port's group membership."""


def api_versions(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """The API keys and versions this listener serves."""
    return apis.build(cls, {
        "error_code": KafkaError.none,
        "api_keys": [{"api_key": k, "min_version": lo, "max_version": hi}
                     for k, (lo, hi) in sorted(apis.SUPPORTED.items())],
        "throttle_time": _NO_TIME,
    })


def metadata(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """This broker, and the asked topics (all when none is named) with their partitions
    (auto-created as on the native port when the request allows it)."""
    topics: list[str] | None = None
    if req.topics is not None and (req.topics or cls.__version__ > 0):  # v0: [] means all
        topics = [t.name for t in req.topics if t.name is not None]
    auto = bool(getattr(req, "allow_auto_topic_creation", True))
    denied: list[str] = []
    if topics is not None and peer.conn.principal is not None:  # as Kafka: per topic
        allowed = []
        for name in topics:
            try:
                authorize(peer, ApiKey.METADATA, m.MetadataRequest([name], auto))
                allowed.append(name)
            except AccessDeniedError:
                denied.append(name)
        topics = allowed
    answer = admin.metadata(peer.conn, m.MetadataRequest(topics, auto))
    if isinstance(answer, m.MetadataResponse):
        return _metadata_response(peer, cls, answer, denied)
    return later(answer, lambda r: _metadata_response(peer, cls, r, denied))


def _metadata_response(peer: KafkaPeer, cls: type[Any], res: m.MetadataResponse,
                       denied: list[str]) -> Any:
    """``res`` as Kafka's Metadata, the brokers and partitions' leaders from
    :mod:`ferrymq.kafka.cluster`; ``denied`` topics are TOPIC_AUTHORIZATION_FAILED."""
    return apis.build(cls, {
        "throttle_time": _NO_TIME,
        "brokers": [{"node_id": b.node_id, "host": b.host, "port": b.port, "rack": None}
                    for b in kafka_cluster.brokers(peer)],
        "cluster_id": kafka_cluster.cluster_id(peer),
        "controller_id": kafka_cluster.controller_id(peer),
        "topics": [{
            "error_code": apis.kafka_error(code),
            "name": name,
            "topic_id": uuid.UUID(int=max(topic_id, 0)),
            "is_internal": False,
            "partitions": [{
                "error_code": p.error, "partition_index": q, "leader_id": p.leader,
                "leader_epoch": p.leader_epoch, "replica_nodes": p.replicas,
                "isr_nodes": p.isr, "offline_replicas": p.offline,
            } for q, p in enumerate(kafka_cluster.partitions(peer, name, queues))]
            if code == 0 else [],
        } for name, topic_id, queues, code, _dedup in res.topics] + [{
            "error_code": KafkaError.topic_authorization_failed, "name": name,
            "topic_id": uuid.UUID(int=0), "is_internal": False, "partitions": []}
            for name in denied],
    })


def produce_request(peer: KafkaPeer, cls: type[Any],
                    req: produce_codec.ProduceRequestView) -> Any:
    """Wrap each partition's batch (stored as it came, :mod:`ferrymq.protocol.kafka.envelope`)
    and append them through FerryMQ's PRODUCE; ``acks=0`` gets no response, as in Kafka. The
    request was decoded and the response is encoded by hand
    (:mod:`ferrymq.protocol.kafka.produce_codec`): the answer is its body's bytes."""
    results: list[PartitionResult | None] = []  # per partition, None: sent to FerryMQ's produce
    names: list[str] = []
    entries: list[m.ProduceEntry] = []
    cfg = peer.conn.server.config
    acks = _ACKS.get(req.acks)
    mark_keys = cfg.kafka_key_headers_indexed and cfg.key_index_enabled
    for topic in req.topics:
        for part in topic.partitions:
            names.append(topic.name)
            if acks is None and req.acks != 0:
                results.append(PartitionResult(part.partition, KafkaError.invalid_required_acks,
                                               -1, f"acks must be -1, 0 or 1, not {req.acks}"))
                continue
            try:
                batch = wrap(part.records if part.records is not None else b"",
                             max_batch_bytes=cfg.max_message_bytes,
                             max_records=cfg.max_batch_records,
                             max_decompressed_bytes=cfg.max_frame_bytes,
                             mark_keys=mark_keys, roomy=part.roomy)
            except BrokerError as exc:  # the batch is refused, nothing of it stored
                results.append(PartitionResult(part.partition, _refused(exc), -1, str(exc)[:1024]))
                continue
            entries.append((topic.name, part.partition, batch))
            results.append(None)
    freq = m.ProduceRequest(req.timeout_ms, entries, acks or Acks.LEADER)
    try:
        authorize(peer, ApiKey.PRODUCE, freq)
        answer: Any = (produce.produce(peer.conn, freq, envelopes=True) if entries
                       else m.ProduceResponse([]))
    except BrokerError as exc:  # the whole request refused (rights, watermarks)
        answer = m.ProduceResponse([(t, q, exc.code, str(exc), -1, -1, -1, 0, -1, [])
                                    for t, q, _b in entries])
    version: int = cls.__version__

    def respond(res: m.ProduceResponse) -> bytes:
        done = iter(res.results)
        rows: dict[str, list[PartitionResult]] = {}
        for topic, row in zip(names, results, strict=True):
            if row is None:
                _t, q, code, msg, base, _last, _append, _d, _tid, _dups = next(done)
                row = PartitionResult(q, apis.kafka_error(code), base, msg or None)
            rows.setdefault(topic, []).append(row)
        return produce_codec.encode_response(version, list(rows.items()))

    if req.acks == 0:
        return None
    if isinstance(answer, m.ProduceResponse):
        return respond(answer)
    return then(answer, respond)


def _refused(exc: BrokerError) -> KafkaError:
    """The Kafka error of a batch refused before it was stored: MESSAGE_TOO_LARGE,
    CORRUPT_MESSAGE for a bad CRC, else INVALID_RECORD (Kafka's "failed validation")."""
    if isinstance(exc, MessageTooLargeError):
        return KafkaError.message_too_large
    if isinstance(exc, CorruptRecordError) and "CRC" in str(exc):
        return KafkaError.corrupt_message
    return KafkaError.invalid_record


def fetch_request(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """Read through FerryMQ's FETCH (long polling included), the batches as stored: Kafka
    batches are sent as they came, FerryMQ batches converted. On a cluster, a partition asked
    with a stale or unknown ``current_leader_epoch`` is answered that error, not read."""
    fenced = _stale_epochs(peer, req)
    entries: list[m.FetchEntry] = [
        (t.topic, p.partition, p.fetch_offset, p.partition_max_bytes, "")
        for t in req.topics for p in t.partitions if (t.topic, p.partition) not in fenced]
    isolation = (Isolation.READ_COMMITTED if getattr(req, "isolation_level", 0) == 1
                 else Isolation.READ_UNCOMMITTED)
    freq = m.FetchRequest(int(req.max_wait.total_seconds() * 1000), req.min_bytes,
                          req.max_bytes, entries, isolation)
    authorize(peer, ApiKey.FETCH, freq)
    answer = (fetch.fetch(peer.conn, freq, stored=True) if entries or not fenced
              else m.FetchResponse([]))

    version: int = cls.__version__
    committed = isolation == Isolation.READ_COMMITTED

    def respond(res: m.FetchResponse) -> list[fetch_codec.Piece]:
        txn = {(t, q): (lso, aborted) for t, q, lso, aborted in res.txn}
        rows: dict[str, list[fetch_codec.PartitionFetch]] = {}
        for (topic, q), error in fenced.items():
            rows.setdefault(topic, []).append(
                fetch_codec.PartitionFetch(q, error, -1, -1, -1, None, []))
        for topic, q, code, _msg, hw, start, _tid, data in res.results:
            lso, aborted = txn.get((topic, q), (hw, []))
            rows.setdefault(topic, []).append(fetch_codec.PartitionFetch(
                q, apis.kafka_error(code), hw, lso, start,
                [(pid, first) for pid, first in aborted] if committed else None,
                kafka_pieces(data) if data else []))  # empty, never null: librdkafka refuses it
        return fetch_codec.encode_response(version, list(rows.items()))

    if isinstance(answer, m.FetchResponse):
        return respond(answer)
    return later(answer, respond)


def _stale_epochs(peer: KafkaPeer, req: Any) -> dict[tuple[str, int], KafkaError]:
    """On a cluster, the partitions of a Fetch or ListOffsets whose ``current_leader_epoch``
    is not the partition's (:func:`ferrymq.kafka.cluster.epoch_error`), with their error."""
    if peer.conn.server.cluster is None:
        return {}
    out: dict[tuple[str, int], KafkaError] = {}
    for t in req.topics:
        topic = t.topic if hasattr(t, "topic") else t.name
        for p in t.partitions:
            index = p.partition if hasattr(p, "partition") else p.partition_index
            error = kafka_cluster.epoch_error(peer, topic, index,
                                              getattr(p, "current_leader_epoch", -1))
            if error != KafkaError.none:
                out[(topic, index)] = error
    return out


def list_offsets(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """Earliest (-2), latest (-1) or by time, through FerryMQ's LIST_OFFSETS (on a cluster, a
    stale or unknown ``current_leader_epoch`` is answered that error)."""
    fenced = _stale_epochs(peer, req)
    entries = [(t.name, p.partition_index, p.timestamp) for t in req.topics
               for p in t.partitions if (t.name, p.partition_index) not in fenced]
    isolation = getattr(req, "isolation_level", 0)
    freq = m.ListOffsetsRequest(entries, isolation)
    authorize(peer, ApiKey.LIST_OFFSETS, freq)
    res = offsets.list_offsets(peer.conn, freq)
    rows: dict[str, list[dict[str, Any]]] = {}
    for (topic, q), error in fenced.items():
        rows.setdefault(topic, []).append({
            "partition_index": q, "error_code": error, "timestamp": -1, "offset": -1,
            "leader_epoch": -1, "old_style_offsets": ()})
    for topic, q, code, offset in res.results:
        rows.setdefault(topic, []).append({
            "partition_index": q, "error_code": apis.kafka_error(code), "timestamp": -1,
            "offset": offset, "leader_epoch": -1, "old_style_offsets": (offset,)})
    return apis.build(cls, {"throttle_time": _NO_TIME,
                            "topics": [{"name": t, "partitions": p} for t, p in rows.items()]})


def offset_for_leader_epoch(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """Where each asked leader epoch ends in a partition (KIP-320: a consumer's check for a
    truncated log after a leader change), from the queue's leader-epoch cache: the largest
    epoch at most the one asked and the offset where it ends (the log end for the latest; -1
    and -1 when none is known). Only a partition's leader answers (NOT_LEADER_OR_FOLLOWER
    elsewhere); a ``current_leader_epoch`` older than the leader's is FENCED_LEADER_EPOCH, a
    newer one UNKNOWN_LEADER_EPOCH, as Kafka answers."""
    entries = [(t.topic, p.partition, -1) for t in req.topics for p in t.partitions]
    authorize(peer, ApiKey.LIST_OFFSETS, m.ListOffsetsRequest(entries, 0))
    rows: dict[str, list[dict[str, Any]]] = {}
    for t in req.topics:
        for p in t.partitions:
            rows.setdefault(t.topic, []).append(_epoch_end(peer, t.topic, p))
    return apis.build(cls, {"throttle_time": _NO_TIME, "topics": [
        {"topic": t, "partitions": p} for t, p in rows.items()]})


def _epoch_end(peer: KafkaPeer, topic: str, p: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"partition": p.partition, "error_code": KafkaError.none,
                           "leader_epoch": -1, "end_offset": -1}
    srv = peer.conn.server
    try:
        qs = srv.topics.queue(topic, p.partition)
        if srv.cluster is not None:
            srv.cluster.check_serves(qs)
    except BrokerError as exc:
        row["error_code"] = apis.kafka_error(exc.code)
        return row
    row["error_code"] = kafka_cluster.epoch_error(peer, topic, p.partition,
                                                  p.current_leader_epoch)
    if row["error_code"] == KafkaError.none:
        row["leader_epoch"], row["end_offset"] = qs.log.epochs.end_offset_for(
            p.leader_epoch, qs.log.end_offset)
    return row


def init_producer_id(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """A fresh producer id (epoch 0) for an idempotent producer, from FerryMQ's allocator (the
    native INIT_PRODUCER), so Kafka producers' sequence numbers are checked per partition as
    FerryMQ's are; with a transactional id, FerryMQ's INIT_TXN (:mod:`ferrymq.kafka.txn`)."""
    if req.transactional_id is not None:
        return kafka_txn.init_transactional(peer, cls, req)
    freq = m.InitProducerRequest(None)
    authorize(peer, ApiKey.INIT_PRODUCER, freq)
    res = admin.init_producer(peer.conn, freq)
    return apis.build(cls, {"throttle_time": _NO_TIME, "error_code": KafkaError.none,
                            "producer_id": res.producer_id, "producer_epoch": res.producer_epoch})


def find_coordinator(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """The coordinator of a group (key type 0: the leader of its queue of ``%GROUPS%offsets``)
    or of a transactional id (1: the leader of ``%TXN%state``); this broker on a single broker.
    None now: COORDINATOR_NOT_AVAILABLE, which clients retry."""
    key_type = getattr(req, "key_type", 0)
    if key_type == 0:
        node = kafka_cluster.group_coordinator(peer, req.key)
    elif key_type == 1:
        node = kafka_cluster.txn_coordinator(peer)
    else:
        return apis.build(cls, {"throttle_time": _NO_TIME,
                                "error_code": KafkaError.invalid_request,
                                "error_message": f"unknown key type {key_type}",
                                "node_id": -1, "host": "", "port": -1})
    if node is None:
        return apis.build(cls, {"throttle_time": _NO_TIME,
                                "error_code": KafkaError.coordinator_not_available,
                                "error_message": "no coordinator now (a new leader is being "
                                                 "elected or the topic created); retry",
                                "node_id": -1, "host": "", "port": -1})
    return apis.build(cls, {"throttle_time": _NO_TIME, "error_code": KafkaError.none,
                            "error_message": None, "node_id": node.node_id,
                            "host": node.host, "port": node.port})


HANDLERS: dict[int, KafkaHandler] = {
    apis.API_VERSIONS: api_versions,
    apis.METADATA: metadata,
    apis.PRODUCE: produce_request,
    apis.FETCH: fetch_request,
    apis.LIST_OFFSETS: list_offsets,
    apis.OFFSET_FOR_LEADER_EPOCH: offset_for_leader_epoch,
    apis.INIT_PRODUCER_ID: init_producer_id,
    apis.FIND_COORDINATOR: find_coordinator,
    apis.OFFSET_COMMIT: group_handlers.offset_commit,
    apis.OFFSET_FETCH: group_handlers.offset_fetch,
    apis.JOIN_GROUP: group_handlers.join_group,
    apis.SYNC_GROUP: group_handlers.sync_group,
    apis.HEARTBEAT: group_handlers.heartbeat,
    apis.LEAVE_GROUP: group_handlers.leave_group,
    apis.LIST_GROUPS: group_handlers.list_groups,
    apis.DESCRIBE_GROUPS: group_handlers.describe_groups,
    apis.SASL_HANDSHAKE: sasl_handshake,
    apis.SASL_AUTHENTICATE: sasl_authenticate,
    apis.CREATE_TOPICS: kafka_admin.create_topics,
    apis.DELETE_TOPICS: kafka_admin.delete_topics,
    apis.DELETE_GROUPS: kafka_admin.delete_groups,
    apis.DESCRIBE_CONFIGS: kafka_admin.describe_configs,
    apis.DESCRIBE_CLUSTER: kafka_admin.describe_cluster,
    apis.ADD_PARTITIONS_TO_TXN: kafka_txn.add_partitions_to_txn,
    apis.ADD_OFFSETS_TO_TXN: kafka_txn.add_offsets_to_txn,
    apis.END_TXN: kafka_txn.end_txn,
    apis.TXN_OFFSET_COMMIT: kafka_txn.txn_offset_commit,
}
assert set(HANDLERS) == set(apis.SUPPORTED)

__all__ = ["HANDLERS", "KafkaHandler", "KafkaPeer"]
