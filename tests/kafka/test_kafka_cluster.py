"""The Kafka port on a cluster, at the protocol level: three real brokers in one process (real
sockets, real logs, one memory metadata store; :mod:`tests.cluster.inprocess`), each with its
Kafka port, asked with Kafka requests over real sockets. Metadata names every broker and each
partition's leader, requests at a broker that does not lead a partition or coordinate a group
are refused the Kafka way (the same with etcd, broker processes and confluent-kafka in
``tests/cluster/test_kafka_cluster_etcd.py``)."""

from __future__ import annotations

import asyncio
import datetime
import struct
from pathlib import Path
from typing import Any

import pytest
from kio.schema.errors import ErrorCode as KafkaError

from ferrymq.broker.server import BrokerServer
from ferrymq.client import AsyncAdminClient
from ferrymq.cluster.metadata.memory import MemoryMetadataStore
from ferrymq.cluster.metadata.store import KeyValue
from ferrymq.cluster.model import BrokerRecord
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, TXN_TOPIC, coordinator_queue
from ferrymq.protocol.kafka import apis
from ferrymq.protocol.kafka.records import to_kafka
from ferrymq.protocol.records import RecordInput, encode_batch
from tests.cluster.inprocess import Cluster, leader_of, run
from tests.helpers import free_port

pytestmark = pytest.mark.integration

_S = datetime.timedelta(seconds=5)


async def kafka_cluster(tmp: Path, n: int = 3) -> Cluster:
    """Brokers 1..n, each with a Kafka port."""
    c = Cluster(tmp, MemoryMetadataStore(), metadata_lease_ms=2000, replica_lag_ms=2000)
    for i in range(1, n + 1):
        await c.start(i, kafka_port=free_port())
    return c


def kafka_address(srv: BrokerServer) -> tuple[str, int]:
    assert srv.kafka is not None
    return srv.kafka.address


async def call(srv: BrokerServer, key: int, version: int, values: dict[str, Any]) -> Any:
    """One Kafka request to ``srv``'s Kafka port, built from ``values``; the decoded answer."""
    req_cls, res_cls = apis.request_class(key, version), apis.response_class(key, version)
    assert req_cls is not None
    assert res_cls is not None
    flexible = bool(res_cls.__flexible__)
    header = struct.pack(">hhih", key, version, 7, 4) + b"test" + (b"\x00" if flexible else b"")
    payload = header + apis.encode(apis.build(req_cls, values))
    reader, writer = await asyncio.open_connection(*kafka_address(srv))
    try:
        writer.write(struct.pack(">i", len(payload)) + payload)
        size = struct.unpack(">i", await reader.readexactly(4))[0]
        raw = await reader.readexactly(size)
    finally:
        writer.close()
    assert struct.unpack_from(">i", raw)[0] == 7
    return apis.decode_request(res_cls, raw[5 if flexible else 4:], 0)


async def metadata(srv: BrokerServer, topics: list[str] | None) -> Any:
    return await call(srv, apis.METADATA, 12, {
        "topics": None if topics is None else [{"name": t, "topic_id": None} for t in topics],
        "allow_auto_topic_creation": False, "include_topic_authorized_operations": False})


async def create_orders(c: Cluster, queues: int = 3) -> None:
    async with AsyncAdminClient(c.bootstrap) as admin:
        await admin.create_topic("orders", queues, replicas=3, min_insync=2)
    await c.wait(lambda: all(
        s.cluster is not None and all(
            (r := s.cluster.node.view.queues.get(("orders", q))) is not None
            and r.leader > 0 and len(r.isr) == 3 for q in range(queues))
        for s in c.brokers.values()), "orders led with every replica in sync")


async def stop_all(c: Cluster) -> None:
    for i in list(c.brokers):
        await c.stop(i)


