"""The Kafka port at the byte level, over a real socket to a real broker: what it answers to
requests it does not serve and to bytes that are not Kafka, and that it survives both."""

from __future__ import annotations

import datetime
import logging
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kio.schema.errors import ErrorCode as KafkaError
from kio.schema.metadata.v12.request import MetadataRequest, MetadataRequestTopic

from ferrymq import Broker
from ferrymq.protocol.kafka import apis
from ferrymq.protocol.kafka.records import to_kafka
from ferrymq.protocol.records import RecordInput, encode_batch
from tests.helpers import free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def kbroker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path / "data", port=0, kafka_port=free_port(),
               max_frame_bytes=1024 * 1024, max_message_bytes=512 * 1024,
               max_fetch_bytes=256 * 1024, max_write_queue_bytes=4 * 1024 * 1024,
               max_write_buffer_bytes=1024 * 1024).start()
    try:
        yield b
    finally:
        b.stop()


def connect(b: Broker) -> socket.socket:
    assert b.server.kafka is not None
    s = socket.create_connection(b.server.kafka.address, timeout=10)
    return s


def request(key: int, version: int, correlation_id: int, body: bytes = b"", *,
            flexible: bool = False, client_id: bytes = b"wire-test") -> bytes:
    header = struct.pack(">hhih", key, version, correlation_id, len(client_id)) + client_id
    if flexible:
        header += b"\x00"  # no tagged fields
    payload = header + body
    return struct.pack(">i", len(payload)) + payload


def read_frame(s: socket.socket) -> bytes:
    size = struct.unpack(">i", recv_exactly(s, 4))[0]
    return recv_exactly(s, size)


def recv_exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def api_versions(s: socket.socket, version: int, correlation_id: int) -> tuple[int, bytes]:
    """Send ApiVersions at ``version`` (v3 with the client software fields); the answer's
    correlation id and body (its header is v0 whatever the version)."""
    body = b"\x05wire\x021\x00" if version >= 3 else b""
    s.sendall(request(18, version, correlation_id, body, flexible=version >= 3))
    raw = read_frame(s)
    return struct.unpack_from(">i", raw)[0], raw[4:]


@pytest.mark.parametrize("version", [0, 1, 2, 3])
def test_api_versions_lists_exactly_what_is_served(kbroker: Broker, version: int) -> None:
    with connect(kbroker) as s:
        corr, body = api_versions(s, version, 41)
    cls = apis.response_class(18, version)
    assert cls is not None
    res = apis.decode_request(cls, body, 0)  # kio's reader reads responses too
    assert corr == 41
    assert res.error_code == KafkaError.none
    assert {k.api_key: (k.min_version, k.max_version) for k in res.api_keys} == {
        0: (3, 9), 1: (4, 12), 2: (1, 6), 3: (0, 12), 8: (2, 8), 9: (1, 7), 10: (0, 3),
        11: (0, 7), 12: (0, 4), 13: (0, 4), 14: (0, 5), 15: (0, 5), 16: (0, 4), 17: (0, 1),
        18: (0, 3), 19: (2, 5), 20: (1, 5), 22: (0, 4), 23: (2, 4), 24: (0, 3), 25: (0, 3),
        26: (0, 3),
        28: (0, 3), 32: (1, 4), 36: (0, 2), 42: (0, 2), 60: (0, 1)}


def test_newer_api_versions_is_answered_v0_with_the_list(kbroker: Broker) -> None:
    with connect(kbroker) as s:
        s.sendall(request(18, 9, 7, b"\x05wire\x021\x00", flexible=True))
        raw = read_frame(s)
        assert struct.unpack_from(">ih", raw) == (7, KafkaError.unsupported_version)
        v0 = apis.response_class(18, 0)
        assert v0 is not None
        res = apis.decode_request(v0, raw[4:], 0)
        assert {k.api_key for k in res.api_keys} == {0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                                     17, 18, 19, 20, 22, 23, 24, 25, 26, 28,
                                                     32, 36, 42, 60}
        # and the connection is still there
        assert api_versions(s, 3, 8)[0] == 8


