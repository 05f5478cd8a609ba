"""Kafka clients on a real cluster: etcd and three ``ferrymq broker`` processes, each with a
Kafka port, driven by confluent-kafka (librdkafka) and kcat. Metadata names every broker and
each partition's leader; an ``acks=all`` producer and a consumer group go on, the Kafka way
(NOT_LEADER_OR_FOLLOWER, NOT_COORDINATOR, a metadata refresh), when the leader of a partition
is killed with SIGKILL, and nothing acknowledged is lost. The protocol-level checks are in
``tests/kafka/test_kafka_cluster.py`` (an in-process cluster)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka
import pytest
from confluent_kafka.admin import AdminClient as KafkaAdminClient

from ferrymq.client import AdminClient
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, coordinator_queue
from ferrymq.testing import ClusterProcess
from tests.cluster.conftest import needs_etcd
from tests.cluster.test_cluster_etcd import wait_until

pytestmark = [pytest.mark.integration, needs_etcd]

FAST = {"FERRYMQ_METADATA_LEASE_MS": "2000", "FERRYMQ_REPLICA_LAG_MS": "2000"}
KCAT = shutil.which("kcat") or shutil.which("kafkacat")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterProcess]:
    with ClusterProcess(3, tmp_path / "c", cluster="t", env=FAST, kafka=True) as c:
        yield c


def kafka_bootstrap(c: ClusterProcess, *ids: int) -> str:
    addresses = c.kafka_addresses
    return ",".join(addresses[i] for i in (ids or sorted(addresses)))


def leaders(c: ClusterProcess) -> dict[tuple[str, int], int]:
    with AdminClient(c.bootstrap, connect_timeout_s=5) as admin:
        d = admin.cluster_describe()
    return {(q.topic, q.queue): q.leader for q in d.queues}


def test_metadata_from_any_broker_lists_every_broker_and_each_leader(
        cluster: ClusterProcess) -> None:
    with AdminClient(cluster.bootstrap) as admin:
        admin.create_topic("orders", 3, replicas=3, min_insync=2)
    expected = leaders(cluster)
    kafka = cluster.kafka_addresses
    for i in (1, 2, 3):  # bootstrapped from one broker, the client learns them all
        md = KafkaAdminClient(
            {"bootstrap.servers": kafka_bootstrap(cluster, i)}).list_topics("orders", 10)
        assert {b.id: f"{b.host}:{b.port}" for b in md.brokers.values()} == kafka
        assert md.controller_id in kafka
        parts = md.topics["orders"].partitions
        assert {("orders", p): parts[p].leader for p in parts} \
            == {k: v for k, v in expected.items() if k[0] == "orders"}
        assert all(sorted(parts[p].replicas) == [1, 2, 3] for p in parts)
    if KCAT is not None:  # kcat -L at any broker lists every broker
        for i in (1, 2, 3):
            out = subprocess.run([KCAT, "-b", kafka_bootstrap(cluster, i), "-L"],
                                 capture_output=True, text=True, timeout=60, check=True).stdout
            assert " 3 brokers:" in out
            for bid, addr in kafka.items():
                assert f"broker {bid} at {addr}" in out
            assert 'topic "orders" with 3 partitions' in out


def test_kill9_of_a_leader_under_a_kafka_producer_and_consumer_group_loses_nothing(
        cluster: ClusterProcess) -> None:
    """The broker killed coordinates the consumer group and leads a partition (three
    partitions over three brokers): both fail over."""
    with AdminClient(cluster.bootstrap) as admin:
        admin.create_topic("orders", 3, replicas=3, min_insync=2)
    bootstrap = kafka_bootstrap(cluster)
    acked: set[bytes] = set()
    consumed: set[bytes] = set()
    stop = threading.Event()
    produced = threading.Event()
    errors: list[str] = []

    def produce() -> None:
        p = confluent_kafka.Producer({
            "bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
            "linger.ms": 5, "message.timeout.ms": 60_000})

        def done(err: Any, msg: Any) -> None:
            if err is None:
                acked.add(msg.value())
            else:
                errors.append(f"produce: {err}")

        i = 0
        try:
            while not stop.is_set():
                p.produce("orders", f"m{i}".encode(), key=str(i % 7).encode(),
                          on_delivery=done)
                p.poll(0.002)
                i += 1
            if p.flush(60):
                errors.append("produce: not every message delivered within 60 s")
        finally:
            produced.set()

    def consume() -> None:
        c = confluent_kafka.Consumer({
            "bootstrap.servers": bootstrap, "group.id": "billing",
            "auto.offset.reset": "earliest", "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 500})
        c.subscribe(["orders"])
        try:
            while not (produced.is_set() and acked <= consumed):
                if produced.is_set() and time.monotonic() > deadline[0]:
                    return
                msg = c.poll(0.2)
                if msg is None:
                    continue
                if msg.error() is not None:
                    if msg.error().fatal():
                        errors.append(f"consume: {msg.error()}")
                        return
                    continue  # transient (the killed broker's connection): it goes on
                consumed.add(msg.value())
        finally:
            c.close()

    deadline = [time.monotonic() + 120]
    threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(acked) >= 300 and len(consumed) >= 100, "produce and consume")
        now = leaders(cluster)
        offsets_queues = sum(1 for t, _q in now if t == OFFSETS_TOPIC)
        victim = now[(OFFSETS_TOPIC, coordinator_queue("billing", offsets_queues))]
        led = [q for (t, q), b in now.items() if t == "orders" and b == victim]
        assert led, f"broker {victim} coordinates the group but leads no partition: {now}"
        before_acked, before_consumed = len(acked), len(consumed)
        cluster.kill9(victim)
        t0 = time.monotonic()
        wait_until(lambda: all(leaders(cluster)[("orders", q)] not in (victim, -1)
                               for q in led), f"new leaders of orders/{led}")
        wait_until(lambda: len(acked) >= before_acked + 300, "acks resuming after the kill")
        wait_until(lambda: len(consumed) >= before_consumed + 300,
                   "the consumer group going on after the kill")
        assert time.monotonic() - t0 < 30
    finally:
        stop.set()
        deadline[0] = time.monotonic() + 60
        for t in threads:
            t.join(90)
    assert not errors, errors[:5]
    missing = acked - consumed
    assert not missing, f"{len(missing)} acknowledged messages not consumed"
