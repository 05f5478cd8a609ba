"""Kafka's record batch (magic 2), its framing, and the conversion to and from FerryMQ's batch."""

from __future__ import annotations

import gzip
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ferrymq.errors import CorruptRecordError, FrameSizeError, MessageTooLargeError
from ferrymq.protocol.kafka.frames import KafkaFrameDecoder, decode_request_header
from ferrymq.protocol.kafka.records import (
    COMPRESSION_GZIP,
    CRC_START,
    HEADER,
    HEADER_SIZE,
    KAFKA_ATTR_CONTROL,
    KAFKA_ATTR_TRANSACTIONAL,
    check_batch,
    decode_header,
    decompress,
    iter_records,
    read_varint,
    to_ferrymq,
    to_kafka,
    write_varint,
)
from ferrymq.protocol.markers import encode_marker
from ferrymq.protocol.records import (
    ATTR_SCHEDULED,
    RecordInput,
    crc32c,
    decode_records,
    encode_batch,
    encode_properties,
    stamp_batch,
)


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_varint_round_trip(value: int) -> None:
    out = bytearray()
    write_varint(out, value)
    assert read_varint(bytes(out), 0) == (value, len(out))


def test_varint_known_encodings_and_truncation() -> None:
    for value, raw in [(0, b"\x00"), (-1, b"\x01"), (1, b"\x02"), (63, b"\x7e"),
                       (-64, b"\x7f"), (64, b"\x80\x01")]:
        out = bytearray()
        write_varint(out, value)
        assert bytes(out) == raw
    with pytest.raises(CorruptRecordError, match="varint"):
        read_varint(b"\x80\x80", 0)
    with pytest.raises(CorruptRecordError, match="varint"):
        read_varint(b"\xff" * 11, 0)


def _stamped(records: list[RecordInput], base: int, **kw: int) -> bytes:
    buf = encode_batch(records, **kw)
    stamp_batch(buf, 0, base, 5_000)
    return bytes(buf)


def test_ferrymq_to_kafka_and_back_keeps_every_field() -> None:
    props = encode_properties({"source": "web", "%KAFKA_B64:blob": "/wD+"})
    ferry = _stamped([RecordInput(b"one", 1_000, b"created", b"cust-1", b"o-1\x00o-2", props),
                      RecordInput(b"two", 1_007)], 40)
    kafka = to_kafka(ferry)
    h = check_batch(kafka)
    assert (h.base_offset, h.record_count, h.last_offset_delta, h.base_timestamp,
            h.max_timestamp, h.producer_id) == (40, 2, 1, 1_000, 1_007, -1)
    recs = list(iter_records(h, memoryview(kafka)[HEADER_SIZE:]))
    assert [(r.offset_delta, r.timestamp, r.key, r.value) for r in recs] == [
        (0, 1_000, b"cust-1", b"one"), (1, 1_007, None, b"two")]
    assert recs[0].headers == [("ferrymq.tag", b"created"), ("ferrymq.key", b"o-1"),
                               ("ferrymq.key", b"o-2"), ("source", b"web"),
                               ("blob", b"\xff\x00\xfe")]
    back = decode_records(to_ferrymq(kafka, max_batch_bytes=1 << 20))
    assert [(r.body, r.timestamp, r.tag, r.sharding_key, r.keys, r.properties) for r in back] == [
        (b"one", 1_000, "created", "cust-1", ("o-1", "o-2"),
         {"source": "web", "%KAFKA_B64:blob": "/wD+"}),
        (b"two", 1_007, None, None, (), {})]


def test_producer_fields_are_kept_both_ways() -> None:
    ferry = _stamped([RecordInput(b"x", 1)], 0, producer_id=77, producer_epoch=3,
                     base_sequence=12)
    h = check_batch(to_kafka(ferry))
    assert (h.producer_id, h.producer_epoch, h.base_sequence) == (77, 3, 12)


