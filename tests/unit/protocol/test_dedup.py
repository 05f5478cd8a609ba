"""Dedup keys on the wire: the attribute bit, the ``%DEDUP`` property, its limits, and re-encoding
a batch without its duplicates (no I/O)."""

from __future__ import annotations

import pytest

from ferrymq.client.message import BatchContext, Message, ReceivedMessage
from ferrymq.errors import BatchTooLargeError, CorruptRecordError, InvalidRequestError
from ferrymq.protocol import records as r
from ferrymq.protocol.dedup import (
    DEDUP_KEY,
    MAX_DEDUP_KEY_BYTES,
    check_dedup_key,
    read_dedup_keys,
)
from ferrymq.protocol.records import (
    ATTR_DEDUP,
    RecordInput,
    check_stored_batch,
    decode_header,
    decode_records,
    encode_batch,
    encode_properties,
    iter_raw_records,
    select_records,
    stamp_batch,
    validate_batch,
    walk_records,
)


def _dedup_batch(*keys: str, **kw: int) -> bytearray:
    return encode_batch(
        [RecordInput(f"body-{i}".encode(), 1_000 + i, tag=b"t" if i % 2 else b"",
                     properties=encode_properties({DEDUP_KEY: k, "user": str(i)}))
         for i, k in enumerate(keys)],
        attributes=ATTR_DEDUP, **kw,
    )


def _validate(buf: bytes | bytearray) -> r.BatchHeader:
    return validate_batch(buf, max_message_bytes=1 << 20, max_records=1000)


# --- the attribute bit -----------------------------------------------------------------------


def test_every_attribute_bit_has_exactly_one_meaning() -> None:
    flags = [r.ATTR_COMPRESSION_MASK, r.ATTR_DEDUP, r.ATTR_HAS_KEYS, r.ATTR_TRANSACTIONAL,
             r.ATTR_CONTROL, r.ATTR_FILTERED, r.ATTR_SCHEDULED]
    total = 0
    for f in flags:
        assert total & f == 0, hex(f)
        total |= f
    assert total == 0xFF  # the byte is full: the next flag needs a new format


def test_dedup_bit_is_accepted_and_compression_still_refused() -> None:
    h = _validate(_dedup_batch("a"))
    assert h.attributes & ATTR_DEDUP
    assert not h.attributes & r.ATTR_COMPRESSION_MASK
    with pytest.raises(CorruptRecordError, match="compressed"):
        _validate(encode_batch([RecordInput(b"x", 0)], attributes=ATTR_DEDUP | 1))


def test_message_with_dedup_key_travels_as_a_reserved_property() -> None:
    rec = Message("t", b"x", dedup_key="order-42", properties={"a": "1"}).to_record(5)
    assert r.decode_properties(rec.properties) == {"a": "1", DEDUP_KEY: "order-42"}
    plain = Message("t", b"x").to_record(5)
    assert plain.properties == b""


def test_received_message_exposes_the_dedup_key() -> None:
    buf = bytes(_dedup_batch("k-\u00e9", "k2"))
    h = decode_header(buf)
    ctx = BatchContext("t", 0, 1, 0, h.first_timestamp)
    msgs = walk_records(buf, 0, h, 0, ReceivedMessage, ctx)
    assert msgs is not None
    assert [m.dedup_key for m in msgs] == ["k-\u00e9", "k2"]
    assert msgs[0].properties[DEDUP_KEY] == "k-\u00e9"
    plain = bytes(encode_batch([RecordInput(b"x", 0, properties=encode_properties({"a": "b"})),
                                RecordInput(b"y", 0)]))
    ph = decode_header(plain)
    got = walk_records(plain, 0, ph, 0, ReceivedMessage, BatchContext("t", 0, 1, 0, 0))
    assert got is not None
    assert [m.dedup_key for m in got] == [None, None]


# --- key limits ------------------------------------------------------------------------------


def test_check_dedup_key_limits() -> None:
    assert check_dedup_key("a") == "a"
    assert check_dedup_key("x" * MAX_DEDUP_KEY_BYTES) == "x" * MAX_DEDUP_KEY_BYTES
    with pytest.raises(ValueError, match="255"):
        check_dedup_key("x" * (MAX_DEDUP_KEY_BYTES + 1))
    with pytest.raises(ValueError, match="255"):  # bytes of UTF-8 count, not characters
        check_dedup_key("\u00e9" * 128)
    with pytest.raises(ValueError, match="empty"):
        check_dedup_key("")
    with pytest.raises(TypeError):
        check_dedup_key(b"bytes")