def test_every_broker_answers_metadata_with_every_broker_and_each_partitions_leader(
        tmp_path: Path) -> None:
    async def body() -> None:
        c = await kafka_cluster(tmp_path)
        try:
            await create_orders(c)
            view = c.brokers[1].cluster.node.view  # type: ignore[union-attr]
            expected_brokers = sorted((i, *kafka_address(s)) for i, s in c.brokers.items())
            for srv in c.brokers.values():
                res = await metadata(srv, ["orders"])
                assert sorted((b.node_id, b.host, b.port) for b in res.brokers) \
                    == expected_brokers
                assert res.controller_id == view.controller and res.controller_id in c.brokers
                assert res.cluster_id == "t"
                [topic] = res.topics
                assert topic.error_code == KafkaError.none
                for p in topic.partitions:
                    rec = view.queues[("orders", p.partition_index)]
                    assert p.error_code == KafkaError.none
                    assert p.leader_id == rec.leader
                    assert p.leader_epoch == rec.leader_epoch
                    assert list(p.replica_nodes) == rec.replicas
                    assert sorted(p.isr_nodes) == sorted(rec.isr)
                    assert list(p.offline_replicas) == []
                described = await call(srv, apis.DESCRIBE_CLUSTER, 0,
                                       {"include_cluster_authorized_operations": False})
                assert sorted((b.broker_id, b.host, b.port) for b in described.brokers) \
                    == expected_brokers
                assert described.controller_id == view.controller
            # a broker gone: no longer listed, its replicas offline, its partitions re-led
            victim = leader_of(c, "orders", 0)
            await c.stop(victim)
            await c.wait(lambda: leader_of(c, "orders", 0) not in (victim, -1),
                         "a new leader of orders/0")
            srv = next(iter(c.brokers.values()))
            res = await metadata(srv, ["orders"])
            assert victim not in [b.node_id for b in res.brokers]
            p0 = res.topics[0].partitions[0]
            assert p0.leader_id == leader_of(c, "orders", 0)
            assert list(p0.offline_replicas) == [victim]
        finally:
            await stop_all(c)
    run(body)


def test_a_broker_record_without_a_kafka_port_decodes_and_is_not_listed(
        tmp_path: Path) -> None:
    """A record written before the Kafka port existed (no kafka fields) still decodes; a broker
    without a Kafka port is left out of Metadata and a partition it leads has no leader there
    (LEADER_NOT_AVAILABLE, which clients retry)."""
    old = BrokerRecord.decode(KeyValue("k", b'{"broker_id":4,"host":"h","incarnation":9,'
                                            b'"port":1}', 1, 1))
    assert (old.kafka_address, old.port) == (None, 1)

    async def body() -> None:
        c = await kafka_cluster(tmp_path, 2)
        try:
            await c.start(3)  # no Kafka port
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("solo", 1, replicas=1, min_insync=1)
                await admin.create_topic("mixed", 3, replicas=3, min_insync=1)
            await c.wait(lambda: all(
                s.cluster is not None and ("mixed", 2) in s.cluster.node.view.queues
                and ("solo", 0) in s.cluster.node.view.queues for s in c.brokers.values()),
                "the topics everywhere")
            res = await metadata(c.brokers[1], ["mixed"])
            assert sorted(b.node_id for b in res.brokers) == [1, 2]
            assert not c.brokers[1].cluster.node.view.brokers[  # type: ignore[union-attr]
                3].kafka_port
            for p in res.topics[0].partitions:
                leader = leader_of(c, "mixed", p.partition_index)
                if leader == 3:
                    assert (p.error_code, p.leader_id) == (KafkaError.leader_not_available, -1)
                else:
                    assert (p.error_code, p.leader_id) == (KafkaError.none, leader)
        finally:
            await stop_all(c)
    run(body)