@pytest.mark.parametrize("pos", [8, 11, 17, 20, 21, 30, 57, 61, 70, -1])
def test_any_changed_byte_is_refused(pos: int) -> None:
    kafka = bytearray(to_kafka(_stamped([RecordInput(b"payload" * 3, 1)], 0)))
    kafka[pos] ^= 0x40
    with pytest.raises(CorruptRecordError):
        to_ferrymq(bytes(kafka), max_batch_bytes=1 << 20)


def test_only_magic_2_and_exactly_one_batch() -> None:
    kafka = to_kafka(_stamped([RecordInput(b"p", 1)], 0))
    old = bytearray(kafka)
    old[16] = 1
    with pytest.raises(CorruptRecordError, match="magic 1"):
        check_batch(bytes(old))
    with pytest.raises(CorruptRecordError, match="one batch per partition"):
        check_batch(kafka + kafka)
    with pytest.raises(CorruptRecordError, match="shorter than"):
        check_batch(kafka[:40])


def _reseal(kafka: bytearray) -> bytes:
    struct.pack_into(">I", kafka, 17, crc32c(memoryview(kafka)[CRC_START:]) & 0xFFFFFFFF)
    return bytes(kafka)


def test_transactional_batches_stay_transactional_and_control_ones_are_refused() -> None:
    from ferrymq.protocol.records import ATTR_TRANSACTIONAL
    from ferrymq.protocol.records import decode_header as ferry_header

    kafka = bytearray(to_kafka(_stamped([RecordInput(b"p", 1)], 0, producer_id=5,
                                        producer_epoch=0, base_sequence=0)))
    k = bytearray(kafka)
    struct.pack_into(">h", k, 21, KAFKA_ATTR_TRANSACTIONAL)
    h = ferry_header(to_ferrymq(_reseal(k), max_batch_bytes=1 << 20))
    assert h.attributes & ATTR_TRANSACTIONAL
    assert (h.producer_id, h.producer_epoch) == (5, 0)
    k = bytearray(kafka)
    struct.pack_into(">h", k, 21, KAFKA_ATTR_TRANSACTIONAL | KAFKA_ATTR_CONTROL)
    with pytest.raises(CorruptRecordError, match="only the broker writes"):
        to_ferrymq(_reseal(k), max_batch_bytes=1 << 20)


def test_gzip_batch_is_read_and_a_bomb_is_refused() -> None:
    kafka = to_kafka(_stamped([RecordInput(b"z" * 1000, 1)] * 3, 0))
    h = decode_header(kafka)
    packed = bytearray(kafka[:HEADER_SIZE]) + gzip.compress(kafka[HEADER_SIZE:])
    HEADER.pack_into(packed, 0, *h._replace(batch_length=len(packed) - 12,
                                            attributes=COMPRESSION_GZIP))
    back = decode_records(to_ferrymq(_reseal(packed), max_batch_bytes=1 << 20))
    assert [r.body for r in back] == [b"z" * 1000] * 3
    with pytest.raises(MessageTooLargeError, match="more than 1000 bytes"):
        decompress(COMPRESSION_GZIP, gzip.compress(b"\x00" * 10_000_000), 1000)
    with pytest.raises(CorruptRecordError, match="gzip"):
        decompress(COMPRESSION_GZIP, b"not gzip", 1000)
    with pytest.raises(CorruptRecordError, match="codec 6"):
        decompress(6, b"", 1000)


