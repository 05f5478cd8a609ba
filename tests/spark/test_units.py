"""Pure parts of the connector: options, offsets arithmetic, Arrow decoding of record batches."""

from __future__ import annotations

import random
import time
from typing import Any

import pyarrow as pa
import pytest

from ferrymq.errors import ConfigError, ConnectionClosedError, LeaderNotAvailableError, NotLeaderError
from ferrymq.protocol.markers import encode_marker
from ferrymq.protocol.records import (
    ATTR_SCHEDULED,
    RecordInput,
    decode_records,
    encode_batch,
    encode_properties,
    stamp_batch,
)
from ferrymq.spark._route import RetryWindow
from ferrymq.spark.arrow import arrow_schema, scan, to_record_batch
from ferrymq.spark.offsets import batch_start, cap_offsets, from_json_dict, split_range, to_json_dict
from ferrymq.spark.options import SinkOptions, SourceOptions
from ferrymq.spark.sink import encode_batches
from ferrymq.spark.source import plan_ranges


@pytest.mark.parametrize(("options", "message"), [
    ({}, "exactly one of the options 'subscribe'"),
    ({"subscribe": "a", "assign": '{"a": [0]}'}, "got subscribe, assign"),
    ({"assign": "[1]"}, "option 'assign'"),
    ({"subscribepattern": "("}, "option 'subscribePattern'"),
    ({"subscribe": "a", "startingoffsets": "middle"}, "option 'startingOffsets'"),
    ({"subscribe": "a", "startingoffsets": '{"a": {"0": -3}}'}, "option 'startingOffsets'"),
    ({"subscribe": "a", "startingoffsets": "committed"}, "needs option 'group'"),
    ({"subscribe": "a", "maxoffsetspertrigger": "0"}, "option 'maxOffsetsPerTrigger'"),
    ({"subscribe": "a", "failondataloss": "maybe"}, "option 'failOnDataLoss': expected true or false"),
    ({"subscribe": "a", "maxtriggerdelay": "soon"}, "option 'maxTriggerDelay'"),
    ({"subscribe": "a", "retrytimeout": "-1s"}, "option 'retryTimeout'"),
    ({"subscribe": "a", "tags": "a ||"}, "option 'tags'"),
    ({"subscribe": "a", "endingoffsets": "latest"}, "batch reads only"),
])
def test_malformed_source_options_name_the_option(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SourceOptions.parse(options, streaming=True)


def test_source_option_defaults_and_values() -> None:
    o = SourceOptions.parse({"subscribe": "a, b", "maxtriggerdelay": "30s",
                             "startingoffsets": '{"a": {"0": 5, "1": -2}}'}, streaming=True)
    assert o.subscription.topics == ("a", "b")
    assert o.starting == {("a", 0): 5, ("a", 1): -2}
    assert o.max_trigger_delay_ms == 30_000 and o.fail_on_data_loss and o.tags == "*"
    assert o.retry_timeout_s == 30.0  # retryTimeout, Kafka-like patience through a failover
    quick = SourceOptions.parse({"subscribe": "a", "retrytimeout": "1500ms"}, streaming=True)
    assert quick.retry_timeout_s == 1.5
    ranges = plan_ranges(quick, {("a", 0): 0}, {("a", 0): 10})
    assert [r.retry_timeout_s for r in ranges] == [1.5]  # a task carries it to the executor
    assert SourceOptions.parse({"subscribe": "a"}, streaming=False).starting == "earliest"
    with pytest.raises(ConfigError, match="latest would read nothing"):
        SourceOptions.parse({"subscribe": "a", "startingoffsets": "latest"}, streaming=False)


def test_sink_options() -> None:
    assert SinkOptions.parse({}).delivery_mode == "transactional"
    assert SinkOptions.parse({"deliverymode": "atleastonce"}).delivery_mode == "atLeastOnce"
    assert SinkOptions.parse({"deliverymode": "Idempotent"}).delivery_mode == "idempotent"
    assert SinkOptions.parse({"checkpointlocation": "/c"}).sink_id == "/c"
    o = SinkOptions.parse({"transactiontimeout": "20s", "stagedttl": "10m"})
    assert (o.transaction_timeout_ms, o.staged_ttl_ms) == (20_000, 600_000)
    assert SinkOptions.parse({}).transaction_timeout_ms is None
    with pytest.raises(ConfigError, match="option 'deliveryMode'"):
        SinkOptions.parse({"deliverymode": "exactly"})
    with pytest.raises(ConfigError, match="option 'stagedTtl'"):
        SinkOptions.parse({"stagedttl": "forever"})


@pytest.mark.parametrize(("options", "message"), [
    ({"auth.user": "app"}, "'auth.user' and 'auth.secret' go together"),
    ({"auth.secret": "s"}, "'auth.user' and 'auth.secret' go together"),
    ({"auth.user": "bad name", "auth.secret": "s"}, "option 'auth.user'"),
    ({"tls": "false", "tls.cafile": "/ca.pem"}, "need tls=true"),
    ({"tls": "sometimes"}, "option 'tls'"),
    ({"tls.certfile": "/c.pem"}, "'tls.certfile' and 'tls.keyfile' go together"),
])
def test_malformed_security_options(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SinkOptions.parse(options)
    with pytest.raises(ConfigError, match=message):
        SourceOptions.parse({"subscribe": "a", **options}, streaming=True)


def test_security_options() -> None:
    wire = SourceOptions.parse({"subscribe": "a", "servers": "h:1", "auth.user": "app",
                                "auth.secret": " s3cret ", "tls.cafile": "/ca.pem"},
                               streaming=True).wire
    assert (wire.servers, wire.user, wire.secret, wire.tls, wire.tls_cafile) == (
        "h:1", "app", " s3cret ", True, "/ca.pem")
    assert "s3cret" not in repr(wire) and str(wire) == "h:1"
    plain = SinkOptions.parse({}).wire
    assert not plain.tls and plain.user is None and plain.tls_context() is None


def test_broker_names_of_sinks_fit_the_broker() -> None:
    from ferrymq.protocol.messages import MAX_NAME_CHARS
    from ferrymq.spark.sink import broker_sink_id, transactional_id

    assert broker_sink_id("/chk/q1") == "/chk/q1"
    long = "/very/long/" + "x" * 400
    short = broker_sink_id(long)
    assert short == broker_sink_id(long) and short != broker_sink_id(long + "y")
    assert len(transactional_id(short, 65535, 99)) <= MAX_NAME_CHARS


def test_offsets_json_is_deterministic_and_carries_the_batch_start() -> None:
    end = {("b", 10): 5, ("b", 2): 7, ("a", 0): 1}
    d = to_json_dict(end, start={("a", 0): 0, ("b", 2): 7, ("b", 10): 1})
    assert list(d) == ["a", "b", "@from"] and list(d["b"]) == ["2", "10"]
    assert from_json_dict(d) == end
    assert batch_start(d) == {("a", 0): 0, ("b", 2): 7, ("b", 10): 1}
    assert batch_start(to_json_dict(end)) is None


def test_cap_offsets_is_proportional_and_never_starves() -> None:
    start = {("t", 0): 0, ("t", 1): 0, ("t", 2): 100}
    latest = {("t", 0): 1000, ("t", 1): 2, ("t", 2): 100}
    end = cap_offsets(start, latest, 100)
    assert end[("t", 1)] == 1  # a small backlog still advances
    assert end[("t", 2)] == 100
    assert 95 <= end[("t", 0)] <= 100
    assert sum(end[tq] - start[tq] for tq in end) <= 101
    assert cap_offsets(start, latest, 10_000) == latest


def test_split_range() -> None:
    assert split_range(0, 0, 4, None) == []
    assert split_range(10, 20, 3, None) == [(10, 13), (13, 17), (17, 20)]
    assert split_range(0, 10, 1, 4) == [(0, 3), (3, 7), (7, 10)]
    assert split_range(0, 2, 8, None) == [(0, 1), (1, 2)]


def _stamped(records: list[RecordInput], base: int, **kw: int) -> bytes:
    b = encode_batch(records, **kw)
    stamp_batch(b, 0, base, 1_700_000_000_000)
    return bytes(b)


def test_arrow_rows_equal_the_reference_decoder() -> None:
    rng = random.Random(7)
    batches, base = [], 0
    for _ in range(20):
        recs = []
        for _ in range(rng.randint(1, 50)):
            recs.append(RecordInput(
                rng.randbytes(rng.randint(0, 300)), 1_700_000_000_000 + rng.randint(0, 10_000),
                tag=rng.choice([b"", b"created", b"paid"]),
                sharding_key=rng.choice([b"", b"customer-\xc3\xa9"]),
                keys=rng.choice([b"", b"k1", b"k1\x00k2"]),
                properties=rng.choice([b"", encode_properties({"a": "1", "b": "x"})]),
            ))
        batches.append(_stamped(recs, base))
        base += len(recs)
    data = b"".join(batches)
    expected = [r for r in decode_records(data) if 7 <= r.offset < base - 3]
    rb = to_record_batch(scan(data, 7), "t", 3, 9, 7, base - 3, arrow_schema(True))
    assert rb is not None and rb.schema == arrow_schema(True)
    rows = rb.to_pylist()
    assert len(rows) == len(expected)
    for row, rec in zip(rows, expected, strict=True):
        assert row["offset"] == rec.offset and row["value"] == rec.body
        assert row["tags"] == rec.tag and row["sharding_key"] == rec.sharding_key
        assert row["key"] == (rec.sharding_key.encode() if rec.sharding_key else None)
        assert row["keys"] == list(rec.keys)
        assert dict(row["properties"]) == rec.properties
        assert int(row["timestamp"].timestamp() * 1000) == rec.timestamp
        assert row["msg_id"] == f"{9:08X}{3:04X}{rec.offset:016X}"
        assert row["topic"] == "t" and row["queue"] == 3


def test_scheduled_and_control_batches_are_not_rows() -> None:
    plain = _stamped([RecordInput(b"a", 1), RecordInput(b"b", 1)], 0)
    scheduled = _stamped([RecordInput(b"later", 1, properties=encode_properties({"%DELAY": "5"}))],
                         2, attributes=ATTR_SCHEDULED)
    marker = bytearray(encode_marker(producer_id=1, producer_epoch=0, commit=True,
                                     transactional_id="x", coordinator_offset=0, timestamp_ms=1))
    stamp_batch(marker, 0, 3, 1)
    tail = _stamped([RecordInput(b"c", 1)], 4)
    chunk = scan(plain + scheduled + bytes(marker) + tail, 0)
    assert chunk.next_offset == 5
    rb = to_record_batch(chunk, "t", 0, 1, 0, 5, arrow_schema(False))
    assert rb is not None
    assert rb.column("value").to_pylist() == [b"a", b"b", b"c"]
    assert rb.column("offset").to_pylist() == [0, 1, 4]


def test_sink_encoding_round_trips() -> None:
    cols = {
        "value": pa.array([b"x" * i for i in range(1000)], pa.binary()),
        "tags": pa.array([None if i % 2 else "t" for i in range(1000)], pa.string()),
        "keys": pa.array([["a", "b"] if i % 3 == 0 else [] for i in range(1000)]),
        "properties": pa.array([[("p", str(i))] if i % 5 == 0 else [] for i in range(1000)],
                               pa.map_(pa.string(), pa.string())),
        "sharding_key": pa.array([f"s{i}" for i in range(1000)]),
    }
    out = encode_batches(cols, 1_700_000_000_000, producer_id=5, epoch=0, next_seq=10,
                         max_records=300, max_bytes=100_000)
    assert sum(k for _, k in out) == 1000 and all(k <= 300 for _, k in out)
    data = b""
    base = 0
    for buf, k in out:
        stamp_batch(buf, 0, base, 1)
        data += bytes(buf)
        base += k
    recs = decode_records(data)
    assert [r.body for r in recs] == [b"x" * i for i in range(1000)]
    assert [r.tag for r in recs] == [None if i % 2 else "t" for i in range(1000)]
    assert [r.keys for r in recs] == [("a", "b") if i % 3 == 0 else () for i in range(1000)]
    assert [r.properties for r in recs] == [{"p": str(i)} if i % 5 == 0 else {} for i in range(1000)]
    assert [r.sharding_key for r in recs] == [f"s{i}" for i in range(1000)]


def test_public_surface() -> None:
    import ferrymq.spark
    import pyspark_ferrymq

    assert sorted(ferrymq.spark.__all__) == ["DATA_SOURCE_NAME", "DataLossError", "FerryMQDataSource",
                                             "SinkOptions", "SourceOptions", "register"]
    assert pyspark_ferrymq.DefaultSource is ferrymq.spark.FerryMQDataSource
    assert pyspark_ferrymq.DefaultSource.name() == "ferrymq"


def test_route_queue_column_then_stable_key_hash_then_sticky() -> None:
    import numpy as np

    from ferrymq.client.partitioner import queue_for_key
    from ferrymq.spark.sink import route

    cols = {
        "queue": pa.array([2, None, None, None], pa.int32()),
        "sharding_key": pa.array(["a", "customer-7", None, ""]),
    }
    q = route(cols, np.array([4, 4, 4, 4]), sticky=9)
    assert q.tolist() == [2, queue_for_key("customer-7", 4), 9 % 4, 9 % 4]
    with pytest.raises(ConfigError, match="'queue' value"):
        route({"queue": pa.array([4])}, np.array([4]), sticky=0)
    binary = route({"key": pa.array([b"customer-7"])}, np.array([3]), sticky=0)
    assert binary.tolist() == [queue_for_key("customer-7", 3)]


def _schema(**columns: object) -> Any:
    from pyspark.sql.types import StructField, StructType

    return StructType([StructField(n, t) for n, t in columns.items()])  # type: ignore[arg-type]


def test_sink_schema_errors_name_the_column() -> None:
    from pyspark.sql.types import ArrayType, BinaryType, IntegerType, MapType, StringType

    from ferrymq.spark.sink import check_sink_schema

    cases: list[tuple[Any, dict[str, str], str]] = [
        (_schema(body=BinaryType()), {"topic": "t"},
         r"needs a 'value' column \(binary or string\); got columns \['body'\]"),
        (_schema(value=BinaryType()), {}, "needs option 'topic' or a 'topic' column"),
        (_schema(value=IntegerType()), {"topic": "t"},
         "column 'value' has type int; expected binary or string"),
        (_schema(value=StringType(), queue=StringType()), {"topic": "t"},
         "column 'queue' has type string; expected integer or long"),
        (_schema(value=BinaryType(), keys=ArrayType(IntegerType())), {"topic": "t"},
         "'keys' must be array<string>"),
        (_schema(value=BinaryType(), properties=MapType(StringType(), IntegerType())),
         {"topic": "t"}, "'properties' must be map<string,string>"),
    ]
    for schema, options, message in cases:
        with pytest.raises(ConfigError, match=message):
            check_sink_schema(schema, SinkOptions.parse(options))


def test_sink_schema_ignores_columns_it_does_not_know() -> None:
    from pyspark.sql.types import LongType, StringType

    from ferrymq.spark.sink import check_sink_schema

    # a topic copied with readStream...writeStream keeps the source's offset column
    check_sink_schema(_schema(value=StringType(), topic=StringType(), offset=LongType()),
                      SinkOptions.parse({}))


def test_sink_encoding_refuses_oversized_tags_and_keys() -> None:
    with pytest.raises(ConfigError, match="'tags' value is longer than 255 bytes"):
        encode_batches({"value": pa.array([b"v"]), "tags": pa.array(["t" * 256])}, 0,
                       producer_id=-1, epoch=-1, next_seq=0, max_records=10)
    with pytest.raises(ConfigError, match="longer than 65535 bytes"):
        encode_batches({"value": pa.array([b"v"]), "key": pa.array(["k" * 65536])}, 0,
                       producer_id=-1, epoch=-1, next_seq=0, max_records=10)
    assert encode_batches({"value": pa.array([], pa.binary())}, 0, producer_id=-1, epoch=-1,
                          next_seq=0, max_records=10) == []


def test_fence_keys_name_the_sink_and_the_batch() -> None:
    from ferrymq.spark.sink import fence_key

    assert fence_key("/chk/q1", 7) == "/chk/q1#7"
    assert fence_key("a\x00b", 0) == "ab#0"  # a NUL cannot end up inside a key


def test_sink_parts_stay_importable_from_sink() -> None:
    """The sink's parts moved to private modules; what code imported from
    ``ferrymq.spark.sink`` keeps working."""
    import ast
    import inspect

    import ferrymq.spark.sink as sink
    from ferrymq.spark import _sink_batches, _sink_commit, _sink_task

    for part in (_sink_batches, _sink_commit, _sink_task):
        tree = ast.parse(inspect.getsource(part))
        names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        names += [t.id for n in tree.body if isinstance(n, ast.Assign)
                  for t in n.targets if isinstance(t, ast.Name)]
        public = [n for n in names if not n.startswith("_") and n != "log"]
        assert public, part
        for name in public:
            assert getattr(sink, name) is getattr(part, name), name
            assert name in sink.__all__, name


def test_a_retry_window_runs_from_the_first_failure_and_ends_with_the_last_error_named() -> None:
    window = RetryWindow("fetch of t/0", 0.2)
    window.failed(ConnectionClosedError("refused"))  # opens the window
    time.sleep(0.25)
    with pytest.raises(ConnectionClosedError, match=r"^fetch of t/0: still failing after 0.2 s "
                       r"of retries \(option 'retryTimeout'\): refused$"):
        window.failed(ConnectionClosedError("refused"))
    window.succeeded()
    window.failed(NotLeaderError("moved"))  # a success closed the run: a new window
    with pytest.raises(LeaderNotAvailableError, match=r"after 0 s .*: no leader"):
        RetryWindow("list offsets", 0).failed(LeaderNotAvailableError("no leader"))


def test_the_cluster_refusal_s_old_name_is_a_deprecated_alias() -> None:
    """``refuse_transactions_on_a_cluster`` (transactions were refused on a cluster before they
    failed over) still imports, as ``check_brokers``, with a DeprecationWarning."""
    import ferrymq.spark.sink as sink

    with pytest.warns(DeprecationWarning, match="check_brokers"):
        old = sink.refuse_transactions_on_a_cluster
    assert old is sink.check_brokers
