"""The record-batch format: encode, validate, stamp, check, decode, filter (no I/O)."""

from __future__ import annotations

import struct

import pytest

from ferrymq.errors import (
    BatchTooLargeError,
    CorruptRecordError,
    FerryMQError,
    MessageTooLargeError,
)
from ferrymq.protocol import records as r
from ferrymq.protocol.records import (
    ATTR_FILTERED,
    HEADER_SIZE,
    LENGTH_PREFIX,
    MAGIC,
    RECORD_PREFIX_SIZE,
    Record,
    RecordInput,
    check_stored_batch,
    decode_header,
    decode_msg_id,
    decode_properties,
    decode_records,
    encode_batch,
    encode_msg_id,
    encode_properties,
    filter_batch,
    iter_batches,
    iter_raw_records,
    record_body,
    record_fields,
    stamp_batch,
    validate_batch,
    walk_records,
)

BIG = 1 << 30


def _validate(buf: bytes | bytearray, pos: int = 0, **kw: int) -> r.BatchHeader:
    kw.setdefault("max_message_bytes", BIG)
    kw.setdefault("max_records", 100_000)
    return validate_batch(buf, pos, **kw)


def _stamped(buf: bytearray, base: int = 100, t: int = 5_000) -> bytearray:
    buf = bytearray(buf)
    stamp_batch(buf, 0, base, t)
    return buf


# --- round trips ----------------------------------------------------------------------------


def test_rich_batch_round_trip(rich_batch: bytearray) -> None:
    h = _validate(rich_batch, check_header_crc=True)
    assert (h.base_offset, h.append_time_ms, h.magic, h.record_count) == (0, 0, MAGIC, 3)
    assert (h.producer_id, h.producer_epoch, h.base_sequence) == (7, 3, 11)
    assert (h.first_timestamp, h.max_timestamp) == (1_000, 1_005)
    assert h.size == len(rich_batch)
    assert h.last_sequence == 13
    buf = _stamped(rich_batch, base=100, t=5_000)
    h2 = check_stored_batch(buf)
    assert (h2.base_offset, h2.append_time_ms, h2.last_offset) == (100, 5_000, 102)
    assert decode_records(buf) == [
        Record(100, 1_000, None, None, (), {}, b"plain"),
        Record(101, 1_005, "created", None, (), {}, b""),
        Record(
            102, 999, "t\u00e4g", "sk-\u00fc", ("k1", "k\u00f82"), {"a": "1", "\u00fc": "\u2603"},
            "h\u00e9llo w\u00f6rld \u2603".encode(),
        ),
    ]


def test_header_fields_decode(rich_batch: bytearray) -> None:
    h = decode_header(rich_batch)
    assert h == validate_batch(rich_batch, max_message_bytes=BIG, max_records=10)
    assert r.batch_size_at(rich_batch, 0) == len(rich_batch)
    assert r.batch_size_at(rich_batch[:11], 0) == -1
    with pytest.raises(CorruptRecordError):
        decode_header(rich_batch[: HEADER_SIZE - 1])


def test_single_empty_body() -> None:
    buf = _stamped(encode_batch([RecordInput(b"", 0)]), base=0, t=0)
    check_stored_batch(buf)
    assert decode_records(buf) == [Record(0, 0, None, None, (), {}, b"")]


def test_non_idempotent_defaults() -> None:
    h = _validate(encode_batch([RecordInput(b"x", 1)]))
    assert (h.producer_id, h.producer_epoch, h.base_sequence) == (-1, -1, -1)
    assert h.last_sequence == -1


def test_stamp_only_changes_broker_fields(rich_batch: bytearray) -> None:
    before = bytes(rich_batch)
    buf = _stamped(rich_batch, base=2**40, t=2**41)
    assert buf[12 - 4 : 12] == before[8:12]  # batch_length untouched
    assert buf[24:] == before[24:]  # body CRC and everything it covers untouched
    # validate (body CRC only) still passes; stored check (both CRCs) passes too
    _validate(buf)
    assert check_stored_batch(buf).base_offset == 2**40


