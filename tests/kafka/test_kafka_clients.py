"""Kafka clients nobody here wrote (librdkafka through confluent-kafka, kafka-python, aiokafka)
against a real in-process FerryMQ broker's Kafka port, over real sockets."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from kio.schema.errors import ErrorCode as KafkaError

from ferrymq import AdminClient, Broker, Message, Producer, PullConsumer
from tests.helpers import free_port
from tests.kafka.conftest import kafka_address

confluent_kafka = pytest.importorskip("confluent_kafka")

pytestmark = pytest.mark.integration


def produce_confluent(address: str, topic: str, values: list[bytes], **extra: Any) -> list[Any]:
    """Produce with acks=all, one partition chosen by the caller's key; the delivery reports."""
    reports: list[Any] = []
    p = confluent_kafka.Producer({"bootstrap.servers": address, "acks": "all",
                                  "linger.ms": 5, **extra})
    for i, v in enumerate(values):
        p.produce(topic, v, key=f"k{i}".encode(), partition=0,
                  headers=[("h", f"v{i}".encode())],
                  on_delivery=lambda err, msg: reports.append((err, msg)))
    assert p.flush(30) == 0
    return reports


def consume_confluent(address: str, topic: str, partition: int, n: int,
                      timeout: float = 30.0, isolation: str = "read_committed") -> list[Any]:
    """Read ``n`` messages from the start of one partition (assign(), no group)."""
    c = confluent_kafka.Consumer({"bootstrap.servers": address, "group.id": "unused",
                                  "enable.auto.commit": False,
                                  "auto.offset.reset": "earliest",
                                  "isolation.level": isolation})
    c.assign([confluent_kafka.TopicPartition(topic, partition, confluent_kafka.OFFSET_BEGINNING)])
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < n and time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            got.append(msg)
    finally:
        c.close()
    return got


def pull_native(b: Broker, topic: str, n: int, timeout: float = 15.0) -> list[Any]:
    """Read ``n`` messages of ``topic`` from its start with FerryMQ's own PullConsumer."""
    with PullConsumer(b.address, f"native-{topic}", auto_offset_reset="earliest") as c:
        c.subscribe(topic)
        got: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            got += c.poll(0.5)
    return got


@pytest.mark.parametrize("size", [100, 10_000])
def test_confluent_produce_and_consume(kbroker: Broker, size: int) -> None:
    address = kafka_address(kbroker)
    values = [bytes([i % 251]) * size for i in range(50)]
    reports = produce_confluent(address, "orders", values)
    assert [err for err, _m in reports] == [None] * 50
    assert sorted(m.offset() for _e, m in reports) == list(range(50))
    got = consume_confluent(address, "orders", 0, 50)
    assert [m.value() for m in got] == values
    assert [m.offset() for m in got] == list(range(50))
    assert [m.key() for m in got] == [f"k{i}".encode() for i in range(50)]
    assert [m.headers() for m in got] == [[("h", f"v{i}".encode())] for i in range(50)]
    # the broker stored them as FerryMQ messages in queue 0 of topic "orders"
    assert kbroker.server.topics.queue("orders", 0).log.end_offset == 50


def test_kafka_message_read_by_pull_consumer(kbroker: Broker) -> None:
    address = kafka_address(kbroker)
    born = int(time.time() * 1000) - 5000
    reports: list[Any] = []
    p = confluent_kafka.Producer({"bootstrap.servers": address, "acks": "all",
                                  "on_delivery": lambda err, _msg: reports.append(err)})
    p.produce("t", b"from kafka", key=b"order-7", partition=1, timestamp=born,
              headers=[("source", b"web"), ("ferrymq.tag", b"created"),
                       ("ferrymq.key", b"o-1"), ("ferrymq.key", b"c-9"),
                       ("blob", b"\xff\x00\xfe")])
    p.produce("t", None, key=b"\xff\x01binary", partition=1)  # a tombstone with a binary key
    assert p.flush(30) == 0
    assert reports == [None, None]
    m, tomb = pull_native(kbroker, "t", 2)
    assert (m.queue, m.offset, m.body) == (1, 0, b"from kafka")
    assert (m.sharding_key, m.tags, m.keys) == ("order-7", "created", ("o-1", "c-9"))
    assert m.properties == {"source": "web", "%KAFKA_B64:blob": "/wD+"}
    assert m.born_ms == born
    assert (tomb.offset, tomb.body, tomb.sharding_key) == (1, b"", None)
    assert tomb.properties == {"%KAFKA_KEY_B64": "/wFiaW5hcnk=", "%KAFKA_NULL_VALUE": ""}
    # and back to a Kafka reader, unchanged
    [k1, k2] = consume_confluent(address, "t", 1, 2)
    assert (k1.key(), k1.value(), k1.timestamp()[1]) == (b"order-7", b"from kafka", born)
    assert sorted(k1.headers()) == sorted([("source", b"web"), ("ferrymq.tag", b"created"),
                                           ("ferrymq.key", b"o-1"), ("ferrymq.key", b"c-9"),
                                           ("blob", b"\xff\x00\xfe")])
    assert (k2.key(), k2.value(), k2.headers()) == (b"\xff\x01binary", None, None)


