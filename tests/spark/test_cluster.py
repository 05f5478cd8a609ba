"""The Spark source and sink on a cluster (etcd and three broker processes, real local Spark):
each queue read from and written to its leader, given one broker's address only, and a streaming
read that goes on when a leader stops between micro-batches. The same code on a single broker is
what the other modules of tests/spark run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ferrymq import AdminClient, Message, Producer, PullConsumer
from ferrymq.errors import UnknownGroupError
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, TXN_TOPIC, coordinator_queue
from ferrymq.testing import ETCD_INSTALL_HINT, ClusterProcess, etcd_binary
from tests.spark.helpers import checkpoint

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(etcd_binary() is None,
                                 reason=f"etcd is not installed ({ETCD_INSTALL_HINT})")]

QUEUES = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterProcess]:
    env = {"FERRYMQ_METADATA_LEASE_MS": "2000", "FERRYMQ_REPLICA_LAG_MS": "2000"}
    with ClusterProcess(3, tmp_path_factory.mktemp("cluster"), cluster="spark", flush="async",
                        env=env) as c:
        yield c


def leaders(c: ClusterProcess, topic: str, address: str | None = None) -> dict[int, int]:
    """queue -> its leader broker id, as the broker at ``address`` sees it (-1: none)."""
    with AdminClient(address or c.bootstrap) as admin:
        return {q.queue: q.leader for q in admin.cluster_describe().queues if q.topic == topic}


def replicated_topic(c: ClusterProcess, name: str) -> dict[int, int]:
    """A topic of QUEUES queues on all three brokers, once every broker knows its leaders;
    its leaders (one queue each)."""
    with AdminClient(c.bootstrap) as admin:
        admin.create_topic(name, QUEUES, replicas=3, min_insync=2)
    deadline = time.monotonic() + 20
    while True:
        views = [leaders(c, name, addr) for addr in c.addresses.values()]
        if all(v == views[0] and len(v) == QUEUES and -1 not in v.values() for v in views):
            break
        assert time.monotonic() < deadline, views
        time.sleep(0.1)
    assert sorted(views[0].values()) == [1, 2, 3], views  # every broker leads one queue
    return views[0]


def produce(c: ClusterProcess, topic: str, values: list[str]) -> None:
    with Producer(c.bootstrap, sticky_queue_bytes=0) as p:
        p.send_batch([Message(topic, v.encode()) for v in values])


def read_all(c: ClusterProcess, topic: str, expect: int) -> list[str]:
    """Every message of ``topic`` (up to ``expect``, or what 60 s bring), read by a new group."""
    got: list[str] = []
    group = f"check-{topic}-{time.monotonic_ns()}"
    with PullConsumer(c.bootstrap, group=group, auto_offset_reset="earliest") as cons:
        cons.subscribe(topic)
        deadline = time.monotonic() + 60
        while len(got) < expect and time.monotonic() < deadline:
            got.extend(m.body.decode() for m in cons.poll(timeout=1.0))
    return got


def test_batch_read_of_queues_led_by_three_brokers_through_one_address(
        spark: Any, cluster: ClusterProcess) -> None:
    replicated_topic(cluster, "sread")
    sent = [f"r{i}" for i in range(300)]
    produce(cluster, "sread", sent)
    one = cluster.addresses[1]  # the source learns the other leaders from it
    rows = (spark.read.format("ferrymq").option("servers", one).option("subscribe", "sread")
            .load().collect())
    assert sorted(r.value.decode() for r in rows) == sorted(sent)
    assert {r.queue for r in rows} == set(range(QUEUES))


def test_batch_write_to_queues_led_by_three_brokers_through_one_address(
        spark: Any, cluster: ClusterProcess) -> None:
    replicated_topic(cluster, "swrite")
    df = spark.sql("SELECT CONCAT('w', CAST(id AS STRING)) AS value, "
                   "CONCAT('k', CAST(id % 30 AS STRING)) AS sharding_key FROM range(0, 600, 1, 3)")
    (df.write.format("ferrymq").option("servers", cluster.addresses[2])
     .option("topic", "swrite").option("deliveryMode", "idempotent").mode("append").save())
    got = read_all(cluster, "swrite", 600)
    assert sorted(got) == sorted(f"w{i}" for i in range(600))
    with AdminClient(cluster.bootstrap) as admin:
        ends = [q.end_offset for q in admin.describe_topic("swrite").queues]
    assert all(n > 0 for n in ends) and sum(ends) == 600  # all three leaders took rows


def test_stream_goes_on_when_a_leader_stops_between_micro_batches(
        spark: Any, cluster: ClusterProcess, tmp_path: Path) -> None:
    led = replicated_topic(cluster, "sfail")
    produce(cluster, "sfail", [f"a{i}" for i in range(150)])
    df = (spark.readStream.format("ferrymq").option("servers", cluster.bootstrap)
          .option("subscribe", "sfail").option("startingOffsets", "earliest").load())
    q = (df.selectExpr("CAST(value AS STRING) AS v").writeStream.format("memory")
         .queryName("sfail_out").option("checkpointLocation", checkpoint(tmp_path))
         .trigger(processingTime="300 milliseconds").start())

    def seen() -> int:
        return int(spark.sql("SELECT count(*) AS n FROM sfail_out").collect()[0].n)

    def wait_for(n: int, what: str) -> None:
        deadline = time.monotonic() + 120
        while seen() < n:
            assert q.exception() is None, q.exception()
            assert time.monotonic() < deadline, f"{what}: {seen()} of {n} rows"
            time.sleep(0.3)

    victim = led[0]
    try:
        wait_for(150, "before the failover")
        cluster.stop_broker(victim)  # graceful: the controller moves its queue at once
        deadline = time.monotonic() + 30
        while leaders(cluster, "sfail")[0] in (victim, -1):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        produce(cluster, "sfail", [f"b{i}" for i in range(150)])
        wait_for(300, "after the failover")
        got = sorted(r.v for r in spark.sql("SELECT v FROM sfail_out").collect())
        assert got == sorted([f"a{i}" for i in range(150)] + [f"b{i}" for i in range(150)])
    finally:
        q.stop()
        cluster.restart(victim)


def leaders_ends(c: ClusterProcess, topic: str) -> list[int]:
    """Each queue's end offset, as its leader has it."""
    with AdminClient(c.bootstrap) as admin:
        return [q.end_offset for q in admin.describe_topic_from_leaders(topic).queues]