def test_several_batches_back_to_back() -> None:
    a = _stamped(encode_batch([RecordInput(b"a", 1), RecordInput(b"b", 2)]), base=0)
    b = _stamped(encode_batch([RecordInput(b"c", 3, tag=b"t")]), base=2)
    buf = a + b
    assert [pos for pos, _ in iter_batches(buf)] == [0, len(a)]
    assert [rec.offset for rec in decode_records(buf)] == [0, 1, 2]
    check_stored_batch(buf, len(a))
    # a partial trailing batch (a fetch cut at max_bytes) is ignored
    assert [rec.offset for rec in decode_records(buf[:-1])] == [0, 1]


def test_encode_batch_limits() -> None:
    with pytest.raises(BatchTooLargeError):
        encode_batch([])
    with pytest.raises(MessageTooLargeError):
        encode_batch([RecordInput(b"", 0, tag=b"t" * 256)])
    with pytest.raises(MessageTooLargeError):
        encode_batch([RecordInput(b"", 0, sharding_key=b"s" * 65536)])
    with pytest.raises(MessageTooLargeError):
        encode_batch([RecordInput(b"", 0, keys=b"k" * 65536)])
    # the largest fields that fit
    buf = encode_batch([RecordInput(b"", 0, tag=b"t" * 255, sharding_key=b"s" * 65535)])
    (rec,) = decode_records(_stamped(buf))
    assert rec.tag == "t" * 255
    assert rec.sharding_key == "s" * 65535


def test_properties_codec() -> None:
    assert encode_properties(None) == b""
    assert encode_properties({}) == b""
    assert decode_properties(b"") == {}
    assert decode_properties(encode_properties({"k": "v"})) == {"k": "v"}


@pytest.mark.parametrize(
    "raw",
    [b"\xc1", b"\x92\x01\x02", b"\x81\x01\xa1v", b"\x81\xa1k\x01", b"\xdf\x80\x00\x00\x00",
     b"\x81\xa1k"],
)
def test_bad_properties_raise_corrupt(raw: bytes) -> None:
    with pytest.raises(CorruptRecordError):
        decode_properties(raw)


def test_record_fields_and_walk_agree_with_iter_raw_records(rich_batch: bytearray) -> None:
    buf = bytes(_stamped(rich_batch))
    (pos, h), = iter_batches(buf)
    recs = list(iter_raw_records(buf, pos, h))
    starts = [rec[2] - RECORD_PREFIX_SIZE for rec in recs]
    assert [record_fields(buf, p) for p in starts] == [rec[2:] for rec in recs]
    assert [record_body(buf, p) for p in starts] == [bytes(buf[r[6]:r[7]]) for r in recs]
    walked = walk_records(buf, pos, h, recs[1][0], lambda _c, _b, p, off: (p, off), None)
    assert walked == [(p, rec[0]) for p, rec in zip(starts, recs, strict=True)][1:]


def test_walk_records_flags_a_batch_whose_lengths_lie() -> None:
    buf = bytearray(_stamped(encode_batch([RecordInput(b"abc", 0), RecordInput(b"de", 0)])))
    struct.pack_into("<I", buf, HEADER_SIZE, 0xFFFF)  # first record claims 64 KiB
    (pos, h), = iter_batches(bytes(buf))
    assert walk_records(bytes(buf), pos, h, 0, lambda _c, _b, p, off: off, None) is None


@pytest.mark.parametrize("field", ["tag", "sharding_key", "keys"])
def test_decode_records_invalid_utf8_raises_corrupt(field: str) -> None:
    buf = _stamped(encode_batch([RecordInput(b"body", 0, **{field: b"\xff\xfe"})]))
    check_stored_batch(buf)  # both CRCs are fine: a hostile producer made it
    with pytest.raises(CorruptRecordError):
        decode_records(buf)


# --- CRC: every single bit flip is detected -------------------------------------------------