def test_a_batch_spanning_more_than_a_ferrymq_timestamp_delta_is_refused() -> None:
    from ferrymq.errors import InvalidRequestError

    kafka = bytearray(to_kafka(_stamped([RecordInput(b"a", 0), RecordInput(b"b", 10)], 0)))
    # rewrite the second record's timestamp delta (a 1-byte varint 20 = 10 ms) to 2**31 ms:
    h = decode_header(kafka)
    recs = list(iter_records(h, memoryview(kafka)[HEADER_SIZE:]))
    body = bytearray()
    from ferrymq.protocol.kafka.records import _append_record

    for r in recs:
        _append_record(body, r.offset_delta, 0 if r.offset_delta == 0 else 2**31, r.key,
                       r.value, [])
    out = bytearray(kafka[:HEADER_SIZE]) + body
    HEADER.pack_into(out, 0, *h._replace(batch_length=len(out) - 12))
    with pytest.raises(InvalidRequestError, match="separate batches"):
        to_ferrymq(_reseal(out), max_batch_bytes=1 << 20)


def test_markers_become_kafka_control_batches() -> None:
    marker = bytearray(encode_marker(producer_id=9, producer_epoch=1, commit=True,
                                     transactional_id="t", coordinator_offset=4,
                                     timestamp_ms=1))
    stamp_batch(marker, 0, 17, 5)
    h = check_batch(to_kafka(bytes(marker)))
    assert h.attributes == KAFKA_ATTR_CONTROL | KAFKA_ATTR_TRANSACTIONAL
    [rec] = iter_records(h, memoryview(to_kafka(bytes(marker)))[HEADER_SIZE:])
    assert rec.key == struct.pack(">hh", 0, 1)  # version 0, COMMIT
    assert (h.base_offset, h.producer_id) == (17, 9)


def test_scheduled_originals_become_empty_batches_spanning_their_offsets() -> None:
    sched = _stamped([RecordInput(b"later", 1), RecordInput(b"later", 2)], 30,
                     attributes=ATTR_SCHEDULED)
    normal = _stamped([RecordInput(b"now", 3)], 32)
    kafka = to_kafka(sched + normal)
    h1 = decode_header(kafka)
    assert (h1.base_offset, h1.last_offset_delta, h1.record_count) == (30, 1, 0)
    h2 = check_batch(kafka[h1.batch_length + 12:])
    assert (h2.base_offset, h2.record_count) == (32, 1)


def test_a_trailing_partial_ferrymq_batch_is_left_out() -> None:
    one = _stamped([RecordInput(b"a", 1)], 0)
    two = _stamped([RecordInput(b"b", 1)], 1)
    kafka = to_kafka(one + two[:30])
    assert decode_header(kafka).batch_length + 12 == len(kafka)


def test_frame_decoder_cuts_frames_across_reads_and_refuses_bad_sizes() -> None:
    d = KafkaFrameDecoder(100)
    data = struct.pack(">i", 3) + b"abc" + struct.pack(">i", 2) + b"de"
    got = [f for b in data for f in d.feed(bytes([b]))]
    assert got == [b"abc", b"de"]
    assert d.buffered == 0
    with pytest.raises(FrameSizeError, match="max_frame_bytes"):
        KafkaFrameDecoder(100).feed(struct.pack(">i", 101))
    with pytest.raises(FrameSizeError, match="frames must be 1"):
        KafkaFrameDecoder(100).feed(struct.pack(">i", 0))


@given(st.lists(st.binary(min_size=1, max_size=60), max_size=6),
       st.lists(st.integers(1, 50), min_size=1, max_size=20))
def test_large_frames_are_read_in_place_however_the_stream_is_cut(
        bodies: list[bytes], cuts: list[int]) -> None:
    """As a BufferedProtocol: reads land where get_buffer says, a frame above big_frame_bytes
    left incomplete by a read gets a buffer of its own, filled in place."""
    data = b"".join(struct.pack(">i", len(b)) + b for b in bodies)
    d = KafkaFrameDecoder(100, memoryview(bytearray(16)), big_frame_bytes=8)
    got: list[bytes | bytearray] = []
    pos = i = 0
    while pos < len(data):
        buf = d.get_buffer()
        n = min(cuts[i % len(cuts)], len(buf), len(data) - pos)
        buf[:n] = data[pos:pos + n]
        got += d.buffer_updated(n)
        pos += n
        i += 1
    assert [bytes(f) for f in got] == bodies
    assert d.buffered == 0