def test_ferrymq_message_read_by_confluent(kbroker: Broker) -> None:
    with Producer(kbroker.address) as p:
        r = p.send(Message("native", b"from ferrymq", tags="paid", keys=["o-2"],
                           sharding_key="cust-1", properties={"source": "batch"}))
    [k] = consume_confluent(kafka_address(kbroker), "native", r.queue, 1)
    assert (k.offset(), k.key(), k.value()) == (r.offset, b"cust-1", b"from ferrymq")
    assert sorted(k.headers()) == [("ferrymq.key", b"o-2"), ("ferrymq.tag", b"paid"),
                                   ("source", b"batch")]


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_compressed_batches_accepted(kbroker: Broker, codec: str) -> None:
    address = kafka_address(kbroker)
    values = [f"message {i} ".encode() * 20 for i in range(30)]
    reports = produce_confluent(address, f"c-{codec}", values, **{"compression.type": codec})
    assert [err for err, _m in reports] == [None] * 30
    got = consume_confluent(address, f"c-{codec}", 0, 30)
    assert [m.value() for m in got] == values


def test_kafka_python_produces(kbroker: Broker) -> None:
    """kafka-python 3 is idempotent by default: InitProducerId, then sequenced batches."""
    kafka = pytest.importorskip("kafka")
    p = kafka.KafkaProducer(bootstrap_servers=kafka_address(kbroker), acks="all")
    futures = [p.send("kp", value=f"v{i}".encode(), key=b"k", partition=0) for i in range(20)]
    metas = [f.get(timeout=30) for f in futures]
    p.close()
    assert [m.offset for m in metas] == list(range(20))
    got = consume_confluent(kafka_address(kbroker), "kp", 0, 20)
    assert [m.value() for m in got] == [f"v{i}".encode() for i in range(20)]


def test_aiokafka_produces(kbroker: Broker) -> None:
    aiokafka = pytest.importorskip("aiokafka")

    async def main() -> list[int]:
        p = aiokafka.AIOKafkaProducer(bootstrap_servers=kafka_address(kbroker), acks="all")
        await p.start()
        try:
            return [(await p.send_and_wait("ak", f"v{i}".encode(), partition=1)).offset
                    for i in range(20)]
        finally:
            await p.stop()

    assert asyncio.run(main()) == list(range(20))
    got = consume_confluent(kafka_address(kbroker), "ak", 1, 20)
    assert [m.value() for m in got] == [f"v{i}".encode() for i in range(20)]


def test_subprocess_broker_with_kafka_port_flag_keeps_offsets_across_a_restart(
        tmp_path: Path) -> None:
    """``ferrymq broker --kafka-port``: what a Kafka client produced is there after a restart,
    and the next produce continues the offsets."""
    from ferrymq._launcher import BrokerProcess

    port = free_port()
    address = f"127.0.0.1:{port}"
    bp = BrokerProcess(tmp_path / "data", extra=["--kafka-port", str(port)]).start()
    try:
        first = produce_confluent(address, "durable", [b"a", b"b", b"c"])
        assert [m.offset() for _e, m in first] == [0, 1, 2]
        bp.stop()
        bp.start()
        second = produce_confluent(address, "durable", [b"d"])
        assert [m.offset() for _e, m in second] == [3]
        got = consume_confluent(address, "durable", 0, 4)
        assert [m.value() for m in got] == [b"a", b"b", b"c", b"d"]
    finally:
        bp.stop()