def test_unserved_api_key_gets_unsupported_version_and_the_connection_lives(
        kbroker: Broker) -> None:
    with connect(kbroker) as s:
        # ListTransactions v0 (flexible): an API kio knows, not served yet
        s.sendall(request(66, 0, 11, b"\x01\x01\x00", flexible=True))
        raw = read_frame(s)
        assert struct.unpack_from(">i", raw)[0] == 11
        cls = apis.response_class(66, 0)
        assert cls is not None
        res = apis.decode_request(cls, raw[5:], 0)  # v1 header: correlation id + tags
        assert res.error_code == KafkaError.unsupported_version
        # an API key nobody knows: the header and the error code
        s.sendall(request(31_000, 0, 12))
        assert read_frame(s) == struct.pack(">ih", 12, KafkaError.unsupported_version)
        # a served API at a version not served
        s.sendall(request(3, 13, 13, b"", flexible=True))
        raw = read_frame(s)
        assert struct.unpack_from(">i", raw)[0] == 13
        assert api_versions(s, 3, 14)[0] == 14


def test_responses_come_in_request_order(kbroker: Broker) -> None:
    """A metadata answer ready at once waits behind a fetch that long-polls."""
    cls = apis.request_class(3, 12)
    assert cls is not None
    meta = apis.encode(MetadataRequest(topics=(MetadataRequestTopic(topic_id=None, name="o"),),
                                       allow_auto_topic_creation=True,
                                       include_topic_authorized_operations=False))
    with connect(kbroker) as s:
        s.sendall(request(3, 12, 1, meta, flexible=True))
        read_frame(s)  # creates the topic
        fetch_cls = apis.request_class(1, 12)
        assert fetch_cls is not None
        fetch = apis.encode(apis.build(fetch_cls, {
            "max_wait": datetime.timedelta(milliseconds=300), "min_bytes": 1,
            "max_bytes": 1 << 20, "isolation_level": 0,
            "topics": [{"topic": "o", "partitions": [
                {"partition": 0, "fetch_offset": 0, "partition_max_bytes": 1 << 20}]}],
            "forgotten_topics_data": (),
        }))
        s.sendall(request(1, 12, 2, fetch, flexible=True) + request(3, 12, 3, meta,
                                                                       flexible=True))
        assert [struct.unpack_from(">i", read_frame(s))[0] for _ in range(2)] == [2, 3]