def test_a_read_process_write_stream_keeps_exactly_once_across_a_leader_kill(
        spark: Any, cluster: ClusterProcess, tmp_path: Path) -> None:
    """A streaming query from one replicated topic to another (``deliveryMode=idempotent``)
    while the broker leading a queue of both is SIGKILLed mid-stream: the query goes on (the
    source re-reads from the new leaders, the tasks' idempotent producers retry there) and
    the output holds every input row exactly once."""
    src = replicated_topic(cluster, "xin")
    dst = replicated_topic(cluster, "xout")
    victim = src[0]
    assert victim in dst.values()
    q = (spark.readStream.format("ferrymq").option("servers", cluster.bootstrap)
         .option("subscribe", "xin").option("startingOffsets", "earliest").load()
         .selectExpr("value").writeStream.format("ferrymq")
         .option("servers", cluster.bootstrap).option("topic", "xout")
         .option("deliveryMode", "idempotent")
         .option("checkpointLocation", checkpoint(tmp_path))
         .trigger(processingTime="300 milliseconds").start())
    sent: list[str] = []
    try:
        for wave in range(8):  # input throughout; the kill lands inside a run of micro-batches
            values = [f"w{wave}-{i}" for i in range(100)]
            produce(cluster, "xin", values)
            sent += values
            if wave == 3:
                cluster.kill9(victim)
            time.sleep(0.4)
            assert q.exception() is None, q.exception()
        deadline = time.monotonic() + 60
        while sum(leaders_ends(cluster, "xout")) < len(sent) and time.monotonic() < deadline:
            assert q.exception() is None, q.exception()
            time.sleep(0.5)
        time.sleep(2)  # nothing more comes (a replayed batch would add rows)
        got = read_all(cluster, "xout", sum(leaders_ends(cluster, "xout")))
        assert len(got) == len(set(got)), "rows written twice"
        assert sorted(got) == sorted(sent)
    finally:
        q.stop()
        cluster.restart(victim)