def test_a_partition_asked_of_a_broker_that_does_not_lead_it_is_not_leader_or_follower(
        tmp_path: Path) -> None:
    async def body() -> None:
        c = await kafka_cluster(tmp_path)
        try:
            await create_orders(c, 1)
            leader = leader_of(c, "orders", 0)
            other = c.brokers[next(i for i in c.brokers if i != leader)]
            batch = to_kafka(bytes(encode_batch([RecordInput(b"hello", 1000)])))
            produce = {"transactional_id": None, "acks": -1, "timeout": _S, "topic_data": [
                {"name": "orders", "partition_data": [{"index": 0, "records": batch}]}]}
            fetch = {"replica_id": -1, "max_wait": datetime.timedelta(0), "min_bytes": 1,
                     "max_bytes": 1 << 20, "isolation_level": 0, "session_id": 0,
                     "session_epoch": -1, "forgotten_topics_data": [], "rack_id": "",
                     "topics": [{"topic": "orders", "partitions": [
                         {"partition": 0, "current_leader_epoch": -1, "fetch_offset": 0,
                          "last_fetched_epoch": -1, "log_start_offset": -1,
                          "partition_max_bytes": 1 << 20}]}]}
            offsets = {"replica_id": -1, "isolation_level": 0, "topics": [
                {"name": "orders", "partitions": [
                    {"partition_index": 0, "current_leader_epoch": -1, "timestamp": -1}]}]}
            # at the leader: stored (acks=all: every in-sync replica), read back, listed
            res = await call(c.brokers[leader], apis.PRODUCE, 9, produce)
            part = res.responses[0].partition_responses[0]
            assert (part.error_code, part.base_offset) == (KafkaError.none, 0)
            res = await call(c.brokers[leader], apis.FETCH, 12, fetch)
            assert res.responses[0].partitions[0].error_code == KafkaError.none
            assert res.responses[0].partitions[0].high_watermark == 1
            res = await call(c.brokers[leader], apis.LIST_OFFSETS, 6, offsets)
            assert res.topics[0].partitions[0].offset == 1
            # elsewhere: NOT_LEADER_OR_FOLLOWER, nothing stored there
            res = await call(other, apis.PRODUCE, 9, produce)
            part = res.responses[0].partition_responses[0]
            assert part.error_code == KafkaError.not_leader_or_follower
            assert f"broker {leader} lead" in (part.error_message or "")
            res = await call(other, apis.FETCH, 12, fetch)
            assert res.responses[0].partitions[0].error_code \
                == KafkaError.not_leader_or_follower
            res = await call(other, apis.LIST_OFFSETS, 6, offsets)
            assert res.topics[0].partitions[0].error_code == KafkaError.not_leader_or_follower
            assert c.brokers[leader].topics.queue("orders", 0).log.end_offset == 1
        finally:
            await stop_all(c)
    run(body)


def test_acks_all_needs_min_insync_replicas(tmp_path: Path) -> None:
    """acks=all is answered NOT_ENOUGH_REPLICAS while fewer than the topic's min_insync
    replicas are in sync (Kafka's min.insync.replicas); acks=1 is still stored."""
    async def body() -> None:
        c = await kafka_cluster(tmp_path, 2)
        try:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 1, replicas=2, min_insync=2)
            await c.wait(lambda: all(
                s.cluster is not None and (r := s.cluster.node.view.queues.get(("orders", 0)))
                is not None and len(r.isr) == 2 for s in c.brokers.values()), "both in sync")
            leader = leader_of(c, "orders", 0)
            await c.stop(3 - leader)
            await c.wait(lambda: len(c.brokers[leader].cluster.node.view  # type: ignore[union-attr]
                                     .queues[("orders", 0)].isr) == 1, "the ISR shrunk")
            batch = to_kafka(bytes(encode_batch([RecordInput(b"hello", 1000)])))

            def produce(acks: int) -> dict[str, Any]:
                return {"transactional_id": None, "acks": acks, "timeout": _S, "topic_data": [
                    {"name": "orders", "partition_data": [{"index": 0, "records": batch}]}]}

            res = await call(c.brokers[leader], apis.PRODUCE, 9, produce(-1))
            assert res.responses[0].partition_responses[0].error_code \
                == KafkaError.not_enough_replicas
            res = await call(c.brokers[leader], apis.PRODUCE, 9, produce(1))
            assert res.responses[0].partition_responses[0].error_code == KafkaError.none
        finally:
            await stop_all(c)
    run(body)


async def find_coordinator(srv: BrokerServer, key: str, key_type: int) -> Any:
    return await call(srv, apis.FIND_COORDINATOR, 3, {"key": key, "key_type": key_type})


async def coordinator_found(c: Cluster, srv: BrokerServer, key: str, key_type: int) -> Any:
    """FindCoordinator asked until it names one (the first asks create the internal topic:
    COORDINATOR_NOT_AVAILABLE meanwhile, as Kafka answers while its offsets topic is made)."""
    for _ in range(200):
        res = await find_coordinator(srv, key, key_type)
        if res.error_code == KafkaError.none:
            return res
        assert res.error_code == KafkaError.coordinator_not_available, res
        await asyncio.sleep(0.05)
    raise AssertionError(f"no coordinator for {key!r}")