def test_idempotent_confluent_producer_gets_a_producer_id_and_sequences(kbroker: Broker) -> None:
    address = kafka_address(kbroker)
    reports = produce_confluent(address, "idem", [f"m{i}".encode() for i in range(30)],
                                **{"enable.idempotence": True})
    assert [err for err, _m in reports] == [None] * 30
    from ferrymq.protocol.records import iter_batches

    log = kbroker.server.topics.queue("idem", 0).log
    headers = [h for _p, h in iter_batches(log.read(0, 1 << 20))]
    assert {h.producer_id for h in headers} != {-1}
    assert headers[0].base_sequence == 0
    assert [m.value() for m in consume_confluent(address, "idem", 0, 30)] == [
        f"m{i}".encode() for i in range(30)]


def test_kafka_transactions_commit_and_abort_for_both_protocols(kbroker: Broker) -> None:
    """confluent-kafka's transactional producer on FerryMQ's coordinator: a committed, an
    aborted, and a read-process-write transaction with offsets; read_committed readers of both
    protocols see exactly the committed messages, and the group's offset commits with its
    transaction."""
    address = kafka_address(kbroker)
    kbroker.server.topics.create("tx-in", 1, {}, 0)
    kbroker.server.topics.create("tx-out", 1, {}, 0)
    produce_confluent(address, "tx-in", [b"in-0", b"in-1"])
    p = confluent_kafka.Producer({"bootstrap.servers": address, "transactional.id": "tx-1",
                                  "linger.ms": 5})
    p.init_transactions(30)
    p.begin_transaction()
    for v in (b"c1", b"c2", b"c3"):
        p.produce("tx-out", v, partition=0)
    p.commit_transaction(30)
    p.begin_transaction()
    for v in (b"a1", b"a2"):
        p.produce("tx-out", v, partition=0)
    assert p.flush(30) == 0  # stored, then aborted (abort alone would purge them unsent)
    p.abort_transaction(30)
    c = confluent_kafka.Consumer({"bootstrap.servers": address, "group.id": "rpw",
                                  "enable.auto.commit": False,
                                  "isolation.level": "read_committed"})
    c.assign([confluent_kafka.TopicPartition("tx-in", 0, 0)])
    consumed = []
    deadline = time.monotonic() + 15
    while len(consumed) < 2 and time.monotonic() < deadline:
        msg = c.poll(0.5)
        if msg is not None and msg.error() is None:
            consumed.append(msg)
    p.begin_transaction()
    for msg in consumed:
        p.produce("tx-out", msg.value().upper(), partition=0)
    p.send_offsets_to_transaction([confluent_kafka.TopicPartition("tx-in", 0, 2)],
                                  c.consumer_group_metadata(), 30)
    p.commit_transaction(30)
    c.close()
    committed = [b"c1", b"c2", b"c3", b"IN-0", b"IN-1"]
    assert [m.value() for m in consume_confluent(address, "tx-out", 0, 5)] == committed
    uncommitted = consume_confluent(address, "tx-out", 0, 7, isolation="read_uncommitted")
    assert [m.value() for m in uncommitted] == [b"c1", b"c2", b"c3", b"a1", b"a2", *committed[3:]]
    assert kbroker.server.consumer_groups.committed("rpw") == {("tx-in", 0): 2}
    assert [m.body for m in pull_native(kbroker, "tx-out", 5)] == committed


def test_read_committed_kafka_consumer_skips_ferrymq_aborted_transactions(
        kbroker: Broker) -> None:
    """FerryMQ's transaction markers and aborted list, as Kafka control batches and Kafka's
    aborted-transactions list: a read_committed Kafka consumer sees committed data only, a
    read_uncommitted one sees everything (and neither sees the markers)."""
    with Producer(kbroker.address, transactional_id="tx-a") as p:
        p.begin()
        p.send(Message("txn", b"committed-1", sharding_key="k"))
        p.commit()
        p.begin()
        p.send(Message("txn", b"aborted", sharding_key="k"))
        p.abort()
        p.begin()
        r = p.send(Message("txn", b"committed-2", sharding_key="k"))
        p.commit()
    address = kafka_address(kbroker)

    def read(isolation: str, n: int) -> list[bytes]:
        c = confluent_kafka.Consumer({"bootstrap.servers": address, "group.id": "unused",
                                      "enable.auto.commit": False,
                                      "isolation.level": isolation})
        c.assign([confluent_kafka.TopicPartition("txn", r.queue, 0)])
        got: list[bytes] = []
        deadline = time.monotonic() + 15
        while len(got) < n and time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is not None:
                assert msg.error() is None, msg.error()
                got.append(msg.value())
        assert c.poll(1.0) is None  # nothing more: markers are not handed out
        c.close()
        return got

    assert read("read_committed", 2) == [b"committed-1", b"committed-2"]
    assert read("read_uncommitted", 3) == [b"committed-1", b"aborted", b"committed-2"]


