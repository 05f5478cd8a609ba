"""Kafka batches are stored as they came and served back to Kafka readers unchanged; FerryMQ's
own readers (pull, simple consumer, tag filters) read the same messages converted. A real
broker over real sockets; the batches are built by kafka-python's record builder (a client
nobody here wrote), gzip-compressed as a client sends them."""

from __future__ import annotations

import datetime
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest
from kio.schema.errors import ErrorCode as KafkaError

from ferrymq import AdminClient, Broker, Message, Producer, PullConsumer, SimpleConsumer
from ferrymq.kafka import handlers as kafka_handlers
from ferrymq.protocol.kafka import apis, envelope
from ferrymq.protocol.kafka import records as kafka
from ferrymq.protocol.records import ATTR_HAS_KEYS, HEADER_SIZE
from tests.helpers import free_port, wait_for
from tests.kafka.test_kafka_wire import (
    _produce,
    connect,
    produce_partitions,
    read_frame,
    request,
)

default_records = pytest.importorskip("kafka.record.default_records")

pytestmark = pytest.mark.integration

GZIP = 1


def client_batch(first: int, n: int, *, codec: int = GZIP) -> bytes:
    """A batch as kafka-python's producer builds it: ``n`` records, a tag header on each
    (``a`` on odd ones, ``b`` on even ones), compressed with ``codec``."""
    b = default_records.DefaultRecordBatchBuilder(
        magic=2, compression_type=codec, is_transactional=False, producer_id=-1,
        producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
    for i in range(n):
        b.append(i, timestamp=1_700_000_000_000 + first + i, key=f"k{first + i}".encode(),
                 value=f"value {first + i} ".encode() * 10,
                 headers=[("ferrymq.tag", b"a" if (first + i) % 2 else b"b")])
    return bytes(b.build())


def kafka_fetch(s: socket.socket, topic: str, offset: int, partition: int = 0,
                max_bytes: int = 1 << 20) -> Any:
    """One Fetch v12 of ``partition`` from ``offset``: its partition answer."""
    req = apis.request_class(1, 12)
    res = apis.response_class(1, 12)
    assert req is not None
    assert res is not None
    body = apis.encode(apis.build(req, {
        "replica_id": -1, "max_wait": datetime.timedelta(milliseconds=100), "min_bytes": 1,
        "max_bytes": max_bytes, "isolation_level": 0, "session_id": 0, "session_epoch": -1,
        "topics": [{"topic": topic, "partitions": [{
            "partition": partition, "current_leader_epoch": -1, "fetch_offset": offset,
            "last_fetched_epoch": -1, "log_start_offset": -1,
            "partition_max_bytes": max_bytes}]}],
        "forgotten_topics_data": [], "rack_id": ""}))
    s.sendall(request(1, 12, 9, body, flexible=True))
    [part] = apis.decode_request(res, read_frame(s)[5:], 0).responses[0].partitions
    return part


def stamped(batch: bytes, base_offset: int) -> bytes:
    """``batch`` with the fields the broker stamps: its base offset, leader epoch -1."""
    out = bytearray(batch)
    struct.pack_into(">q", out, 0, base_offset)
    struct.pack_into(">i", out, 12, -1)
    return bytes(out)


def segment_bytes(b: Broker, topic: str) -> bytes:
    [seg] = sorted(Path(b.server.topics.queue(topic, 0).log.directory).glob("*.log"))
    return seg.read_bytes()


@pytest.fixture
def kbroker(tmp_path: Path) -> Any:
    b = Broker(tmp_path / "data", port=0, kafka_port=free_port(), default_queues=1).start()
    try:
        yield b
    finally:
        b.stop()


def test_a_kafka_batch_is_stored_as_sent_and_served_back_byte_identical(kbroker: Broker) -> None:
    kbroker.server.topics.create("raw", 1, {}, 0)
    with Producer(kbroker.address) as p:  # a FerryMQ batch first: the formats side by side
        p.send(Message("raw", b"native", tags="a"))
    sent = [client_batch(1, 5), client_batch(6, 3)]
    with connect(kbroker) as s:
        answers = [_produce(s, 2 + i, "raw", batch) for i, batch in enumerate(sent)]
        assert [(a.error_code, a.base_offset) for a in answers] == [
            (KafkaError.none, 1), (KafkaError.none, 6)]
        disk = segment_bytes(kbroker, "raw")
        # on disk: each batch as it was sent (still gzip), after its 64-byte FerryMQ header
        pos = len(disk) - len(sent[1]) - HEADER_SIZE - len(sent[0]) - HEADER_SIZE
        assert disk[pos + 28] == 2  # the envelope's magic
        first = disk[pos + HEADER_SIZE:pos + HEADER_SIZE + len(sent[0])]
        assert first == stamped(sent[0], 1)
        assert kafka.decode_header(first).attributes & kafka.COMPRESSION_MASK == GZIP
        assert disk[-len(sent[1]):] == stamped(sent[1], 6)
        # a Kafka reader gets them back as they are stored, after the converted FerryMQ one
        part = kafka_fetch(s, "raw", 1)
        assert part.error_code == KafkaError.none
        assert part.records == stamped(sent[0], 1) + stamped(sent[1], 6)
        whole = kafka_fetch(s, "raw", 0).records
        assert whole.endswith(part.records)
        assert kafka.decode_header(whole).record_count == 1  # the FerryMQ message, converted


def big_batch(first: int, n: int) -> bytes:
    """An uncompressed batch of ``n`` 1 KB records: larger than a read, so the broker reads
    the frame carrying it in place."""
    b = default_records.DefaultRecordBatchBuilder(
        magic=2, compression_type=0, is_transactional=False, producer_id=-1,
        producer_epoch=-1, base_sequence=-1, batch_size=1 << 22)
    for i in range(n):
        b.append(i, timestamp=1_700_000_000_000 + first + i, key=None,
                 value=f"{first + i:08d}".encode() * 128, headers=[])
    return bytes(b.build())


def test_large_frames_are_stored_as_sent_whether_wrapped_in_place_or_copied(
        kbroker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Produce frame larger than a read is read in place: its first batch is wrapped in the
    free bytes before it, the second (right after the first's records) copied. Both are
    stored as sent and read back whole by both protocols."""
    in_place: list[bool] = []

    def spy(data: Any, **kw: Any) -> Any:  # observes which way each batch went
        out = envelope.wrap(data, **kw)
        in_place.append(out is kw["roomy"])
        return out

    monkeypatch.setattr(kafka_handlers, "wrap", spy)
    kbroker.server.topics.create("big", 2, {}, 0)
    sent = [big_batch(0, 300), big_batch(300, 200)]
    assert sum(map(len, sent)) > 4 * 65536  # far more than a read
    with connect(kbroker) as s:
        parts = produce_partitions(s, 7, "big", sent)
        assert [(p.index, p.error_code, p.base_offset) for p in parts] == [
            (0, KafkaError.none, 0), (1, KafkaError.none, 0)]
        for q, batch in enumerate(sent):
            [seg] = sorted(Path(kbroker.server.topics.queue("big", q).log.directory)
                           .glob("*.log"))
            disk = seg.read_bytes()
            assert disk[28] == 2 and disk[HEADER_SIZE:] == stamped(batch, 0)
    for q, batch in enumerate(sent):
        with connect(kbroker) as s:
            fetch = kafka_fetch(s, "big", 0, q, 1 << 22)
        assert fetch.records == stamped(batch, 0)
    assert in_place == [True, False]
    got = _pull(kbroker, "big", 500)
    assert sorted(m.body[:8] for m in got) == [f"{i:08d}".encode() for i in range(500)]


def _pull(b: Broker, topic: str, n: int, tags: str = "*") -> list[Any]:
    group = "pull-all" if tags == "*" else f"pull-{tags}"
    with PullConsumer(b.address, group, auto_offset_reset="earliest") as c:
        c.subscribe(topic, tags)
        got: list[Any] = []
        deadline = time.monotonic() + 15
        while len(got) < n and time.monotonic() < deadline:
            got += c.poll(0.5)
    return got


def test_ferrymq_readers_get_the_kafka_messages_converted(kbroker: Broker) -> None:
    kbroker.server.topics.create("mixed", 1, {}, 0)
    with connect(kbroker) as s:
        assert _produce(s, 2, "mixed", client_batch(0, 6)).error_code == KafkaError.none
    with Producer(kbroker.address) as p:
        p.send(Message("mixed", b"native", tags="b"))
    with connect(kbroker) as s:
        assert _produce(s, 3, "mixed", client_batch(7, 4)).error_code == KafkaError.none
    values = [f"value {i} ".encode() * 10 for i in range(11)]
    values[6] = b"native"

    got = _pull(kbroker, "mixed", 11)
    assert [(m.offset, m.body) for m in got] == list(enumerate(values))
    assert [m.tags for m in got] == ["b", "a"] * 5 + ["b"]
    assert got[0].sharding_key == "k0"
    assert got[0].born_ms == 1_700_000_000_000

    only_a = _pull(kbroker, "mixed", 5, tags="a")
    assert [m.offset for m in only_a] == [1, 3, 5, 7, 9]
    assert {m.tags for m in only_a} == {"a"}

    received: list[Any] = []
    with SimpleConsumer(kbroker.address, "simple", invisible_duration=10) as sc:
        sc.subscribe("mixed")
        deadline = time.monotonic() + 15
        while len(received) < 11 and time.monotonic() < deadline:
            batch = sc.receive(32, wait=0.5)
            received += batch
            if batch:
                sc.ack_batch(batch)
    assert sorted(m.body for m in received) == sorted(values)


def keyed_batch(first: int, n: int, *, codec: int = 0) -> bytes:
    """``n`` records, the even ones carrying the FerryMQ key ``order-<i>`` as a header
    (kafka-python leaves a batch uncompressed when compressing would not make it smaller)."""
    b = default_records.DefaultRecordBatchBuilder(
        magic=2, compression_type=codec, is_transactional=False, producer_id=-1,
        producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
    for i in range(first, first + n):
        b.append(i - first, timestamp=1_700_000_000_000 + i, key=None, value=f"m{i}".encode(),
                 headers=[("ferrymq.key", f"order-{i}".encode())] if i % 2 == 0 else [])
    return bytes(b.build())


@pytest.fixture
def keyed_kbroker(tmp_path: Path) -> Any:
    b = Broker(tmp_path / "data", port=0, kafka_port=free_port(), default_queues=1,
               kafka_key_headers_indexed=True).start()
    try:
        yield b
    finally:
        b.stop()


def test_by_default_kafka_batches_are_not_scanned_for_ferrymq_keys(kbroker: Broker) -> None:
    """A Kafka produce costs no scan of its batch: keyed or not, nothing is marked, so a
    search by key does not find Kafka-produced messages; FerryMQ readers still get the keys."""
    kbroker.server.topics.create("keys", 1, {}, 0)
    with connect(kbroker) as s:
        assert _produce(s, 2, "keys", keyed_batch(0, 4)).error_code == KafkaError.none
    assert not segment_bytes(kbroker, "keys")[29] & ATTR_HAS_KEYS
    with AdminClient(kbroker.address) as admin:
        assert admin.find_by_key("keys", "order-2").messages == []
    got = _pull(kbroker, "keys", 4)
    assert [list(m.keys) for m in got] == [["order-0"], [], ["order-2"], []]


def test_ferrymq_keys_of_kafka_messages_are_indexed_and_only_keyed_batches_marked(
        keyed_kbroker: Broker) -> None:
    kbroker = keyed_kbroker
    kbroker.server.topics.create("keys", 1, {}, 0)
    with connect(kbroker) as s:
        for i, batch in enumerate([client_batch(0, 4, codec=0), keyed_batch(4, 4),
                                   keyed_batch(8, 20, codec=GZIP)]):
            assert _produce(s, 2 + i, "keys", batch).error_code == KafkaError.none
    with AdminClient(kbroker.address) as admin:  # at once: the tail searched as the index does
        early = admin.find_by_key("keys", "order-6")
    disk = segment_bytes(kbroker, "keys")
    first = disk[29]
    second = disk[HEADER_SIZE + len(client_batch(0, 4, codec=0)) + 29]
    assert (first & ATTR_HAS_KEYS, second & ATTR_HAS_KEYS) == (0, ATTR_HAS_KEYS)
    t = kbroker.server.topics.topics["keys"]
    index = kbroker.server.key_index
    wait_for(lambda: (t.topic_id, 0) in index.indexes
             and index.indexes[(t.topic_id, 0)].next_offset >= 28, timeout=15)
    with AdminClient(kbroker.address) as admin:
        found = admin.find_by_key("keys", "order-6")
        compressed = admin.find_by_key("keys", "order-8")
    for search in (early, found):
        assert (search.unindexed, [(m.offset, m.keys) for m in search.messages]) == (
            0, [(6, ["order-6"])])
    assert kafka.decode_header(keyed_batch(8, 20, codec=GZIP)).attributes == GZIP
    assert compressed.messages == []  # a compressed Kafka batch's keys are not indexed


def test_a_fetch_with_nothing_to_read_answers_empty_records_not_null(kbroker: Broker) -> None:
    """librdkafka refuses a null record set ("invalid MessageSetSize -1"); Kafka sends an
    empty one."""
    kbroker.server.topics.create("quiet", 1, {}, 0)
    with connect(kbroker) as s:
        part = kafka_fetch(s, "quiet", 0)
    assert (part.error_code, part.high_watermark, part.records) == (KafkaError.none, 0, b"")


def test_kafka_produce_and_fetch_are_counted_in_metrics(tmp_path: Path) -> None:
    """/metrics counts the Kafka port's Produce and Fetch (api kafka_produce, kafka_fetch)
    with their bytes, apart from the native port's."""
    from tests.integration.test_http import scrape, value

    http = free_port()
    with Broker(tmp_path / "data", port=0, kafka_port=free_port(), http_port=http,
                default_queues=1) as b:
        b.server.topics.create("counted", 1, {}, 0)
        batch = client_batch(0, 3)
        with connect(b) as s:
            for i in range(2):
                assert _produce(s, 2 + i, "counted", batch).error_code == KafkaError.none
            assert kafka_fetch(s, "counted", 0).error_code == KafkaError.none
        samples, _ = scrape(http)
    assert value(samples, "ferrymq_requests_total", api="kafka_produce") == 2
    assert value(samples, "ferrymq_requests_total", api="kafka_fetch") == 1
    assert value(samples, "ferrymq_request_bytes_total", api="kafka_produce") > 2 * len(batch)
    assert value(samples, "ferrymq_response_bytes_total", api="kafka_fetch") > 2 * len(batch)
    assert value(samples, "ferrymq_requests_total", api="produce") == 0
