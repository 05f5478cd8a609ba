"""Batch and streaming reads through real local Spark against a real broker."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from ferrymq import Broker, Message, Producer
from tests.spark.helpers import checkpoint, create_topic, produce

pytestmark = pytest.mark.integration


def _read(spark: Any, broker: Broker, **options: str) -> Any:
    r = spark.read.format("ferrymq").option("servers", broker.address)
    for k, v in options.items():
        r = r.option(k, v)
    return r.load()


def test_batch_read_every_column(spark: Any, module_broker: Broker) -> None:
    create_topic(module_broker.address, "cols", 3)
    with Producer(module_broker.address) as p:
        sent = p.send_batch([
            Message("cols", f"v{i}".encode(), tags="t1" if i % 2 else None,
                    sharding_key=f"sk{i % 5}", keys=[f"k{i}", "all"] if i % 3 == 0 else (),
                    properties={"n": str(i)} if i % 4 == 0 else None)
            for i in range(200)
        ])
    rows = _read(spark, module_broker, subscribe="cols", includeProperties="true").collect()
    assert len(rows) == 200
    by_id = {r.msg_id: r for r in rows}
    for i, res in enumerate(sent):
        r = by_id[res.msg_id]
        assert (r.topic, r.queue, r.offset) == ("cols", res.queue, res.offset)
        assert r.value == f"v{i}".encode()
        assert r.key == f"sk{i % 5}".encode() and r.sharding_key == f"sk{i % 5}"
        assert r.tags == ("t1" if i % 2 else None)
        assert r.keys == ([f"k{i}", "all"] if i % 3 == 0 else [])
        assert dict(r.properties or {}) == ({"n": str(i)} if i % 4 == 0 else {})
        assert r.timestamp.year >= 2026


def test_batch_offset_range_and_time_range(spark: Any, module_broker: Broker) -> None:
    create_topic(module_broker.address, "ranges", 2)
    first = produce(module_broker.address, "ranges", [b"old"] * 40, sharding_key="a")
    q = first[0][0]
    time.sleep(0.05)
    t_ms = int(time.time() * 1000)
    time.sleep(0.05)
    produce(module_broker.address, "ranges", [b"new"] * 10, sharding_key="a")
    rows = _read(spark, module_broker, subscribe="ranges",
                 startingOffsets=json.dumps({"ranges": {str(q): 5}}),
                 endingOffsets=json.dumps({"ranges": {str(q): 25}})).collect()
    assert sorted(r.offset for r in rows) == list(range(5, 25))
    later = _read(spark, module_broker, subscribe="ranges", startingTimestamp=str(t_ms)).collect()
    assert [r.value for r in later] == [b"new"] * 10
    assert sorted(r.offset for r in later) == list(range(40, 50))


def test_tag_filter_and_scheduled_messages(spark: Any, module_broker: Broker) -> None:
    create_topic(module_broker.address, "tagged", 2)
    with Producer(module_broker.address) as p:
        p.send_batch([Message("tagged", f"{i}".encode(), tags="paid" if i % 3 == 0 else "created")
                      for i in range(90)])
        p.send(Message("tagged", b"later", tags="paid", delay=3600))  # scheduled: never a row
    paid = _read(spark, module_broker, subscribe="tagged", tags="paid").collect()
    assert sorted(int(r.value) for r in paid) == list(range(0, 90, 3))
    everything = _read(spark, module_broker, subscribePattern="tag+ed").collect()
    assert len(everything) == 90


def test_assign_and_min_partitions(spark: Any, module_broker: Broker) -> None:
    import ferrymq.spark

    ferrymq.spark.register(spark)  # explicit registration works next to the automatic one
    create_topic(module_broker.address, "assigned", 3)
    produce(module_broker.address, "assigned", [b"x"] * 300)
    df = _read(spark, module_broker, assign='{"assigned": [0, 2]}', minPartitions="8")
    assert df.rdd.getNumPartitions() >= 8
    rows = df.select("queue", "offset").collect()
    assert {r.queue for r in rows} == {0, 2}
    assert len(rows) == len({(r.queue, r.offset) for r in rows}) == 200


def test_clear_errors(spark: Any, module_broker: Broker) -> None:
    t0 = time.monotonic()
    with pytest.raises(Exception, match="unreachable"):
        spark.read.format("ferrymq").option("servers", "127.0.0.1:1").option(
            "subscribe", "x").load().collect()
    assert time.monotonic() - t0 < 30
    with pytest.raises(Exception, match="does not exist"):
        _read(spark, module_broker, subscribe="no-such-topic").collect()
    with pytest.raises(Exception, match=r"maxOffsetsPerTrigger.*integer"):
        spark.readStream.format("ferrymq").option("subscribe", "x").option(
            "maxOffsetsPerTrigger", "lots").load()
    with pytest.raises(Exception, match=r"subscribe.*subscribePattern.*assign"):
        spark.read.format("ferrymq").option("servers", module_broker.address).load().collect()


def _progress_rows(query: Any) -> list[int]:
    return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]


def test_stream_max_offsets_per_trigger_and_available_now(spark: Any, module_broker: Broker,
                                                          tmp_path: Path) -> None:
    create_topic(module_broker.address, "bounded", 3)
    produce(module_broker.address, "bounded", [f"{i}".encode() for i in range(1000)])
    df = (spark.readStream.format("ferrymq").option("servers", module_broker.address)
          .option("subscribe", "bounded").option("startingOffsets", "earliest")
          .option("maxOffsetsPerTrigger", "300").load())
    q = (df.selectExpr("CAST(value AS STRING) AS v").writeStream.format("memory")
         .queryName("bounded_out").option("checkpointLocation", checkpoint(tmp_path))
         .trigger(availableNow=True).start())
    q.awaitTermination(180)
    sizes = _progress_rows(q)
    assert sum(sizes) == 1000
    assert len(sizes) >= 4 and max(sizes) <= 300
    got = sorted(int(r.v) for r in spark.sql("SELECT v FROM bounded_out").collect())
    assert got == list(range(1000))
    assert q.recentProgress[-1]["sources"][0]["latestOffset"] is not None


def test_stream_latest_start_then_new_data_and_commit_to_group(spark: Any, module_broker: Broker,
                                                                tmp_path: Path) -> None:
    create_topic(module_broker.address, "live", 2)
    produce(module_broker.address, "live", [b"before"] * 20)
    df = (spark.readStream.format("ferrymq").option("servers", module_broker.address)
          .option("subscribe", "live").option("commitToGroup", "live-monitor").load())
    q = (df.selectExpr("CAST(value AS STRING) AS v").writeStream.format("memory")
         .queryName("live_out").option("checkpointLocation", checkpoint(tmp_path))
         .trigger(processingTime="200 milliseconds").start())
    try:
        deadline = time.monotonic() + 120
        while not q.recentProgress and time.monotonic() < deadline:
            time.sleep(0.2)
        produce(module_broker.address, "live", [b"after"] * 30)
        while time.monotonic() < deadline:
            if spark.sql("SELECT count(*) AS n FROM live_out").collect()[0].n >= 30:
                break
            time.sleep(0.3)
        time.sleep(1.0)
    finally:
        q.stop()
    values = [r.v for r in spark.sql("SELECT v FROM live_out").collect()]
    assert values == ["after"] * 30
    from ferrymq import AdminClient

    with AdminClient(module_broker.address) as admin:
        offsets = admin.describe_group("live-monitor").offsets
    assert sum(o[2] for o in offsets) >= 20  # monitoring commits trail by up to one batch


def test_subscribe_pattern_picks_up_a_topic_created_while_running(
        spark: Any, module_broker: Broker, tmp_path: Path) -> None:
    """No restart needed: every trigger lists the topics again, and a new matching topic is
    read from its first offset (docs/spark.md, subscribePattern)."""
    addr = module_broker.address
    create_topic(addr, "pat-a", 2)
    produce(addr, "pat-a", [f"a{i}".encode() for i in range(40)])
    df = (spark.readStream.format("ferrymq").option("servers", addr)
          .option("subscribePattern", "pat-.*").option("startingOffsets", "earliest").load())
    q = (df.selectExpr("topic", "CAST(value AS STRING) AS v").writeStream.format("memory")
         .queryName("pat_out").option("checkpointLocation", checkpoint(tmp_path))
         .trigger(processingTime="200 milliseconds").start())

    def count() -> int:
        return int(spark.sql("SELECT count(*) AS n FROM pat_out").collect()[0].n)

    try:
        deadline = time.monotonic() + 120
        while count() < 40 and time.monotonic() < deadline:
            time.sleep(0.3)
        assert count() == 40
        create_topic(addr, "pat-b", 3)  # created while the query runs, data written at once
        produce(addr, "pat-b", [f"b{i}".encode() for i in range(30)])
        create_topic(addr, "other", 1)  # does not match
        produce(addr, "other", [b"no"] * 5)
        while count() < 70 and time.monotonic() < deadline:
            time.sleep(0.3)
        time.sleep(1.0)
    finally:
        q.stop()
    rows = spark.sql("SELECT topic, v FROM pat_out").collect()
    assert sorted(r.v for r in rows) == sorted([f"a{i}" for i in range(40)]
                                               + [f"b{i}" for i in range(30)])
    assert {r.topic for r in rows} == {"pat-a", "pat-b"}


def test_rows_carry_the_producers_trace_context(spark: Any, module_broker: Broker) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from ferrymq import tracing

    job = TracerProvider().get_tracer("job").start_span("enqueue")
    with trace.use_span(job, end_on_exit=True), Producer(module_broker.address) as p:
        p.send(Message("traced", b"t", properties={"n": "1"}))
    (row,) = _read(spark, module_broker, subscribe="traced", includeProperties="true").collect()
    props = dict(row.properties)
    assert props["n"] == "1" and "traceparent" in props
    ctx = trace.get_current_span(tracing.context_of(props)).get_span_context()
    assert ctx.is_valid and ctx.is_remote
    assert ctx.trace_id == job.get_span_context().trace_id