def test_offsets_in_the_middle_of_a_batch_by_time_and_watermarks(kbroker: Broker) -> None:
    address = kafka_address(kbroker)
    values = [f"v{i}".encode() for i in range(40)]
    produce_confluent(address, "seek", values)  # linger: a few batches of many records
    c = confluent_kafka.Consumer({"bootstrap.servers": address, "group.id": "unused",
                                  "enable.auto.commit": False})
    try:
        assert c.get_watermark_offsets(confluent_kafka.TopicPartition("seek", 0),
                                       timeout=10) == (0, 40)
        c.assign([confluent_kafka.TopicPartition("seek", 0, 25)])
        got: list[Any] = []
        deadline = time.monotonic() + 15
        while len(got) < 15 and time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is not None and msg.error() is None:
                got.append(msg)
        assert [m.offset() for m in got] == list(range(25, 40))
        born = got[5].timestamp()[1]
        [found] = c.offsets_for_times([confluent_kafka.TopicPartition("seek", 0, born)],
                                      timeout=10)
        assert found.offset <= 30  # the first message stored at or after that time
        assert found.offset >= 0
    finally:
        c.close()


def test_acks_0_is_stored_without_an_answer(kbroker: Broker) -> None:
    address = kafka_address(kbroker)
    p = confluent_kafka.Producer({"bootstrap.servers": address, "acks": 0})
    for i in range(10):
        p.produce("fire", f"f{i}".encode(), partition=0)
    assert p.flush(30) == 0
    got = consume_confluent(address, "fire", 0, 10)
    assert [m.value() for m in got] == [f"f{i}".encode() for i in range(10)]


def test_metadata_names_this_broker_and_each_queue_as_a_partition(kbroker: Broker) -> None:
    address = kafka_address(kbroker)
    p = confluent_kafka.Producer({"bootstrap.servers": address, "acks": "all"})
    p.produce("two", b"x", partition=0)
    assert p.flush(10) == 0
    with pytest.raises(confluent_kafka.KafkaException, match="Unknown partition"):
        p.produce("two", b"x", partition=7)  # the client knows there are 2
    md = p.list_topics(timeout=10)
    assert sorted(md.topics["two"].partitions) == [0, 1]
    node = kbroker.server.config.broker_id
    assert {q.leader for q in md.topics["two"].partitions.values()} == {node}
    assert (md.brokers[node].host, md.brokers[node].port) == kbroker.server.kafka.address


def test_committed_offsets_are_shared_with_ferrymq_groups(kbroker: Broker) -> None:
    """assign() consumers commit outside a generation (OffsetCommit, generation -1) and resume
    from the committed offset (OffsetFetch); the offsets are the FerryMQ group's of that name,
    both ways."""
    address = kafka_address(kbroker)
    produce_confluent(address, "resume", [f"r{i}".encode() for i in range(10)])

    def consumer() -> Any:
        c = confluent_kafka.Consumer({"bootstrap.servers": address, "group.id": "kg",
                                      "enable.auto.commit": False,
                                      "auto.offset.reset": "earliest"})
        c.assign([confluent_kafka.TopicPartition("resume", 0)])  # from the committed offset
        return c

    def take(c: Any, n: int) -> list[Any]:
        got: list[Any] = []
        deadline = time.monotonic() + 15
        while len(got) < n and time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is not None and msg.error() is None:
                got.append(msg)
        return got

    c = consumer()
    assert [m.offset() for m in take(c, 6)] == list(range(6))
    c.commit(offsets=[confluent_kafka.TopicPartition("resume", 0, 6)], asynchronous=False)
    c.close()
    assert kbroker.server.consumer_groups.committed("kg") == {("resume", 0): 6}
    c = consumer()
    assert [m.offset() for m in take(c, 4)] == list(range(6, 10))
    c.close()
    # a FerryMQ consumer of group "kg" continues from there too, and its commit is seen back
    with PullConsumer(kbroker.address, "kg", auto_offset_reset="earliest") as pc:
        pc.assign([("resume", 0)])
        got: list[Any] = []
        deadline = time.monotonic() + 15
        while len(got) < 4 and time.monotonic() < deadline:
            got += pc.poll(0.5)
        assert [m.offset for m in got] == list(range(6, 10))
        pc.commit()
    c = consumer()
    [tp] = c.committed([confluent_kafka.TopicPartition("resume", 0)], timeout=10)
    assert tp.offset == 10
    c.close()