def test_a_large_frame_is_refused_by_its_size_before_anything_is_allocated() -> None:
    d = KafkaFrameDecoder(1000, big_frame_bytes=8)
    assert d.feed(struct.pack(">i", 500) + b"x" * 100) == []
    assert d.buffered == 100 and len(d.get_buffer()) == 400  # read in place: the rest's room
    with pytest.raises(FrameSizeError, match="max_frame_bytes"):
        KafkaFrameDecoder(1000, big_frame_bytes=8).feed(struct.pack(">i", 2**31 - 1) + b"x")


@given(st.lists(st.binary(min_size=1, max_size=40), max_size=6),
       st.lists(st.integers(1, 50), min_size=1, max_size=20))
def test_frame_decoder_gives_the_same_frames_however_the_stream_is_cut(
        bodies: list[bytes], cuts: list[int]) -> None:
    data = b"".join(struct.pack(">i", len(b)) + b for b in bodies)
    d = KafkaFrameDecoder(100)
    got: list[bytes] = []
    pos = 0
    i = 0
    while pos < len(data):
        n = cuts[i % len(cuts)]
        got += d.feed(memoryview(data)[pos:pos + n] if i % 2 else data[pos:pos + n])
        pos += n
        i += 1
    assert got == bodies
    assert d.buffered == 0


def test_request_header_v1_and_v2() -> None:
    v1 = struct.pack(">hhih", 3, 4, 99, 3) + b"cli" + b"BODY"
    assert decode_request_header(v1, flexible=False) == (3, 4, 99, "cli", 13)
    v2 = struct.pack(">hhih", 3, 12, 5, -1) + b"\x01\x00\x02xy" + b"BODY"
    assert decode_request_header(v2, flexible=True) == (3, 12, 5, None, 15)


@pytest.mark.parametrize("codec", ["snappy", "snappy-xerial", "lz4", "zstd"])
def test_cramjam_codecs_are_bounded_before_decompressing(codec: str) -> None:
    import cramjam

    from ferrymq.protocol.kafka.records import (
        COMPRESSION_LZ4,
        COMPRESSION_SNAPPY,
        COMPRESSION_ZSTD,
    )

    raw = b"\x00" * 100_000
    if codec == "snappy":
        number, packed = COMPRESSION_SNAPPY, bytes(cramjam.snappy.compress_raw(raw))
    elif codec == "snappy-xerial":
        block = bytes(cramjam.snappy.compress_raw(raw))
        number = COMPRESSION_SNAPPY
        packed = b"\x82SNAPPY\x00" + bytes(8) + struct.pack(">i", len(block)) + block
    elif codec == "lz4":
        number, packed = COMPRESSION_LZ4, bytes(cramjam.lz4.compress(raw))
    else:
        number, packed = COMPRESSION_ZSTD, bytes(cramjam.zstd.compress(raw))
    assert decompress(number, packed, 100_000) == raw
    with pytest.raises(MessageTooLargeError, match="more than 99999 bytes"):
        decompress(number, packed, 99_999)
    with pytest.raises(CorruptRecordError, match="cannot be read"):
        decompress(number, packed[:-9] + b"garbage!!", 100_000)


def test_every_response_kio_knows_can_be_answered_unsupported() -> None:
    """What an unserved API key or version is answered with encodes for every API and version
    kio knows (a failure there would drop the connection instead of answering)."""
    from kio.schema.errors import ErrorCode as KafkaError

    from ferrymq.protocol.kafka import apis

    encoded = 0
    for key in range(100):
        for version in range(20):
            cls = apis.response_class(key, version)
            if cls is None:
                continue
            body = apis.encode(apis.error_response(cls, KafkaError.unsupported_version))
            assert apis.decode_request(cls, body, 0) is not None
            encoded += 1
    assert encoded > 300