def test_message_refuses_a_bad_dedup_key() -> None:
    with pytest.raises(ValueError, match="MAX_DEDUP_KEY_BYTES"):
        Message("t", b"x", dedup_key="k" * 256)
    with pytest.raises(ValueError, match="empty"):
        Message("t", b"x", dedup_key="")
    with pytest.raises(TypeError):
        Message("t", b"x", dedup_key=42)  # type: ignore[arg-type]


# --- the broker's reader ---------------------------------------------------------------------


def test_read_dedup_keys_in_order() -> None:
    buf = _dedup_batch("a", "b", "a")
    got = read_dedup_keys(buf, 0, decode_header(buf))
    assert [k for _rec, k in got] == ["a", "b", "a"]
    assert [rec[0] for rec, _k in got] == [0, 1, 2]  # offsets (base 0: not stamped yet)


def test_read_dedup_keys_refuses_what_cannot_be_deduplicated() -> None:
    plain = encode_batch([RecordInput(b"x", 0)])
    with pytest.raises(InvalidRequestError, match="not a dedup batch"):
        read_dedup_keys(plain, 0, decode_header(plain))
    missing = encode_batch([RecordInput(b"x", 0, properties=encode_properties({DEDUP_KEY: "a"})),
                            RecordInput(b"y", 0)], attributes=ATTR_DEDUP)
    with pytest.raises(InvalidRequestError, match="record 1 of a dedup batch has no %DEDUP"):
        read_dedup_keys(missing, 0, decode_header(missing))
    for bad in ("", "k" * (MAX_DEDUP_KEY_BYTES + 1)):
        buf = _dedup_batch(bad)
        with pytest.raises(InvalidRequestError, match=r"1\.\.255 bytes"):
            read_dedup_keys(buf, 0, decode_header(buf))
    garbage = encode_batch([RecordInput(b"x", 0, properties=b"\xc1")], attributes=ATTR_DEDUP)
    with pytest.raises(InvalidRequestError, match="malformed"):
        read_dedup_keys(garbage, 0, decode_header(garbage))


# --- re-encoding without duplicates ----------------------------------------------------------


@pytest.mark.parametrize("keep_idx", [[0], [1], [2], [0, 2], [1, 2], [0, 1, 2]])
def test_select_records_is_an_ordinary_batch_of_the_kept_records(keep_idx: list[int]) -> None:
    buf = _dedup_batch("a", "b", "c")
    h = decode_header(buf)
    recs = list(iter_raw_records(buf, 0, h))
    out = select_records(buf, 0, h, [recs[i] for i in keep_idx])
    oh = _validate(out)  # a producer's batch: CRC ok, record walk ok
    assert oh.record_count == len(keep_idx)
    assert oh.attributes == h.attributes  # still a dedup batch, not "filtered"
    assert (oh.producer_id, oh.base_sequence) == (h.producer_id, h.base_sequence)
    original = decode_records(buf)
    assert oh.max_timestamp == max(original[i].timestamp for i in keep_idx)
    stamped = bytearray(out)
    stamp_batch(stamped, 0, 40, 7)
    check_stored_batch(stamped)
    got = decode_records(stamped)
    assert [g.offset for g in got] == list(range(40, 40 + len(keep_idx)))
    for g, i in zip(got, keep_idx, strict=True):
        want = original[i]
        assert (g.body, g.timestamp, g.tag, g.properties) == (
            want.body, want.timestamp, want.tag, want.properties)


def test_select_records_from_a_view_at_a_position() -> None:
    a = _dedup_batch("x")
    b = _dedup_batch("y", "z")
    buf = memoryview(bytes(a + b))
    h = decode_header(buf, len(a))
    recs = list(iter_raw_records(buf, len(a), h))
    out = select_records(buf, len(a), h, recs[1:])
    assert [x.properties[DEDUP_KEY] for x in decode_records(out)] == ["z"]


def test_select_records_needs_a_record() -> None:
    buf = _dedup_batch("a")
    with pytest.raises(BatchTooLargeError):
        select_records(buf, 0, decode_header(buf), [])
