"""The ferrymq sink through real local Spark: write and read back, replayed micro-batches."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ferrymq import Broker
from ferrymq.client.partitioner import queue_for_key
from tests.helpers import read_topic
from tests.spark.helpers import checkpoint, create_topic, produce

pytestmark = pytest.mark.integration


def test_batch_write_then_read_back(spark: Any, module_broker: Broker) -> None:
    addr = module_broker.address
    create_topic(addr, "w1", 4)
    create_topic(addr, "w2", 2)
    df = spark.sql("""
        SELECT CONCAT('row-', CAST(id AS STRING)) AS value,
               IF(id % 2 = 0, 'w1', 'w2') AS topic,
               CONCAT('c', CAST(id % 7 AS STRING)) AS sharding_key,
               IF(id % 3 = 0, 'even3', NULL) AS tags,
               IF(id % 5 = 0, array('a', CAST(id AS STRING)), array()) AS keys,
               map('n', CAST(id AS STRING)) AS properties
        FROM range(0, 5000, 1, 3)""")
    df.write.format("ferrymq").option("servers", addr).mode("append").save()
    rows = (spark.read.format("ferrymq").option("servers", addr).option("subscribe", "w1,w2")
            .option("includeProperties", "true").load().collect())
    assert len(rows) == 5000
    assert len({r.value for r in rows}) == 5000
    for r in rows:
        i = int(r.value.decode()[4:])
        assert r.topic == ("w1" if i % 2 == 0 else "w2")
        assert r.sharding_key == f"c{i % 7}"
        assert r.queue == queue_for_key(f"c{i % 7}", 4 if i % 2 == 0 else 2)
        assert r.tags == ("even3" if i % 3 == 0 else None)
        assert r.keys == (["a", str(i)] if i % 5 == 0 else [])
        assert dict(r.properties) == {"n": str(i)}
    # and a plain client sees the same messages
    assert len(read_topic(addr, "w2", expect=2500)) == 2500


def test_sink_errors(spark: Any, module_broker: Broker) -> None:
    df = spark.sql("SELECT 'x' AS value")
    with pytest.raises(Exception, match="deliveryMode"):
        df.write.format("ferrymq").option("topic", "w1").option("deliveryMode", "twice").mode(
            "append").save()
    with pytest.raises(Exception, match="'value' column"):
        spark.sql("SELECT 'x' AS body").write.format("ferrymq").option(
            "topic", "w1").mode("append").save()


def test_sink_creates_a_missing_topic_as_a_producer_does(spark: Any, module_broker: Broker,
                                                         tmp_path: Path) -> None:
    """Like a producer (and Kafka's sink on a broker with auto-create on): the first write to a
    missing topic creates it; a broker with auto_create_topics off refuses, naming the fix."""
    addr = module_broker.address
    spark.sql("SELECT CONCAT('n-', CAST(id AS STRING)) AS value FROM range(10)").write.format(
        "ferrymq").option("servers", addr).option("topic", "created-by-sink").mode("append").save()
    assert sorted(m.body for m in read_topic(addr, "created-by-sink", expect=10)) == sorted(
        f"n-{i}".encode() for i in range(10))
    with Broker(tmp_path / "strict", port=0, auto_create_topics=False) as strict:
        with pytest.raises(Exception, match=r"does not exist.*ferrymq topic create nope"):
            spark.sql("SELECT 'x' AS value").write.format("ferrymq").option(
                "servers", strict.address).option("topic", "nope").mode("append").save()


def _copy_query(spark: Any, addr: str, chk: str, mode: str) -> None:
    src = (spark.readStream.format("ferrymq").option("servers", addr).option("subscribe", "in")
           .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", "400").load())
    q = (src.selectExpr("value", "sharding_key").writeStream.format("ferrymq")
         .option("servers", addr).option("topic", f"out-{mode}").option("deliveryMode", mode)
         .option("checkpointLocation", chk).trigger(availableNow=True).start())
    q.awaitTermination(180)
    assert q.exception() is None


def _forget_last_commit(chk: str) -> int:
    """The checkpoint as a driver killed after the sink's commit, before Spark's commit log
    write, leaves it: the last micro-batch planned (offsets/N) but not marked done."""
    commits = Path(chk) / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    (commits / str(last)).unlink()
    (commits / f".{last}.crc").unlink(missing_ok=True)
    return last


@pytest.mark.parametrize("mode", ["transactional", "idempotent", "atLeastOnce"])
def test_replayed_micro_batch(spark: Any, module_broker: Broker, tmp_path: Path, mode: str) -> None:
    addr = module_broker.address
    if mode == "transactional":  # the first of the three
        create_topic(addr, "in", 3)
        produce(addr, "in", [f"m{i}".encode() for i in range(1000)], sharding_key=None)
    create_topic(addr, f"out-{mode}", 3)
    chk = checkpoint(tmp_path)
    _copy_query(spark, addr, chk, mode)
    _forget_last_commit(chk)
    _copy_query(spark, addr, chk, mode)  # Spark replays the last micro-batch
    got = Counter(m.body for m in read_topic(addr, f"out-{mode}", expect=1000))
    assert set(got) == {f"m{i}".encode() for i in range(1000)}
    dups = sum(n - 1 for n in got.values())
    if mode != "atLeastOnce":
        assert dups == 0  # the replay found its batch committed on the broker: nothing written
    else:
        assert dups > 0  # at-least-once: the replay wrote its rows again (what the fence stops)


def test_abort_after_commit_undoes_nothing(module_broker: Broker) -> None:
    """Spark may call abort() for a micro-batch whose commit in fact reached the broker
    (idempotent mode; the transactional one: test_sink_staged.py)."""
    import pyarrow as pa
    from pyspark.sql.types import BinaryType, StructField, StructType

    from ferrymq.spark.sink import FerryMQStreamWriter, batch_committed

    addr = module_broker.address
    create_topic(addr, "ab", 2)
    options = {"servers": addr, "topic": "ab", "checkpointlocation": "/chk/ab",
               "deliverymode": "idempotent"}
    schema = StructType([StructField("value", BinaryType())])
    task_side = FerryMQStreamWriter(options, schema)
    msg = task_side.write(iter([pa.record_batch([pa.array([b"a", b"b", b"c"])], names=["value"])]))
    FerryMQStreamWriter(options, schema).commit([msg], 7)  # driver: a fresh writer per call
    assert batch_committed(addr, "/chk/ab", 7) and not batch_committed(addr, "/chk/ab", 8)
    FerryMQStreamWriter(options, schema).abort([msg], 7)
    assert batch_committed(addr, "/chk/ab", 7)
    assert sorted(m.body for m in read_topic(addr, "ab", expect=3)) == [b"a", b"b", b"c"]