def test_the_driver_s_offset_look_up_waits_while_the_brokers_still_name_a_killed_leader(
        cluster: ClusterProcess) -> None:
    """latestOffset right after a leader is SIGKILLed: until its lease runs out every broker
    still names it, and connecting to it is refused. The look-up retries until the new leader
    answers (the streaming query used to die with 'broker unreachable ... (option servers)')."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from ferrymq.spark import _route
    from ferrymq.spark.source import FerryMQStreamReader, read_range

    led = replicated_topic(cluster, "skill")
    produce(cluster, "skill", [f"a{i}" for i in range(30)])
    reader = FerryMQStreamReader({"servers": cluster.bootstrap, "subscribe": "skill",
                                  "startingoffsets": "earliest"})
    router = _route.router(reader.opts.wire)
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadAllAvailable())  # every leader known and connected
    victim = led[0]
    cluster.kill9(victim)
    try:
        t0 = time.monotonic()
        assert reader.latestOffset(end, ReadAllAvailable()) == end  # nothing new, no error
        waited = time.monotonic() - t0
        new_leader = router.leaders.leader("skill", 0)
        assert new_leader not in (victim, None), (new_leader, waited)
        produce(cluster, "skill", [f"b{i}" for i in range(30)])
        after = reader.latestOffset(end, ReadAllAvailable())
        parts = [*reader.partitions(start, end), *reader.partitions(end, after)]
        rows = [v for part in parts for batch in read_range(part)  # from the new leader
                for v in batch.column("value").to_pylist()]
        assert sorted(v.decode() for v in rows) == sorted(
            [f"a{i}" for i in range(30)] + [f"b{i}" for i in range(30)])
    finally:
        reader.stop()
        cluster.restart(victim)


def test_a_transactional_write_commits_exactly_once_across_a_coordinator_kill(
        spark: Any, cluster: ClusterProcess) -> None:
    """``deliveryMode=transactional`` (the default) on a cluster: tasks write to the three
    leaders and stage, the driver commits at the transaction coordinator; a second write after
    the coordinator was killed (-9) finds the new one. read_committed sees every row once."""
    replicated_topic(cluster, "stxn")
    first = spark.sql("SELECT CONCAT('a', CAST(id AS STRING)) AS value FROM range(0, 300, 1, 3)")
    (first.write.format("ferrymq").option("servers", cluster.addresses[1])
     .option("topic", "stxn").mode("append").save())
    victim = leaders(cluster, TXN_TOPIC)[0]
    cluster.kill9(victim)
    try:
        second = spark.sql("SELECT CONCAT('b', CAST(id AS STRING)) AS value "
                           "FROM range(0, 300, 1, 3)")
        (second.write.format("ferrymq").option("servers", cluster.bootstrap)
         .option("topic", "stxn").mode("append").save())
    finally:
        cluster.restart(victim)
    got = read_all(cluster, "stxn", 600)
    assert sorted(got) == sorted([f"a{i}" for i in range(300)] + [f"b{i}" for i in range(300)])


def test_a_streaming_idempotent_sink_records_its_batches_with_the_fence_leader(
        cluster: ClusterProcess) -> None:
    import pyarrow as pa
    from pyspark.sql.types import BinaryType, StructField, StructType

    from ferrymq.spark.sink import SINKS_TOPIC, FerryMQStreamWriter, batch_committed

    replicated_topic(cluster, "sfence")
    one = cluster.addresses[3]
    options = {"servers": one, "topic": "sfence", "checkpointlocation": "/chk/fence",
               "deliverymode": "idempotent"}
    schema = StructType([StructField("value", BinaryType())])
    msg = FerryMQStreamWriter(options, schema).write(
        iter([pa.record_batch([pa.array([b"a", b"b", b"c"])], names=["value"])]))
    FerryMQStreamWriter(options, schema).commit([msg], 4)
    assert leaders(cluster, SINKS_TOPIC)[0] in (1, 2, 3)
    for addr in cluster.addresses.values():  # whichever broker a task reaches first
        assert batch_committed(addr, "/chk/fence", 4)
        assert not batch_committed(addr, "/chk/fence", 5)
    assert sorted(read_all(cluster, "sfence", 3)) == ["a", "b", "c"]


def coordinator_of(c: ClusterProcess, group: str) -> int:
    """The broker coordinating ``group``: the leader of its queue of the offsets topic."""
    with AdminClient(c.bootstrap) as admin:
        qs = {q.queue: q.leader for q in admin.cluster_describe().queues
              if q.topic == OFFSETS_TOPIC}
    assert qs, "no offsets topic yet"
    return qs[coordinator_queue(group, len(qs))]


def committed(c: ClusterProcess, group: str, topic: str) -> int:
    """The sum of ``group``'s committed offsets in ``topic`` (0 before its first commit)."""
    with AdminClient(c.bootstrap) as admin:
        try:
            offsets = admin.describe_group(group).offsets
        except UnknownGroupError:
            return 0
    return sum(o.committed for o in offsets if o.topic == topic and o.committed > 0)


def test_commit_to_group_and_start_from_committed_reach_the_coordinator(
        spark: Any, cluster: ClusterProcess, tmp_path: Path) -> None:
    replicated_topic(cluster, "sgroup")
    produce(cluster, "sgroup", [f"a{i}" for i in range(90)])
    df = (spark.readStream.format("ferrymq").option("servers", cluster.bootstrap)
          .option("subscribe", "sgroup").option("startingOffsets", "earliest")
          .option("commitToGroup", "spark-g").load())
    q = (df.selectExpr("CAST(value AS STRING) AS v").writeStream.format("memory")
         .queryName("sgroup_out").option("checkpointLocation", checkpoint(tmp_path))
         .trigger(processingTime="300 milliseconds").start())
    try:  # the source commits a micro-batch's end to the group when the next one starts
        deadline = time.monotonic() + 120
        while spark.sql("SELECT count(*) AS n FROM sgroup_out").collect()[0].n < 90:
            assert q.exception() is None, q.exception()
            assert time.monotonic() < deadline
            time.sleep(0.3)
        produce(cluster, "sgroup", [f"b{i}" for i in range(60)])
        while committed(cluster, "spark-g", "sgroup") < 90:
            assert q.exception() is None, q.exception()
            assert time.monotonic() < deadline, committed(cluster, "spark-g", "sgroup")
            time.sleep(0.3)
    finally:
        q.stop()
    assert committed(cluster, "spark-g", "sgroup") == 90  # the b batch's end is not committed
    other = next(a for i, a in cluster.addresses.items() if i != coordinator_of(cluster, "spark-g"))
    rows = (spark.read.format("ferrymq").option("servers", other).option("subscribe", "sgroup")
            .option("startingOffsets", "committed").option("group", "spark-g").load().collect())
    assert sorted(r.value.decode() for r in rows) == sorted(f"b{i}" for i in range(60))