def test_every_single_bit_flip_is_detected() -> None:
    buf = _stamped(
        encode_batch(
            [RecordInput(b"ab", 10, tag=b"t", keys=b"k", properties=encode_properties({"p": "q"})),
             RecordInput(b"c", 11)],
            producer_id=1, producer_epoch=0, base_sequence=0,
        ),
        base=5, t=99,
    )
    check_stored_batch(buf)
    original = bytes(buf)
    for i in range(len(buf) * 8):
        buf[i // 8] ^= 1 << (i % 8)
        with pytest.raises(CorruptRecordError):
            check_stored_batch(buf)
        buf[i // 8] ^= 1 << (i % 8)
    assert bytes(buf) == original


def test_body_bit_flip_detected_by_validate() -> None:
    buf = encode_batch([RecordInput(b"hello", 1, tag=b"x")])
    for i in range(28 * 8, len(buf) * 8):
        flipped = bytearray(buf)
        flipped[i // 8] ^= 1 << (i % 8)
        with pytest.raises(FerryMQError):
            _validate(flipped)


def test_header_crc_checked_only_when_asked(rich_batch: bytearray) -> None:
    buf = bytearray(rich_batch)
    buf[0] ^= 1  # base offset: covered by the header CRC only
    _validate(buf)
    with pytest.raises(CorruptRecordError, match="header CRC"):
        _validate(buf, check_header_crc=True)


def test_truncated_batches() -> None:
    buf = _stamped(encode_batch([RecordInput(b"hello", 1)]))
    for n in (0, 11, 12, HEADER_SIZE - 1, HEADER_SIZE, len(buf) - 1):
        with pytest.raises(CorruptRecordError):
            check_stored_batch(buf[:n])
        with pytest.raises(CorruptRecordError):
            _validate(buf[:n])
        assert list(iter_batches(buf[:n])) == []


# --- validate_batch limits ------------------------------------------------------------------


def _with_header(buf: bytearray, **fields: int) -> bytearray:
    """Rewrite header fields and fix up both CRCs (to reach deeper validation)."""
    h = decode_header(buf)._replace(**fields)
    out = bytearray(buf)
    r.HEADER.pack_into(out, 0, *h)
    struct.pack_into("<I", out, 24, r.crc32c(memoryview(out)[28:]))
    r.seal_header_crc(out, 0)
    return out


def test_validate_max_records() -> None:
    buf = encode_batch([RecordInput(b"x", 0)] * 5)
    assert _validate(buf, max_records=5).record_count == 5
    with pytest.raises(BatchTooLargeError):
        _validate(buf, max_records=4)


def test_validate_bad_magic() -> None:
    buf = _with_header(encode_batch([RecordInput(b"x", 0)]), magic=2)
    with pytest.raises(CorruptRecordError, match="magic"):
        _validate(buf)
    with pytest.raises(CorruptRecordError):
        check_stored_batch(buf)


@pytest.mark.parametrize("count", [0, -1])
def test_validate_record_count_below_one(count: int) -> None:
    buf = _with_header(encode_batch([RecordInput(b"x", 0)]), record_count=count)
    with pytest.raises(CorruptRecordError):
        _validate(buf)
    with pytest.raises(CorruptRecordError):
        check_stored_batch(buf)


@pytest.mark.parametrize("codec", [1, 2, 3, 7])
def test_validate_compression_bits_rejected(codec: int) -> None:
    buf = encode_batch([RecordInput(b"x", 0)], attributes=codec)
    with pytest.raises(CorruptRecordError, match="compressed"):
        _validate(buf)


def test_validate_other_attribute_bits_allowed() -> None:
    buf = encode_batch([RecordInput(b"x", 0)], attributes=r.ATTR_TRANSACTIONAL)
    assert _validate(buf).attributes == r.ATTR_TRANSACTIONAL


@pytest.mark.parametrize("batch_length", [-1, 0, HEADER_SIZE - LENGTH_PREFIX - 1, 2**31 - 1])
def test_validate_bad_batch_length(batch_length: int) -> None:
    buf = bytearray(encode_batch([RecordInput(b"x", 0)]))
    struct.pack_into("<i", buf, 8, batch_length)
    with pytest.raises(CorruptRecordError):
        _validate(buf)
    with pytest.raises(CorruptRecordError):
        check_stored_batch(buf)


def test_validate_max_message_bytes() -> None:
    body = b"b" * 100
    buf = encode_batch([RecordInput(b"s", 0), RecordInput(body, 0)])
    record_len = RECORD_PREFIX_SIZE - 4 + len(body)
    _validate(buf, max_message_bytes=record_len)
    with pytest.raises(MessageTooLargeError):
        _validate(buf, max_message_bytes=record_len - 1)


def test_validate_walks_records_only_when_batch_exceeds_max_message() -> None:
    # A batch with a record length that does not add up, but CRC-valid (hostile producer).
    buf = bytearray(encode_batch([RecordInput(b"x" * 10, 0)]))
    struct.pack_into("<I", buf, HEADER_SIZE, 5)  # record length: shorter than its prefix
    struct.pack_into("<I", buf, 24, r.crc32c(memoryview(buf)[28:]))
    records_bytes = len(buf) - HEADER_SIZE
    # small enough for one message: no record walk, accepted (consumers check records)
    _validate(buf, max_message_bytes=records_bytes - 4)
    # larger than one message could be: the walk runs and finds it
    with pytest.raises(CorruptRecordError):
        _validate(buf, max_message_bytes=records_bytes - 5)


def test_validate_walk_detects_lengths_not_adding_up() -> None:
    buf = bytearray(encode_batch([RecordInput(b"x" * 10, 0), RecordInput(b"y" * 10, 0)]))
    second = HEADER_SIZE + RECORD_PREFIX_SIZE + 10
    struct.pack_into("<I", buf, second, RECORD_PREFIX_SIZE - 4 + 9)  # one byte short of the end
    struct.pack_into("<I", buf, 24, r.crc32c(memoryview(buf)[28:]))
    with pytest.raises(CorruptRecordError, match="do not add up"):
        _validate(buf, max_message_bytes=40)


def test_validate_at_position() -> None:
    a = encode_batch([RecordInput(b"a", 0)])
    b = encode_batch([RecordInput(b"bb", 0), RecordInput(b"c", 0)])
    assert _validate(a + b, len(a)).record_count == 2


# --- iter_raw_records structural checks -----------------------------------------------------


def _refresh_crcs(buf: bytearray) -> bytearray:
    struct.pack_into("<I", buf, 24, r.crc32c(memoryview(buf)[28:]))
    r.seal_header_crc(buf, 0)
    return buf


def test_iter_raw_records_field_past_record() -> None:
    buf = bytearray(encode_batch([RecordInput(b"x", 0, tag=b"t")]))
    buf[HEADER_SIZE + 13] = 200  # tag length runs past the record
    _refresh_crcs(buf)
    check_stored_batch(buf)
    with pytest.raises(CorruptRecordError, match="run past"):
        decode_records(buf)


def test_iter_raw_records_fewer_records_than_count() -> None:
    buf = _with_header(encode_batch([RecordInput(b"x", 0)]), record_count=2)
    (pos, h), = iter_batches(buf)
    with pytest.raises(CorruptRecordError, match="fewer records"):
        list(iter_raw_records(buf, pos, h))


def test_iter_raw_records_more_records_than_count() -> None:
    buf = _with_header(encode_batch([RecordInput(b"x", 0)] * 2), record_count=1)
    (pos, h), = iter_batches(buf)
    with pytest.raises(CorruptRecordError):
        list(iter_raw_records(buf, pos, h))


# --- filtering ------------------------------------------------------------------------------


def test_filter_batch_keeps_offsets_and_sets_filtered(rich_batch: bytearray) -> None:
    buf = _stamped(rich_batch, base=50, t=7)
    (pos, h), = iter_batches(buf)
    recs = list(iter_raw_records(buf, pos, h))
    keep = [rec for rec in recs if rec[3] > rec[2]]  # records with a tag
    out = filter_batch(buf, pos, h, keep)
    fh = check_stored_batch(out)
    assert fh.attributes & ATTR_FILTERED
    assert fh.record_count == h.record_count == 3
    assert (fh.base_offset, fh.append_time_ms, fh.producer_id) == (50, 7, 7)
    assert fh.size == len(out) < len(buf)
    assert [rec.offset for rec in decode_records(out)] == [51, 52]
    assert [rec.tag for rec in decode_records(out)] == ["created", "t\u00e4g"]
    raw = list(iter_raw_records(out, 0, fh))
    assert [x[0] for x in raw] == [51, 52]
    assert [x[1] for x in raw] == [1_005, 999]
    assert bytes(out[raw[1][6] : raw[1][7]]) == "h\u00e9llo w\u00f6rld \u2603".encode()


def test_filter_batch_keep_nothing_and_everything(rich_batch: bytearray) -> None:
    buf = _stamped(rich_batch)
    (pos, h), = iter_batches(buf)
    recs = list(iter_raw_records(buf, pos, h))
    empty = filter_batch(buf, pos, h, [])
    eh = check_stored_batch(empty)
    assert eh.attributes & ATTR_FILTERED
    assert list(iter_raw_records(empty, 0, eh)) == []
    assert decode_records(empty) == []
    full = filter_batch(buf, pos, h, recs)
    assert decode_records(full) == decode_records(buf)


def test_filter_batch_at_position() -> None:
    a = _stamped(encode_batch([RecordInput(b"a", 0)]), base=0)
    b = _stamped(encode_batch([RecordInput(b"b", 0, tag=b"x"), RecordInput(b"c", 0)]), base=1)
    buf = bytes(a + b)
    (_, _), (pos, h) = iter_batches(buf)
    recs = list(iter_raw_records(buf, pos, h))
    out = filter_batch(buf, pos, h, recs[1:])
    assert [(rec.offset, rec.body) for rec in decode_records(out)] == [(2, b"c")]


# --- message ids ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("topic_id", "queue", "offset"),
    [(0, 0, 0), (1, 2, 3), (0xFFFFFFFF, 0xFFFF, 2**64 - 1), (42, 1023, 123_456_789)],
)
def test_msg_id_round_trip(topic_id: int, queue: int, offset: int) -> None:
    msg_id = encode_msg_id(topic_id, queue, offset)
    assert len(msg_id) == 28
    assert msg_id == msg_id.upper()
    assert decode_msg_id(msg_id) == (topic_id, queue, offset)
    assert decode_msg_id(msg_id.lower()) == (topic_id, queue, offset)


@pytest.mark.parametrize("bad", ["", "0" * 27, "0" * 29, "Z" * 28])
def test_msg_id_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError):
        decode_msg_id(bad)


def test_msg_id_of_unknown_hex_length_is_not_checked_further() -> None:
    # documented contract: only the length is structural; the hex parse raises ValueError
    with pytest.raises(ValueError):
        decode_msg_id("0000000G" + "0" * 20)


def test_encode_batch_timestamp_delta_overflow_is_a_ferrymq_error() -> None:
    with pytest.raises(FerryMQError):
        encode_batch([RecordInput(b"a", 0), RecordInput(b"b", 2**31)])


def test_has_keys_attribute_marks_batches_with_keys() -> None:
    from ferrymq.protocol.records import ATTR_HAS_KEYS, RecordInput, decode_header, encode_batch

    plain = encode_batch([RecordInput(b"a", 1), RecordInput(b"b", 2)])
    keyed = encode_batch([RecordInput(b"a", 1), RecordInput(b"b", 2, keys=b"k1\x00k2")])
    assert not decode_header(plain).attributes & ATTR_HAS_KEYS
    assert decode_header(keyed).attributes & ATTR_HAS_KEYS