def test_find_coordinator_names_the_coordinator_and_other_brokers_refuse_group_requests(
        tmp_path: Path) -> None:
    async def body() -> None:
        c = await kafka_cluster(tmp_path)
        try:
            await create_orders(c, 1)
            res = await coordinator_found(c, c.brokers[1], "billing", 0)
            t = c.brokers[1].topics.topics[OFFSETS_TOPIC]
            leader = leader_of(c, OFFSETS_TOPIC, coordinator_queue("billing", len(t.queues)))
            assert (res.node_id, res.host, res.port) \
                == (leader, *kafka_address(c.brokers[leader]))
            for srv in c.brokers.values():  # every broker names the same one
                again = await find_coordinator(srv, "billing", 0)
                assert (again.error_code, again.node_id) == (KafkaError.none, leader)
            txn = await coordinator_found(c, c.brokers[2], "tx-1", 1)
            assert txn.node_id == leader_of(c, TXN_TOPIC, 0)
            assert txn.port == kafka_address(c.brokers[txn.node_id])[1]

            other = c.brokers[next(i for i in c.brokers if i != leader)]
            join = {"group_id": "billing", "session_timeout": datetime.timedelta(seconds=10),
                    "rebalance_timeout": datetime.timedelta(seconds=10), "member_id": "",
                    "group_instance_id": None, "protocol_type": "consumer",
                    "protocols": [{"name": "range", "metadata": b""}], "reason": None}
            res = await call(other, apis.JOIN_GROUP, 7, join)
            assert res.error_code == KafkaError.not_coordinator
            assert "billing" not in other.kafka.groups.groups  # type: ignore[union-attr]
            res = await call(other, apis.HEARTBEAT, 4, {
                "group_id": "billing", "generation_id": 1, "member_id": "m",
                "group_instance_id": None})
            assert res.error_code == KafkaError.not_coordinator
            commit = {"group_id": "billing", "generation_id_or_member_epoch": -1,
                      "member_id": "", "group_instance_id": None, "topics": [
                          {"name": "orders", "partitions": [
                              {"partition_index": 0, "committed_offset": 0,
                               "committed_leader_epoch": -1, "committed_metadata": None}]}]}
            res = await call(other, apis.OFFSET_COMMIT, 8, commit)
            assert res.topics[0].partitions[0].error_code == KafkaError.not_coordinator
            res = await call(other, apis.OFFSET_FETCH, 7, {
                "group_id": "billing", "topics": None, "require_stable": False})
            assert res.error_code == KafkaError.not_coordinator
            # at the coordinator: a member joins and commits
            res = await call(c.brokers[leader], apis.JOIN_GROUP, 7, join)
            assert (res.error_code, res.generation_id) == (KafkaError.none, 1)
            res = await call(c.brokers[leader], apis.OFFSET_COMMIT, 8, commit)
            assert res.topics[0].partitions[0].error_code == KafkaError.none
        finally:
            await stop_all(c)
    run(body)


