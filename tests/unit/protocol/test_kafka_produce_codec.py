"""The hand-written Produce codec against kio, the reference generated from Kafka's own
schemas: requests kio encodes decode to the same fields, responses encode to the same bytes,
for every version served; malformed requests are a RemoteProtocolError."""

from __future__ import annotations

import datetime
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kio.schema.errors import ErrorCode as KafkaError

from ferrymq.errors import RemoteProtocolError
from ferrymq.protocol.kafka import apis
from ferrymq.protocol.kafka import produce_codec as pc

VERSIONS = range(pc.MIN_VERSION, pc.MAX_VERSION + 1)
NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
RECORDS = st.one_of(st.none(), st.binary(max_size=300))
TOPICS = st.lists(st.tuples(NAMES, st.lists(st.tuples(st.integers(0, 2**31 - 1), RECORDS),
                                            max_size=4)), max_size=3)


def test_the_versions_are_the_ones_served() -> None:
    assert apis.SUPPORTED[apis.PRODUCE] == (pc.MIN_VERSION, pc.MAX_VERSION)


def _kio_request(version: int, txn: str | None, acks: int, timeout_ms: int,
                 topics: list[tuple[str, list[tuple[int, bytes | None]]]]) -> bytes:
    cls = apis.request_class(apis.PRODUCE, version)
    assert cls is not None
    value = apis.build(cls, {
        "transactional_id": txn, "acks": acks,
        "timeout": datetime.timedelta(milliseconds=timeout_ms),
        "topic_data": [{"name": n, "partition_data": [{"index": i, "records": r}
                                                      for i, r in parts]}
                       for n, parts in topics]})
    return apis.encode(value)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(VERSIONS), st.one_of(st.none(), NAMES), st.sampled_from([-1, 0, 1]),
       st.integers(0, 2**31 - 1), TOPICS)
def test_requests_decode_as_kio_encodes_them(version: int, txn: str | None, acks: int,
                                             timeout_ms: int, topics: list[tuple[str, list[
                                                 tuple[int, bytes | None]]]]) -> None:
    body = _kio_request(version, txn, acks, timeout_ms, topics)
    frame = b"HEADERxx" + body + b"\x01\x02"  # a body need not start at 0; trailing bytes ignored
    req = pc.decode_request(frame, 8, version)
    assert (req.transactional_id, req.acks, req.timeout_ms) == (txn, acks, timeout_ms)
    got = [(t.name, [(p.partition, None if p.records is None else bytes(p.records))
                     for p in t.partitions]) for t in req.topics]
    assert got == [(n, list(parts)) for n, parts in topics]


def test_records_are_views_of_the_frame_not_copies() -> None:
    frame = bytearray(_kio_request(7, None, -1, 1000, [("t", [(0, b"abc")])]))
    req = pc.decode_request(frame, 0, 7)
    view = req.topics[0].partitions[0].records
    assert view is not None and view.obj is frame


RESULTS = st.lists(st.tuples(NAMES, st.lists(st.tuples(
    st.integers(0, 2**31 - 1), st.sampled_from([0, 2, 10, 19, 6]), st.integers(-1, 2**62),
    st.one_of(st.none(), st.text(max_size=40))), max_size=4)), max_size=3)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(VERSIONS), RESULTS, st.integers(0, 10_000))
def test_responses_encode_to_kios_bytes(version: int, results: list[tuple[str, list[tuple[
        int, int, int, str | None]]]], throttle_ms: int) -> None:
    cls = apis.response_class(apis.PRODUCE, version)
    assert cls is not None
    expected = apis.encode(apis.build(cls, {
        "responses": [{"name": n, "partition_responses": [
            {"index": i, "error_code": KafkaError(e), "base_offset": b, "log_append_time": None,
             "log_start_offset": -1, "record_errors": (), "error_message": msg}
            for i, e, b, msg in parts]} for n, parts in results],
        "throttle_time": datetime.timedelta(milliseconds=throttle_ms)}))
    ours = pc.encode_response(version, [(n, [pc.PartitionResult(i, e, b, msg)
                                             for i, e, b, msg in parts])
                                        for n, parts in results], throttle_ms)
    assert ours == expected


@pytest.mark.parametrize("version", VERSIONS)
def test_every_truncation_of_a_request_is_refused(version: int) -> None:
    body = _kio_request(version, "txn", -1, 500, [("topic", [(0, b"x" * 20), (1, None)]),
                                                  ("other", [(3, b"yz")])])
    pc.decode_request(body, 0, version)
    for cut in range(len(body)):
        with pytest.raises(RemoteProtocolError):
            pc.decode_request(body[:cut], 0, version)


@pytest.mark.parametrize(("body", "why"), [
    (b"\xff\xff" + struct.pack(">hi", -1, 0) + struct.pack(">i", -2), "topic array"),
    (b"\xff\xff" + struct.pack(">hi", -1, 0) + struct.pack(">i", 1_000_000), "runs past"),
    (b"\xff\xfe", "string length -2"),
    (b"\x00\x02\xc3\x28" + struct.pack(">hi", -1, 0) + struct.pack(">i", 0), "not UTF-8"),
    (b"\xff\xff" + struct.pack(">hi", -1, 0) + struct.pack(">i", 1) + b"\x00\x01t"
     + struct.pack(">i", 1) + struct.pack(">ii", 0, -5), "records length -5"),
])
def test_malformed_requests_say_what_is_wrong(body: bytes, why: str) -> None:
    with pytest.raises(RemoteProtocolError, match=why):
        pc.decode_request(body, 0, 7)


def test_a_version_outside_the_served_range_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match="v10"):
        pc.decode_request(b"", 0, 10)


def test_roomy_views_only_where_the_bytes_before_the_records_are_free() -> None:
    """The first batch has the request's header bytes before it; a batch right after another
    batch has only its partition's fields: no room there. A read-only frame has none."""
    body = _kio_request(9, None, -1, 1000, [("topic-a", [(0, b"A" * 100), (1, b"B" * 50)])])
    buf = bytearray(64) + body
    req = pc.decode_request(buf, 64, 9, room=64)
    first, second = req.topics[0].partitions
    assert first.roomy is not None and second.roomy is None
    assert first.records is not None and bytes(first.roomy[64:]) == bytes(first.records)
    assert first.roomy.obj is buf and not first.roomy.readonly
    assert pc.decode_request(bytes(buf), 64, 9, room=64).topics[0].partitions[0].roomy is None
    assert pc.decode_request(buf, 64, 9).topics[0].partitions[0].roomy is None  # room 0
