"""The stream and batch readers' planning against a real broker, called the way Spark's source
runner calls them (no JVM needed): sticky starting points, committed offsets, data loss,
minOffsetsPerTrigger."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from ferrymq import AdminClient, Broker, Message, Producer, PullConsumer
from ferrymq.errors import ConnectionClosedError
from ferrymq.spark.source import (
    DataLossError,
    FerryMQBatchReader,
    FerryMQStreamReader,
    QueueRange,
    read_range,
)
from tests.helpers import wait_for
from tests.spark.helpers import create_topic, produce

pytestmark = pytest.mark.integration


def _rows(parts: list[QueueRange]) -> list[tuple[int, int, bytes]]:
    out = []
    for p in parts:
        for rb in read_range(p):
            for r in rb.select(["queue", "offset", "value"]).to_pylist():
                out.append((r["queue"], r["offset"], r["value"]))
    return sorted(out)


def test_latest_start_replays_batch_zero_exactly(module_broker: Broker) -> None:
    addr = module_broker.address
    create_topic(addr, "sticky", 2)
    produce(addr, "sticky", [b"old"] * 10)
    opts = {"servers": addr, "subscribe": "sticky", "startingoffsets": "latest"}
    first = FerryMQStreamReader(opts)
    init = first.initialOffset()
    produce(addr, "sticky", [b"batch0"] * 50)
    end = first.latestOffset(init, ReadAllAvailable())  # Spark writes this to offsets/0
    json.dumps(end)  # JSON-safe
    # the query dies before batch 0 commits; more data arrives; Spark restarts it
    produce(addr, "sticky", [b"later"] * 30)
    second = FerryMQStreamReader(opts)
    init_again = second.initialOffset()
    assert init_again != init  # "latest" moved on...
    rows = _rows(list(second.partitions(init_again, end)))  # ...but batch 0 reads what it planned
    assert [v for _, _, v in rows] == [b"batch0"] * 50
    # and no data is lost or repeated in the next batch
    nxt = second.latestOffset(end, ReadAllAvailable())
    assert [v for _, _, v in _rows(list(second.partitions(end, nxt)))] == [b"later"] * 30
    assert second.latestOffset(nxt, ReadAllAvailable()) is nxt or \
        second.latestOffset(nxt, ReadAllAvailable()) == nxt  # nothing new: same offset, no batch


def test_committed_start_with_fallback(module_broker: Broker) -> None:
    addr = module_broker.address
    create_topic(addr, "comm", 2)
    produce(addr, "comm", [b"x"] * 40, sharding_key="k")
    with AdminClient(addr) as admin:
        q = admin.describe_topic("comm").queues
    full = next(row[0] for row in q if row[2] > 0)
    with PullConsumer(addr, "billing", auto_commit=False) as c:
        c.assign([("comm", full)])
        c.commit({("comm", full): 25})
    reader = FerryMQStreamReader({"servers": addr, "subscribe": "comm",
                                  "startingoffsets": "committed", "group": "billing"})
    init = reader.initialOffset()
    assert init["comm"][str(full)] == 25
    assert init["comm"][str(1 - full)] == 0  # no commit there: startingOffsetsFallback=earliest


def test_max_rows_limit_and_min_offsets_per_trigger(module_broker: Broker) -> None:
    addr = module_broker.address
    create_topic(addr, "minmax", 3)
    produce(addr, "minmax", [b"x"] * 25)
    reader = FerryMQStreamReader({"servers": addr, "subscribe": "minmax",
                                  "startingoffsets": "earliest", "maxoffsetspertrigger": "40",
                                  "minoffsetspertrigger": "30", "maxtriggerdelay": "1s"})
    assert reader.getDefaultReadLimit() == ReadMaxRows(40)
    init = reader.initialOffset()
    assert reader.latestOffset(init, ReadMaxRows(40)) is init  # 25 < 30: wait
    time.sleep(1.1)  # maxTriggerDelay passed: run with what there is
    end = reader.latestOffset(init, ReadMaxRows(40))
    assert len(_rows(list(reader.partitions(init, end)))) == 25
    produce(addr, "minmax", [b"y"] * 100)
    capped = reader.latestOffset(end, ReadMaxRows(40))  # enough now, at most 40
    assert len(_rows(list(reader.partitions(end, capped)))) == 40


def test_data_loss_is_named_or_skipped(tmp_path: Path) -> None:
    with Broker(tmp_path / "d", retention_check_interval_ms=100) as b:
        with AdminClient(b.address) as admin:
            admin.create_topic("lossy", 1, {"segment_bytes": "4096", "retention_bytes": "8192"})
        with Producer(b.address) as p:
            for _ in range(20):
                p.send_batch([Message("lossy", b"x" * 200) for _ in range(5)])
        log = b.server.topics.queue("lossy", 0).log
        wait_for(lambda: log.start_offset > 0, timeout=10)
        first = log.start_offset
        opts = {"servers": b.address, "subscribe": "lossy",
                "startingoffsets": '{"lossy": {"0": 0}}'}
        with pytest.raises(DataLossError, match=f"lossy/0 offsets 0..{first - 1}"):
            FerryMQBatchReader(opts).partitions()
        parts = FerryMQBatchReader({**opts, "failondataloss": "false"}).partitions()
        assert [r[1] for r in _rows(list(parts))] == list(range(first, 100))
        # a task whose planned range was deleted meanwhile
        stale = QueueRange(b.address, "lossy", 0, 0, 100, "*", True, False, 1 << 20)
        with pytest.raises(DataLossError, match="lossy/0 offsets 0"):
            _rows([stale])
        skipping = QueueRange(b.address, "lossy", 0, 0, 100, "*", False, False, 1 << 20)
        assert [r[1] for r in _rows([skipping])] == list(range(first, 100))


def test_latest_offset_waits_out_a_broker_restart_up_to_retry_timeout(tmp_path: Path) -> None:
    """Between micro-batches the driver's look-up retries brokers that do not answer (here the
    only one restarts) for up to option retryTimeout, then fails naming it, as Kafka's source
    waits out a broker restart; it used to fail the query at once."""
    b = Broker(tmp_path / "d").start()
    port = int(b.address.rsplit(":", 1)[1])
    create_topic(b.address, "restarts", 2)
    produce(b.address, "restarts", [b"a"] * 10)
    opts = {"servers": b.address, "subscribe": "restarts", "startingoffsets": "earliest"}
    patient = FerryMQStreamReader(opts)  # the default retryTimeout, 30 s
    quick = FerryMQStreamReader({**opts, "retrytimeout": "1s"})
    end = patient.latestOffset(patient.initialOffset(), ReadAllAvailable())
    b.stop()
    restarted: list[Broker] = []
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionClosedError, match=r"still failing after 1 s of retries "
                           r"\(option 'retryTimeout'\): .*unreachable"):
            quick.latestOffset(end, ReadAllAvailable())
        assert 1 <= time.monotonic() - t0 < 10

        def restart() -> None:
            time.sleep(1)
            restarted.append(Broker(tmp_path / "d", port=port).start())

        t0 = time.monotonic()
        thread = threading.Thread(target=restart)
        thread.start()
        assert patient.latestOffset(end, ReadAllAvailable()) == end  # nothing new, no error
        thread.join()
        assert time.monotonic() - t0 >= 1 and restarted
        produce(restarted[0].address, "restarts", [b"b"] * 5)
        after = patient.latestOffset(end, ReadAllAvailable())
        assert [v for _, _, v in _rows(list(patient.partitions(end, after)))] == [b"b"] * 5
    finally:
        patient.stop()
        for r in restarted:
            r.stop()


def test_pattern_picks_up_new_topics_from_their_start(module_broker: Broker) -> None:
    addr = module_broker.address
    create_topic(addr, "pat-a", 1)
    produce(addr, "pat-a", [b"a"] * 5)
    reader = FerryMQStreamReader({"servers": addr, "subscribepattern": "pat-.*",
                                  "startingoffsets": "latest"})
    init = reader.initialOffset()
    assert init == {"pat-a": {"0": 5}}
    create_topic(addr, "pat-b", 2)  # appears while the query runs
    produce(addr, "pat-b", [b"b"] * 7)
    produce(addr, "pat-a", [b"a2"] * 2)
    end = reader.latestOffset(init, ReadAllAvailable())
    assert sorted(v for _, _, v in _rows(list(reader.partitions(init, end)))) == [b"a2"] * 2 + [b"b"] * 7
    with AdminClient(addr) as admin:
        admin.create_topic("__ferrymq_spark_sinks_like", 1)  # internal names never match
    assert "__ferrymq_spark_sinks_like" not in reader.latestOffset(end, ReadAllAvailable())


def test_read_committed_skips_aborted_and_open_transactions(module_broker: Broker) -> None:
    addr = module_broker.address
    create_topic(addr, "txn", 1)
    produce(addr, "txn", [b"plain-1"])
    with Producer(addr, transactional_id="spark-test-txn") as p:
        p.begin()
        p.send_batch([Message("txn", b"aborted")] * 3)
        p.abort()
        p.begin()
        p.send_batch([Message("txn", b"committed")] * 2)
        p.commit()
        p.begin()
        p.send(Message("txn", b"open"))  # still open when the query plans
        base = {"servers": addr, "subscribe": "txn"}
        committed = _rows(list(FerryMQBatchReader(base).partitions()))  # the default
        uncommitted = _rows(list(FerryMQBatchReader({**base, "isolationlevel": "read_uncommitted"})
                                 .partitions()))
        p.abort()
    assert [v for _, _, v in committed] == [b"plain-1", b"committed", b"committed"]
    assert [v for _, _, v in uncommitted] == [b"plain-1"] + [b"aborted"] * 3 + [b"committed"] * 2 \
        + [b"open"]