def test_txn_offset_commit_at_the_groups_coordinator_reaches_the_transaction_coordinator(
        tmp_path: Path) -> None:
    """Kafka clients send TxnOffsetCommit to the group's coordinator, the other transaction
    requests to the transaction coordinator: where those are two brokers, the offsets still
    become the group's when the transaction commits."""
    async def body() -> None:
        c = await kafka_cluster(tmp_path)
        try:
            await create_orders(c, 1)
            leader = leader_of(c, "orders", 0)
            batch = to_kafka(bytes(encode_batch([RecordInput(b"hello", 1000)])))
            res = await call(c.brokers[leader], apis.PRODUCE, 9, {
                "transactional_id": None, "acks": -1, "timeout": _S, "topic_data": [
                    {"name": "orders", "partition_data": [{"index": 0, "records": batch}]}]})
            assert res.responses[0].partition_responses[0].error_code == KafkaError.none
            txn = (await coordinator_found(c, c.brokers[1], "tx-1", 1)).node_id
            await coordinator_found(c, c.brokers[1], "g0", 0)  # %GROUPS%offsets made
            groups = {}
            for i in range(100):
                groups.setdefault((await find_coordinator(c.brokers[1], f"g{i}", 0)).node_id,
                                  f"g{i}")
            group_coordinator = next(b for b in groups if b != txn)
            group = groups[group_coordinator]
            neither = next(b for b in c.brokers if b not in (txn, group_coordinator))
            init = await call(c.brokers[txn], apis.INIT_PRODUCER_ID, 4, {
                "transactional_id": "tx-1", "transaction_timeout": datetime.timedelta(
                    seconds=60), "producer_id": -1, "producer_epoch": -1})
            assert init.error_code == KafkaError.none
            res = await call(c.brokers[txn], apis.ADD_OFFSETS_TO_TXN, 3, {
                "transactional_id": "tx-1", "producer_id": init.producer_id,
                "producer_epoch": init.producer_epoch, "group_id": group})
            assert res.error_code == KafkaError.none
            commit = {"transactional_id": "tx-1", "group_id": group,
                      "producer_id": init.producer_id, "producer_epoch": init.producer_epoch,
                      "generation_id": -1, "member_id": "", "group_instance_id": None,
                      "topics": [{"name": "orders", "partitions": [
                          {"partition_index": 0, "committed_offset": 1,
                           "committed_leader_epoch": -1, "committed_metadata": None}]}]}
            res = await call(c.brokers[neither], apis.TXN_OFFSET_COMMIT, 3, commit)
            assert res.topics[0].partitions[0].error_code == KafkaError.not_coordinator
            res = await call(c.brokers[group_coordinator], apis.TXN_OFFSET_COMMIT, 3, commit)
            assert res.topics[0].partitions[0].error_code == KafkaError.none
            res = await call(c.brokers[txn], apis.END_TXN, 3, {
                "transactional_id": "tx-1", "producer_id": init.producer_id,
                "producer_epoch": init.producer_epoch, "committed": True})
            assert res.error_code == KafkaError.none

            async def committed() -> int:
                res = await call(c.brokers[group_coordinator], apis.OFFSET_FETCH, 7, {
                    "group_id": group, "topics": None, "require_stable": True})
                assert res.error_code == KafkaError.none
                return {(t.name, p.partition_index): p.committed_offset
                        for t in res.topics for p in t.partitions}.get(("orders", 0), -1)

            for _ in range(100):
                if await committed() == 1:
                    break
                await asyncio.sleep(0.05)
            assert await committed() == 1
        finally:
            await stop_all(c)
    run(body)


def test_offset_for_leader_epoch_says_where_each_epoch_ends_at_the_leader_only(
        tmp_path: Path) -> None:
    async def body() -> None:
        c = await kafka_cluster(tmp_path)
        try:
            await create_orders(c, 1)
            batch = to_kafka(bytes(encode_batch([RecordInput(b"hello", 1000)])))
            produce = {"transactional_id": None, "acks": -1, "timeout": _S, "topic_data": [
                {"name": "orders", "partition_data": [{"index": 0, "records": batch}]}]}

            async def ask(srv: BrokerServer, current: int, epoch: int) -> Any:
                res = await call(srv, apis.OFFSET_FOR_LEADER_EPOCH, 4, {
                    "replica_id": -1, "topics": [{"topic": "orders", "partitions": [
                        {"partition": 0, "current_leader_epoch": current,
                         "leader_epoch": epoch}]}]})
                return res.topics[0].partitions[0]

            first = leader_of(c, "orders", 0)
            epoch = c.brokers[first].cluster.node.view.queues[  # type: ignore[union-attr]
                ("orders", 0)].leader_epoch
            for _ in range(2):
                res = await call(c.brokers[first], apis.PRODUCE, 9, produce)
                assert res.responses[0].partition_responses[0].error_code == KafkaError.none
            got = await ask(c.brokers[first], epoch, epoch)
            assert (got.error_code, got.leader_epoch, got.end_offset) \
                == (KafkaError.none, epoch, 2)
            other = next(i for i in c.brokers if i != first)
            got = await ask(c.brokers[other], epoch, epoch)
            assert got.error_code == KafkaError.not_leader_or_follower
            await c.stop(first)  # a new leader at a new epoch
            await c.wait(lambda: leader_of(c, "orders", 0) not in (first, -1), "a new leader")
            second = leader_of(c, "orders", 0)
            await c.wait(lambda: c.brokers[second].topics.queue("orders", 0).replica
                         is not None, "the new leader serving")
            res = await call(c.brokers[second], apis.PRODUCE, 9, produce)
            assert res.responses[0].partition_responses[0].error_code == KafkaError.none
            now = c.brokers[second].cluster.node.view.queues[  # type: ignore[union-attr]
                ("orders", 0)].leader_epoch
            assert now > epoch
            got = await ask(c.brokers[second], now, epoch)  # the old epoch ended at 2
            assert (got.error_code, got.leader_epoch, got.end_offset) \
                == (KafkaError.none, epoch, 2)
            got = await ask(c.brokers[second], now, now)
            assert (got.leader_epoch, got.end_offset) == (now, 3)
            got = await ask(c.brokers[second], epoch, epoch)  # a client with stale metadata
            assert got.error_code == KafkaError.fenced_leader_epoch
            got = await ask(c.brokers[second], now + 1, now)
            assert got.error_code == KafkaError.unknown_leader_epoch
            # Fetch and ListOffsets check the client's current_leader_epoch too (KIP-320)
            for current, error in ((epoch, KafkaError.fenced_leader_epoch),
                                   (now + 1, KafkaError.unknown_leader_epoch),
                                   (now, KafkaError.none), (-1, KafkaError.none)):
                res = await call(c.brokers[second], apis.FETCH, 12, {
                    "replica_id": -1, "max_wait": datetime.timedelta(seconds=5),
                    "min_bytes": 1 << 20, "max_bytes": 1 << 20, "isolation_level": 0,
                    "session_id": 0, "session_epoch": -1, "forgotten_topics_data": [],
                    "rack_id": "", "topics": [{"topic": "orders", "partitions": [
                        {"partition": 0, "current_leader_epoch": current, "fetch_offset": 3,
                         "last_fetched_epoch": -1, "log_start_offset": -1,
                         "partition_max_bytes": 1 << 20}]}]}) if error else None
                if res is not None:  # answered at once, not after max_wait
                    assert res.responses[0].partitions[0].error_code == error
                res = await call(c.brokers[second], apis.LIST_OFFSETS, 6, {
                    "replica_id": -1, "isolation_level": 0, "topics": [
                        {"name": "orders", "partitions": [
                            {"partition_index": 0, "current_leader_epoch": current,
                             "timestamp": -1}]}]})
                part = res.topics[0].partitions[0]
                assert part.error_code == error
                assert part.offset == (3 if error == KafkaError.none else -1)
        finally:
            await stop_all(c)
    run(body)