def test_consumer_group_of_three_rebalances_when_one_leaves(kbroker: Broker) -> None:
    """The classic protocol with librdkafka's own assignor: three members split six partitions,
    one leaves, the other two take its partitions and read on from the committed offsets."""
    address = kafka_address(kbroker)
    kbroker.server.topics.create("grouped", 6, {}, 0)

    def member(n: int) -> Any:
        c = confluent_kafka.Consumer({"bootstrap.servers": address, "group.id": "g3",
                                      "client.id": f"m{n}", "auto.offset.reset": "earliest",
                                      "enable.auto.commit": True,
                                      "auto.commit.interval.ms": 200,
                                      "session.timeout.ms": 10_000,
                                      "heartbeat.interval.ms": 300})
        c.subscribe(["grouped"])
        return c

    def produce(first: int, n: int) -> None:
        p = confluent_kafka.Producer({"bootstrap.servers": address, "acks": "all"})
        for i in range(first, first + n):
            p.produce("grouped", f"g{i}".encode(), partition=i % 6)
        assert p.flush(30) == 0

    def commit_all(consumers: list[Any]) -> None:
        for c in consumers:
            try:
                c.commit(asynchronous=False)
            except confluent_kafka.KafkaException as exc:  # auto-commit took it already
                if exc.args[0].code() != confluent_kafka.KafkaError._NO_OFFSET:
                    raise

    def poll_until(consumers: list[Any], want: set[bytes], seen: dict[bytes, int],
                   timeout: float = 45.0) -> None:
        deadline = time.monotonic() + timeout
        while not want <= set(seen) and time.monotonic() < deadline:
            for i, c in enumerate(consumers):
                msg = c.poll(0.1)
                if msg is not None and msg.error() is None:
                    seen.setdefault(msg.value(), i)

    consumers = [member(n) for n in range(3)]
    try:
        produce(0, 60)
        seen: dict[bytes, int] = {}
        poll_until(consumers, {f"g{i}".encode() for i in range(60)}, seen)
        assert len(seen) == 60
        assignments = [{tp.partition for tp in c.assignment()} for c in consumers]
        assert sorted(p for a in assignments for p in a) == list(range(6))  # disjoint, whole
        assert all(len(a) == 2 for a in assignments)
        admin = pytest.importorskip("confluent_kafka.admin").AdminClient(
            {"bootstrap.servers": address})
        desc = admin.describe_consumer_groups(["g3"])["g3"].result(10)
        assert str(desc.state).endswith("STABLE")
        assert sorted(m.client_id for m in desc.members) == ["m0", "m1", "m2"]
        assert sorted(tp.partition for m in desc.members
                      for tp in m.assignment.topic_partitions) == list(range(6))
        commit_all(consumers)
        consumers.pop().close()  # LeaveGroup: the other two rebalance
        produce(60, 60)
        after: dict[bytes, int] = {}
        poll_until(consumers, {f"g{i}".encode() for i in range(60, 120)}, after)
        assert {f"g{i}".encode() for i in range(60, 120)} <= set(after)
        assert sorted(p for c in consumers for p in (tp.partition for tp in c.assignment())) \
            == list(range(6))
        assert not {f"g{i}".encode() for i in range(60)} & set(after)  # resumed from commits
        # a partition that moved may have been read by its old owner before it heard of the
        # rebalance (eager rebalancing: at least once): its new owner reads to the end too
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
                tp.offset != 20 for c in consumers for tp in c.position(c.assignment())):
            for c in consumers:
                c.poll(0.1)
        commit_all(consumers)
    finally:
        for c in consumers:
            c.close()
    assert kbroker.server.consumer_groups.committed("g3") == {("grouped", q): 20 for q in range(6)}


