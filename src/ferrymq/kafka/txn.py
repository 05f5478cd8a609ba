"""Kafka transactions on the Kafka port, on FerryMQ's own transaction coordinator (KIP-98's
model, :mod:`ferrymq.broker.txn`): InitProducerId with a transactional id is INIT_TXN, EndTxn
is END_TXN, TxnOffsetCommit is TXN_OFFSET_COMMIT, and a Kafka transactional batch is stored as
a FerryMQ transactional batch, whose produce registers its queue with the open transaction.

So AddPartitionsToTxn and AddOffsetsToTxn only answer NONE: FerryMQ's coordinator registers a
queue when the first transactional batch of the transaction reaches it (a fenced or timed-out
producer learns it there, INVALID_PRODUCER_EPOCH) and a group when its offsets arrive. Markers
are FerryMQ's control batches, served to Kafka readers as Kafka control batches with the aborted
transactions listed for ``read_committed`` (:mod:`ferrymq.kafka.handlers`).
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from kio.schema.errors import ErrorCode as KafkaError

from ferrymq.broker.handlers import txn
from ferrymq.errors import AccessDeniedError, BrokerError
from ferrymq.kafka.cluster import check_group
from ferrymq.kafka.rights import authorize
from ferrymq.protocol import messages as m
from ferrymq.protocol.kafka import apis
from ferrymq.protocol.messages import ApiKey

if TYPE_CHECKING:
    from ferrymq.kafka.handlers import KafkaPeer

_NO_TIME = datetime.timedelta(0)


def init_transactional(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """InitProducerId with a transactional id: the id's producer id and a new epoch, its open
    transaction aborted (fencing older instances), once durable."""
    freq = m.InitTxnRequest(req.transactional_id,
                            int(req.transaction_timeout.total_seconds() * 1000),
                            getattr(req, "producer_id", -1), getattr(req, "producer_epoch", -1))
    authorize(peer, ApiKey.INIT_TXN, freq)

    async def answer() -> Any:
        try:
            res = await txn.init_txn(peer.conn, freq)
        except BrokerError as exc:
            return apis.build(cls, {"throttle_time": _NO_TIME, "error_code": _error(exc),
                                    "producer_id": -1, "producer_epoch": -1})
        return apis.build(cls, {"throttle_time": _NO_TIME, "error_code": KafkaError.none,
                                "producer_id": res.producer_id,
                                "producer_epoch": res.producer_epoch})

    return answer()


def add_partitions_to_txn(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """NONE for every partition (FerryMQ registers a queue at its first transactional batch);
    a user without the right to write the topic gets TOPIC_AUTHORIZATION_FAILED here already."""
    rows = []
    for t in req.v3_and_below_topics:
        try:
            authorize(peer, ApiKey.PRODUCE, m.ProduceRequest(0, [(t.name, 0, b"")]))
            error = KafkaError.none
        except AccessDeniedError:
            error = KafkaError.topic_authorization_failed
        rows.append({"name": t.name, "results_by_partition": [
            {"partition_index": p, "partition_error_code": error} for p in t.partitions]})
    return apis.build(cls, {"throttle_time": _NO_TIME, "results_by_topic_v3_and_below": rows})


def add_offsets_to_txn(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """NONE (the group joins the transaction with its TxnOffsetCommit)."""
    return apis.build(cls, {"throttle_time": _NO_TIME, "error_code": KafkaError.none})


def txn_offset_commit(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """Offsets that become the group's when the transaction commits; a generation is checked
    against the Kafka port's group membership first. Kafka clients send it to the group's
    coordinator: on a cluster where another broker coordinates transactions, it is passed on to
    that one (FerryMQ's TXN_OFFSET_COMMIT, which keeps the offsets with the transaction)."""
    entries = [(t.name, p.partition_index, p.committed_offset)
               for t in req.topics for p in t.partitions]
    fenced = check_group(peer, req.group_id)
    if fenced == KafkaError.none:
        fenced = peer.groups.check_commit(req.group_id, getattr(req, "member_id", ""),
                                          getattr(req, "generation_id", -1),
                                          getattr(req, "group_instance_id", None))
    freq = m.TxnOffsetCommitRequest(req.transactional_id, req.producer_id,
                                    req.producer_epoch, req.group_id, "", -1, entries)

    def rows(errors: dict[tuple[str, int], KafkaError]) -> Any:
        out: dict[str, list[dict[str, Any]]] = {}
        for t, q, _o in entries:
            out.setdefault(t, []).append({"partition_index": q, "error_code": errors[(t, q)]})
        return apis.build(cls, {"throttle_time": _NO_TIME, "topics": [
            {"name": t, "partitions": p} for t, p in out.items()]})

    if fenced != KafkaError.none:
        return rows({(t, q): fenced for t, q, _o in entries})
    try:
        authorize(peer, ApiKey.TXN_OFFSET_COMMIT, freq)
    except AccessDeniedError:
        return rows({(t, q): KafkaError.group_authorization_failed for t, q, _o in entries})

    async def answer() -> Any:
        link = peer.conn.server.cluster
        try:
            if link is not None and not link.txn.leads:  # at the group's coordinator
                res = await link.txn.ask_coordinator(freq, m.CommitOffsetsResponse)
            else:
                res = await txn.txn_offset_commit(peer.conn, freq)
        except BrokerError as exc:
            return rows({(t, q): _error(exc) for t, q, _o in entries})
        return rows({(t, q): apis.kafka_error(code) for t, q, code in res.results})

    return answer()


def end_txn(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """Commit or abort the open transaction (markers in every queue it wrote, offsets)."""
    freq = m.EndTxnRequest(req.transactional_id, req.producer_id, req.producer_epoch,
                           m.EndTxnAction.COMMIT if req.committed else m.EndTxnAction.ABORT,
                           "", -1, 0)
    authorize(peer, ApiKey.END_TXN, freq)

    async def answer() -> Any:
        try:
            await txn.end_txn(peer.conn, freq)
        except BrokerError as exc:
            return apis.build(cls, {"throttle_time": _NO_TIME, "error_code": _error(exc)})
        return apis.build(cls, {"throttle_time": _NO_TIME, "error_code": KafkaError.none})

    return answer()


def _error(exc: BrokerError) -> KafkaError:
    return apis.kafka_error(exc.code)