def test_kafka_admin_creates_replicated_topics_and_deletes_topics_and_groups_on_a_cluster(
        tmp_path: Path) -> None:
    async def body() -> None:
        c = await kafka_cluster(tmp_path)
        try:
            srv = c.brokers[2]
            res = await call(srv, apis.CREATE_TOPICS, 5, {"timeout": _S, "topics": [
                {"name": "kt", "num_partitions": 2, "replication_factor": 3, "assignments": [],
                 "configs": [{"name": "min.insync.replicas", "value": "2"}]},
                {"name": "dflt", "num_partitions": 1, "replication_factor": -1,
                 "assignments": [], "configs": []},
                {"name": "bad", "num_partitions": 1, "replication_factor": 4,
                 "assignments": [], "configs": []}]})
            got = {t.name: (t.error_code, t.replication_factor) for t in res.topics}
            assert got["kt"] == (KafkaError.none, 3)
            assert got["dflt"] == (KafkaError.none, 3)  # default_replicas: min(3, brokers)
            assert got["bad"][0] == KafkaError.invalid_replication_factor
            made = srv.cluster.node.view.topics["kt"]  # type: ignore[union-attr]
            assert (made.queues, made.replicas, made.min_insync) == (2, 3, 2)
            # a group with committed offsets, deleted at its coordinator
            coordinator = (await coordinator_found(c, srv, "old", 0)).node_id
            res = await call(c.brokers[coordinator], apis.OFFSET_COMMIT, 8, {
                "group_id": "old", "generation_id_or_member_epoch": -1, "member_id": "",
                "group_instance_id": None, "topics": [{"name": "kt", "partitions": [
                    {"partition_index": 0, "committed_offset": 0,
                     "committed_leader_epoch": -1, "committed_metadata": None}]}]})
            assert res.topics[0].partitions[0].error_code == KafkaError.none
            other = next(i for i in c.brokers if i != coordinator)
            res = await call(c.brokers[other], apis.DELETE_GROUPS, 2, {"groups_names": ["old"]})
            assert res.results[0].error_code == KafkaError.not_coordinator
            res = await call(c.brokers[coordinator], apis.DELETE_GROUPS, 2,
                             {"groups_names": ["old"]})
            assert res.results[0].error_code == KafkaError.none
            assert "old" not in c.brokers[coordinator].consumer_groups.groups
            res = await call(srv, apis.DELETE_TOPICS, 5, {"topic_names": ["kt", "nope"],
                                                          "timeout": _S})
            assert [(r.name, r.error_code) for r in res.responses] == [
                ("kt", KafkaError.none), ("nope", KafkaError.unknown_topic_or_partition)]
            await c.wait(lambda: all("kt" not in s.topics.topics for s in c.brokers.values()),
                         "kt deleted everywhere")
        finally:
            await stop_all(c)
    run(body)