def test_a_restarted_static_member_gets_its_partitions_back_without_a_rebalance(
        kbroker: Broker) -> None:
    """KIP-345 with librdkafka: two members with ``group.instance.id`` split four partitions;
    one process closes (a static member sends no LeaveGroup) and a new one with the same
    instance id takes its partitions back at once, in the same generation, while the other
    keeps reading; the closed process's member id is fenced."""
    address = kafka_address(kbroker)
    kbroker.server.topics.create("static", 4, {}, 0)
    kafka = kbroker.server.kafka
    assert kafka is not None

    def member(name: str, instance: str) -> Any:
        c = confluent_kafka.Consumer({"bootstrap.servers": address, "group.id": "gs",
                                      "client.id": name, "group.instance.id": instance,
                                      "auto.offset.reset": "earliest",
                                      "session.timeout.ms": 30_000,
                                      "heartbeat.interval.ms": 300})
        c.subscribe(["static"])
        return c

    def parts(c: Any) -> set[int]:
        return {tp.partition for tp in c.assignment()}

    def poll_until(consumers: list[Any], done: Any, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            for c in consumers:
                c.poll(0.1)

    a, b = member("a", "ia"), member("b", "ib")
    a2 = None
    try:
        poll_until([a, b], lambda: len(parts(a)) == len(parts(b)) == 2)
        before = (parts(a), parts(b))
        assert before[0] | before[1] == {0, 1, 2, 3}
        group = kafka.groups.groups["gs"]
        generation, old_id = group.generation, group.static["ia"]
        a.close()  # no LeaveGroup from a static member: its place waits for it
        assert group.static["ia"] == old_id
        t0 = time.monotonic()
        a2 = member("a2", "ia")
        poll_until([a2, b], lambda: parts(a2) == before[0])
        assert parts(a2) == before[0]
        assert time.monotonic() - t0 < 10  # not the 30 s session timeout of the old one
        assert parts(b) == before[1]
        assert group.generation == generation  # no rebalance
        assert group.static["ia"] != old_id
        assert kafka.groups.heartbeat("gs", old_id, generation, "ia") \
            == KafkaError.fenced_instance_id
        p = confluent_kafka.Producer({"bootstrap.servers": address})
        for q in range(4):
            p.produce("static", f"after-{q}".encode(), partition=q)
        assert p.flush(10) == 0
        got: dict[str, set[bytes]] = {"a2": set(), "b": set()}
        deadline = time.monotonic() + 20
        while sum(map(len, got.values())) < 4 and time.monotonic() < deadline:
            for name, c in (("a2", a2), ("b", b)):
                msg = c.poll(0.1)
                if msg is not None and msg.error() is None:
                    got[name].add(msg.value())
        assert got == {"a2": {f"after-{q}".encode() for q in before[0]},
                       "b": {f"after-{q}".encode() for q in before[1]}}
    finally:
        b.close()
        if a2 is not None:
            a2.close()


def test_cooperative_sticky_members_split_and_take_back_partitions(kbroker: Broker) -> None:
    """librdkafka's cooperative-sticky assignor (KIP-429: incremental rebalancing, a second join
    round by the clients): a second member takes half of the partitions, the first keeps the
    other half, and gets them all back when the second leaves; every message is read."""
    address = kafka_address(kbroker)
    kbroker.server.topics.create("coop", 4, {}, 0)
    p = confluent_kafka.Producer({"bootstrap.servers": address})
    for i in range(200):
        p.produce("coop", f"c{i}".encode(), partition=i % 4)
    assert p.flush(10) == 0

    def member(name: str) -> Any:
        c = confluent_kafka.Consumer({"bootstrap.servers": address, "group.id": "gc",
                                      "client.id": name, "auto.offset.reset": "earliest",
                                      "partition.assignment.strategy": "cooperative-sticky",
                                      "heartbeat.interval.ms": 300})
        c.subscribe(["coop"])
        return c

    def parts(c: Any) -> set[int]:
        return {tp.partition for tp in c.assignment()}

    seen: set[bytes] = set()

    def poll_until(consumers: list[Any], done: Any, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            for c in consumers:
                msg = c.poll(0.1)
                if msg is not None and msg.error() is None:
                    seen.add(msg.value())

    first = member("first")
    second = None
    try:
        poll_until([first], lambda: parts(first) == {0, 1, 2, 3})
        assert parts(first) == {0, 1, 2, 3}
        second = member("second")
        poll_until([first, second], lambda: len(parts(first)) == len(parts(second)) == 2)
        assert parts(first) | parts(second) == {0, 1, 2, 3}
        assert not parts(first) & parts(second)
        second, leaving = None, second
        leaving.close()
        poll_until([first], lambda: parts(first) == {0, 1, 2, 3} and len(seen) == 200)
        assert parts(first) == {0, 1, 2, 3}
        assert seen == {f"c{i}".encode() for i in range(200)}
    finally:
        first.close()
        if second is not None:
            second.close()


def test_kafka_groups_show_in_ferrymq_group_list_and_describe(kbroker: Broker) -> None:
    """``ferrymq group list/describe`` (LIST_GROUPS, DESCRIBE_GROUP) show a Kafka group: its
    state, generation, members with the partitions their assignment names, and the offsets it
    committed; a FerryMQ consumer group of the same name holding only those offsets is not
    listed a second time."""
    address = kafka_address(kbroker)
    kbroker.server.topics.create("viewed", 4, {}, 0)
    p = confluent_kafka.Producer({"bootstrap.servers": address})
    for q in range(4):
        p.produce("viewed", b"x", partition=q)
    assert p.flush(10) == 0

    def member(name: str) -> Any:
        c = confluent_kafka.Consumer({"bootstrap.servers": address, "group.id": "gv",
                                      "client.id": name, "auto.offset.reset": "earliest",
                                      "enable.auto.commit": False,
                                      "heartbeat.interval.ms": 300})
        c.subscribe(["viewed"])
        return c

    consumers = [member("v1"), member("v2")]
    try:
        read = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
                read == 4 and all(len(c.assignment()) == 2 for c in consumers)):
            for c in consumers:
                msg = c.poll(0.1)
                if msg is not None and msg.error() is None:
                    read += 1
        assert read == 4
        for c in consumers:
            c.commit(asynchronous=False)
        with AdminClient(kbroker.address) as admin:
            listed = [g for g in admin.list_groups() if g.group == "gv"]
            assert [(g.state, g.members) for g in listed] == [("KAFKA_STABLE", 2)]
            desc = admin.describe_group("gv")
        assert (desc.state, desc.generation) == ("KAFKA_STABLE",
                                                 kbroker.server.kafka.groups.groups["gv"].generation)
        assert sorted(x.client_id for x in desc.members) == ["v1", "v2"]
        by_client = {x.client_id: {q for _t, q in x.queues} for x in desc.members}
        assert by_client == {f"v{i + 1}": {tp.partition for tp in c.assignment()}
                             for i, c in enumerate(consumers)}
        assert by_client["v1"] | by_client["v2"] == {0, 1, 2, 3}
        assert [(o.queue, o.committed, o.lag) for o in desc.offsets] == [
            (q, 1, 0) for q in range(4)]
    finally:
        for c in consumers:
            c.close()


def test_aiokafka_and_kafka_python_consumer_groups(kbroker: Broker) -> None:
    """Two other clients' group implementations (and protocol versions) join, get every
    partition between them, read everything and commit."""
    aiokafka = pytest.importorskip("aiokafka")
    kafka = pytest.importorskip("kafka")
    address = kafka_address(kbroker)
    kbroker.server.topics.create("mixed", 4, {}, 0)
    produce_confluent_spread(address, "mixed", 40, 4)

    kp = kafka.KafkaConsumer("mixed", bootstrap_servers=address, group_id="kpg",
                             auto_offset_reset="earliest", enable_auto_commit=False,
                             consumer_timeout_ms=15_000)
    got_kp = []
    for msg in kp:
        got_kp.append(msg.value)
        if len(got_kp) == 40:
            break
    kp.commit()
    kp.close()
    assert sorted(got_kp) == sorted(f"s{i}".encode() for i in range(40))
    assert kbroker.server.consumer_groups.committed("kpg") == {("mixed", q): 10 for q in range(4)}

    async def aio() -> list[bytes]:
        c = aiokafka.AIOKafkaConsumer("mixed", bootstrap_servers=address, group_id="aiog",
                                      auto_offset_reset="earliest", enable_auto_commit=False)
        await c.start()
        got: list[bytes] = []
        try:
            while len(got) < 40:
                batches = await asyncio.wait_for(c.getmany(timeout_ms=500), 15)
                got += [m.value for msgs in batches.values() for m in msgs]
            await c.commit()
        finally:
            await c.stop()
        return got

    assert sorted(asyncio.run(aio())) == sorted(f"s{i}".encode() for i in range(40))
    assert kbroker.server.consumer_groups.committed("aiog") == {("mixed", q): 10
                                                                for q in range(4)}
    # the groups as Kafka admin tools see them (ListGroups, DescribeGroups)
    admin = pytest.importorskip("confluent_kafka.admin").AdminClient(
        {"bootstrap.servers": address})
    listed = admin.list_consumer_groups().result(10)
    assert {"kpg", "aiog"} <= {g.group_id for g in listed.valid}
    desc = admin.describe_consumer_groups(["aiog"])["aiog"].result(10)
    assert (desc.group_id, desc.members) == ("aiog", [])
    assert str(desc.state).endswith("EMPTY")


def produce_confluent_spread(address: str, topic: str, n: int, partitions: int) -> None:
    p = confluent_kafka.Producer({"bootstrap.servers": address, "acks": "all"})
    for i in range(n):
        p.produce(topic, f"s{i}".encode(), partition=i % partitions)
    assert p.flush(30) == 0


def test_topics_created_and_deleted_by_the_kafka_admin_client(kbroker: Broker) -> None:
    """CreateTopics and DeleteTopics from confluent-kafka's AdminClient; the topic is described
    by ``ferrymq topic describe`` (the CLI, a subprocess); DeleteGroups drops a group's
    offsets."""
    import json
    import subprocess
    import sys

    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka_address(kbroker)})
    futures = admin.create_topics([
        NewTopic("made-by-kafka", num_partitions=3, replication_factor=1,
                 config={"retention.ms": "3600000"}),
        NewTopic("replicated", num_partitions=1, replication_factor=3),
        NewTopic("bad-config", num_partitions=1, config={"cleanup.policy": "compact"}),
    ])
    futures["made-by-kafka"].result(10)
    with pytest.raises(confluent_kafka.KafkaException, match="this broker is alone"):
        futures["replicated"].result(10)
    with pytest.raises(confluent_kafka.KafkaException, match="cleanup_policy"):
        futures["bad-config"].result(10)
    res = subprocess.run([sys.executable, "-m", "ferrymq.admin.cli", "--server",
                          kbroker.address, "--json", "topic", "describe", "made-by-kafka"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    desc = json.loads(res.stdout)
    assert len(desc["queues"]) == 3
    assert desc["config"] == {"retention_ms": "3600000"}
    from confluent_kafka.admin import ConfigResource

    [(_res, fut)] = admin.describe_configs(
        [ConfigResource(ConfigResource.Type.TOPIC, "made-by-kafka")]).items()
    configs = fut.result(10)
    assert configs["retention.ms"].value == "3600000"
    assert configs["segment.bytes"].value == str(kbroker.server.config.segment_bytes)
    assert configs["segment.bytes"].is_default
    cluster = admin.describe_cluster().result(10) if hasattr(admin, "describe_cluster") else None
    if cluster is not None:
        assert [n.port for n in cluster.nodes] == [kbroker.server.kafka.address[1]]
    with pytest.raises(confluent_kafka.KafkaException, match="TOPIC_ALREADY_EXISTS"):
        admin.create_topics([NewTopic("made-by-kafka", num_partitions=1)])[
            "made-by-kafka"].result(10)
    admin.delete_topics(["made-by-kafka"])["made-by-kafka"].result(10)
    assert "made-by-kafka" not in kbroker.server.topics.topics
    # a group that only holds offsets
    kbroker.server.topics.create("t", 1, {}, 0)
    c = confluent_kafka.Consumer({"bootstrap.servers": kafka_address(kbroker),
                                  "group.id": "gone"})
    c.commit(offsets=[confluent_kafka.TopicPartition("t", 0, 0)], asynchronous=False)
    c.close()
    assert "gone" in kbroker.server.consumer_groups.groups
    admin.delete_consumer_groups(["gone"])["gone"].result(10)
    assert "gone" not in kbroker.server.consumer_groups.groups