def test_oversized_frame_closes_the_connection_with_a_logged_reason(
        kbroker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ferrymq.kafka")
    with connect(kbroker) as s:
        s.sendall(struct.pack(">i", 64 * 1024 * 1024) + b"\x00" * 16)
        assert closed_by_peer(s)
    assert any("max_frame_bytes" in r.getMessage() for r in caplog.records)
    with connect(kbroker) as s:  # the broker lives on
        assert api_versions(s, 3, 5)[0] == 5


@pytest.mark.parametrize("payload", [
    struct.pack(">i", 3) + b"abc",  # shorter than a request header
    struct.pack(">i", -5),  # a negative size
    request(3, 12, 9, b"\xff\xff\xff\xff\xff\xff", flexible=True),  # a body that does not parse
    request(0, 9, 9, b"\x00", flexible=True),  # a truncated produce
])
def test_malformed_requests_close_the_connection_with_a_logged_reason(
        kbroker: Broker, caplog: pytest.LogCaptureFixture, payload: bytes) -> None:
    caplog.set_level(logging.INFO, logger="ferrymq.kafka")
    with connect(kbroker) as s:
        s.sendall(payload)
        assert closed_by_peer(s)
    assert any("closing Kafka connection" in r.getMessage() for r in caplog.records)
    with connect(kbroker) as s:
        assert api_versions(s, 3, 6)[0] == 6


def test_bad_crc_is_refused_per_partition_and_nothing_is_stored(kbroker: Broker) -> None:
    batch = bytearray(to_kafka(bytes(encode_batch([RecordInput(b"hello", 1000)]))))
    batch[-1] ^= 0x01  # one flipped bit in the last record
    kbroker.server.topics.create("crc", 1, {}, 0)
    with connect(kbroker) as s:
        part = _produce(s, 21, "crc", bytes(batch))
    assert part.error_code == KafkaError.corrupt_message
    assert "CRC-32C" in (part.error_message or "")
    assert kbroker.server.topics.queue("crc", 0).log.end_offset == 0


def _produce(s: socket.socket, correlation_id: int, topic: str, batch: bytes) -> Any:
    [part] = produce_partitions(s, correlation_id, topic, [batch])
    return part


def produce_partitions(s: socket.socket, correlation_id: int, topic: str,
                       batches: list[bytes]) -> Any:
    """One Produce v9 of ``batches[i]`` to partition ``i`` of ``topic``: its partitions'
    answers."""
    produce_cls = apis.request_class(0, 9)
    res_cls = apis.response_class(0, 9)
    assert produce_cls is not None
    assert res_cls is not None
    body = apis.encode(apis.build(produce_cls, {
        "transactional_id": None, "acks": -1, "timeout": datetime.timedelta(seconds=5),
        "topic_data": [{"name": topic, "partition_data": [
            {"index": q, "records": batch} for q, batch in enumerate(batches)]}],
    }))
    s.sendall(request(0, 9, correlation_id, body, flexible=True))
    return apis.decode_request(res_cls, read_frame(s)[5:], 0).responses[0].partition_responses


def _init_producer_id(s: socket.socket) -> Any:
    init_cls = apis.request_class(22, 4)
    init_res = apis.response_class(22, 4)
    assert init_cls is not None
    assert init_res is not None
    s.sendall(request(22, 4, 1, apis.encode(apis.build(init_cls, {
        "transactional_id": None, "transaction_timeout": datetime.timedelta(seconds=60),
        "producer_id": -1, "producer_epoch": -1})), flexible=True))
    got = apis.decode_request(init_res, read_frame(s)[5:], 0)
    assert got.error_code == KafkaError.none
    assert got.producer_id >= 0
    return got


def _sequenced(got: Any, seq: int) -> bytes:
    return to_kafka(bytes(encode_batch([RecordInput(f"m{seq}".encode(), 1000)],
                                       producer_id=got.producer_id,
                                       producer_epoch=got.producer_epoch, base_sequence=seq)))


def test_a_retried_idempotent_batch_is_stored_once(kbroker: Broker) -> None:
    kbroker.server.topics.create("idem", 1, {}, 0)
    with connect(kbroker) as s:
        got = _init_producer_id(s)
        batches = [_sequenced(got, seq) for seq in range(2)]
        first = _produce(s, 2, "idem", batches[0])
        again = _produce(s, 3, "idem", batches[0])  # a retry: same producer, epoch, sequence
        second = _produce(s, 4, "idem", batches[1])
    assert [(p.error_code, p.base_offset) for p in (first, again, second)] == [
        (KafkaError.none, 0), (KafkaError.none, 0), (KafkaError.none, 1)]
    assert kbroker.server.topics.queue("idem", 0).log.end_offset == 2


def test_an_idle_kafka_connection_is_closed_after_idle_timeout(tmp_path: Path) -> None:
    b = Broker(tmp_path / "data", port=0, kafka_port=free_port(), idle_timeout_ms=300).start()
    try:
        with connect(b) as s:
            assert api_versions(s, 3, 1)[0] == 1
            s.settimeout(10)
            assert closed_by_peer(s)  # within idle_timeout_ms and a housekeeping round
        assert b.server.kafka is not None
        assert not b.server.kafka.connections
    finally:
        b.stop()


def test_an_idempotent_retry_after_a_broker_restart_is_stored_once(tmp_path: Path) -> None:
    """The retry of a batch whose answer was lost in a restart is recognised by the restarted
    broker (its producer state is rebuilt from the log) and answered with the first offset."""
    port = free_port()
    b = Broker(tmp_path / "data", port=0, kafka_port=port).start()
    try:
        b.server.topics.create("idem", 1, {}, 0)
        with connect(b) as s:
            got = _init_producer_id(s)
            assert _produce(s, 2, "idem", _sequenced(got, 0)).base_offset == 0
    finally:
        b.stop()
    b = Broker(tmp_path / "data", port=0, kafka_port=port).start()
    try:
        with connect(b) as s:
            again = _produce(s, 3, "idem", _sequenced(got, 0))
            nxt = _produce(s, 4, "idem", _sequenced(got, 1))
        assert (again.error_code, again.base_offset) == (KafkaError.none, 0)
        assert (nxt.error_code, nxt.base_offset) == (KafkaError.none, 1)
        assert b.server.topics.queue("idem", 0).log.end_offset == 2
    finally:
        b.stop()


def test_kafka_advertised_address_is_what_metadata_names(tmp_path: Path) -> None:
    b = Broker(tmp_path / "data", port=0, kafka_port=free_port(),
               kafka_advertised_address="kafka.example:19092").start()
    try:
        req_cls = apis.request_class(3, 12)
        res_cls = apis.response_class(3, 12)
        assert req_cls is not None
        assert res_cls is not None
        body = apis.encode(apis.build(req_cls, {"topics": None,
                                                "allow_auto_topic_creation": False,
                                                "include_topic_authorized_operations": False}))
        with connect(b) as s:
            s.sendall(request(3, 12, 1, body, flexible=True))
            res = apis.decode_request(res_cls, read_frame(s)[5:], 0)
        assert [(x.host, x.port) for x in res.brokers] == [("kafka.example", 19092)]
    finally:
        b.stop()


def test_a_taken_kafka_port_is_a_clear_start_error(tmp_path: Path) -> None:
    from ferrymq.errors import ConfigError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        b = Broker(tmp_path / "data", port=0, kafka_port=port)
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            b.start()


def _call(s: socket.socket, key: int, version: int, correlation_id: int,
          values: dict[str, Any]) -> Any:
    """Send one request of a non-flexible version built from ``values``; the decoded answer."""
    req_cls, res_cls = apis.request_class(key, version), apis.response_class(key, version)
    assert req_cls is not None
    assert res_cls is not None
    s.sendall(request(key, version, correlation_id, apis.encode(apis.build(req_cls, values))))
    raw = read_frame(s)
    assert struct.unpack_from(">i", raw)[0] == correlation_id
    return apis.decode_request(res_cls, raw[4:], 0)


@pytest.mark.parametrize("join_version", [0, 1])
def test_the_oldest_group_versions_are_served(kbroker: Broker, join_version: int) -> None:
    """JoinGroup v0-1, SyncGroup, Heartbeat and LeaveGroup v0: what clients written for Kafka
    0.10 send (Debian's Sarama 1.22 among them) and Kafka brokers up to 4.x still serve. v0 has
    no rebalance timeout: the session timeout is used."""
    timeout = datetime.timedelta(seconds=10)
    with connect(kbroker) as s:
        joined = _call(s, 11, join_version, 1, {
            "group_id": "old", "session_timeout": timeout, "rebalance_timeout": timeout,
            "member_id": "", "protocol_type": "consumer",
            "protocols": [{"name": "range", "metadata": b"\x00\x00"}]})
        assert joined.error_code == KafkaError.none
        assert (joined.generation_id, joined.protocol_name) == (1, "range")
        assert joined.leader == joined.member_id != ""
        assert [(m.member_id, m.metadata) for m in joined.members] == [(joined.member_id,
                                                                         b"\x00\x00")]
        member = {"group_id": "old", "member_id": joined.member_id, "generation_id": 1}
        synced = _call(s, 14, 0, 2, {**member, "assignments": [
            {"member_id": joined.member_id, "assignment": b"plan"}]})
        assert (synced.error_code, synced.assignment) == (KafkaError.none, b"plan")
        assert _call(s, 12, 0, 3, member).error_code == KafkaError.none
        left = _call(s, 13, 0, 4, {"group_id": "old", "member_id": joined.member_id})
        assert left.error_code == KafkaError.none
        assert _call(s, 12, 0, 5, member).error_code == KafkaError.unknown_member_id