def test_each_broker_registers_the_kafka_address_clients_reach_it_at(tmp_path: Path) -> None:
    """``kafka_advertised_address`` as given; else the host of ``advertised_address`` with the
    Kafka port (like the native port's advertised address); Metadata from any broker says so."""
    async def body() -> None:
        c = Cluster(tmp_path, MemoryMetadataStore())
        try:
            await c.start(1, kafka_port=free_port(),
                          kafka_advertised_address="kafka-1.example:19092")
            port = free_port()
            await c.start(2, kafka_port=port, advertised_address=f"localhost:{free_port()}")
            await c.start(3, kafka_port=free_port())
            expected = [(1, "kafka-1.example", 19092), (2, "localhost", port),
                        (3, *kafka_address(c.brokers[3]))]
            await c.wait(lambda: all(s.cluster is not None and len(s.cluster.node.view.brokers)
                                     == 3 for s in c.brokers.values()), "every broker seen")
            for srv in c.brokers.values():
                res = await metadata(srv, None)
                assert sorted((b.node_id, b.host, b.port) for b in res.brokers) == expected
        finally:
            await stop_all(c)
    run(body)


def test_a_kafka_group_moves_with_its_coordinator(tmp_path: Path) -> None:
    """The coordinator of a group is drained (its leaderships move, it stays up): it forgets
    the group's Kafka membership, its members' requests there answer NOT_COORDINATOR, and
    FindCoordinator names the new coordinator, where members join again and commit."""
    async def body() -> None:
        c = await kafka_cluster(tmp_path)
        try:
            await create_orders(c, 1)
            old = (await coordinator_found(c, c.brokers[1], "billing", 0)).node_id
            join = {"group_id": "billing", "session_timeout": datetime.timedelta(seconds=30),
                    "rebalance_timeout": datetime.timedelta(seconds=10), "member_id": "",
                    "group_instance_id": None, "protocol_type": "consumer",
                    "protocols": [{"name": "range", "metadata": b""}], "reason": None}
            joined = await call(c.brokers[old], apis.JOIN_GROUP, 7, join)
            assert (joined.error_code, joined.generation_id) == (KafkaError.none, 1)
            assert "billing" in c.brokers[old].kafka.groups.groups  # type: ignore[union-attr]
            other = c.brokers[next(i for i in c.brokers if i != old)]
            assert other.cluster is not None
            await other.cluster.drain_broker(old)
            await c.wait(lambda: (r := c.brokers[old].kafka) is not None
                         and "billing" not in r.groups.groups,
                         "the old coordinator forgetting the group (housekeeping)")
            res = await call(c.brokers[old], apis.HEARTBEAT, 4, {
                "group_id": "billing", "generation_id": 1, "member_id": joined.member_id,
                "group_instance_id": None})
            assert res.error_code == KafkaError.not_coordinator
            new = (await coordinator_found(c, c.brokers[old], "billing", 0)).node_id
            assert new != old
            res = await call(c.brokers[new], apis.HEARTBEAT, 4, {
                "group_id": "billing", "generation_id": 1, "member_id": joined.member_id,
                "group_instance_id": None})
            assert res.error_code == KafkaError.unknown_member_id  # so it rejoins
            rejoined = await call(c.brokers[new], apis.JOIN_GROUP, 7, join)
            assert rejoined.error_code == KafkaError.none
            res = await call(c.brokers[new], apis.OFFSET_COMMIT, 8, {
                "group_id": "billing", "generation_id_or_member_epoch": rejoined.generation_id,
                "member_id": rejoined.member_id, "group_instance_id": None, "topics": [
                    {"name": "orders", "partitions": [
                        {"partition_index": 0, "committed_offset": 0,
                         "committed_leader_epoch": -1, "committed_metadata": None}]}]})
            assert res.topics[0].partitions[0].error_code == KafkaError.none
        finally:
            await stop_all(c)
    run(body)
