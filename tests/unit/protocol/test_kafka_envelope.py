"""The envelope: a Kafka batch stored as it came inside a FerryMQ header of magic 2."""

from __future__ import annotations

import gzip
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ferrymq.errors import BatchTooLargeError, CorruptRecordError, MessageTooLargeError
from ferrymq.protocol.kafka import records as kafka
from ferrymq.protocol.kafka.envelope import (
    ENVELOPE_MAGIC,
    STAMPED_HEAD_SIZE,
    check_stored,
    envelope_header,
    kafka_pieces,
    stamp,
    to_native,
    wrap,
)
from ferrymq.protocol.records import (
    ATTR_HAS_KEYS,
    ATTR_TRANSACTIONAL,
    HEADER_SIZE,
    MAGIC,
    RecordInput,
    crc32c,
    decode_header,
    decode_records,
    encode_batch,
    iter_batches,
    stamp_batch,
    validate_batch,
)

LIMITS = {"max_batch_bytes": 1 << 20, "max_records": 100}


def kafka_batch(n: int = 3, *, pid: int = -1, epoch: int = -1, seq: int = -1) -> bytes:
    return kafka.to_kafka(bytes(encode_batch(
        [RecordInput(f"v{i}".encode(), 1000 + 10 * i, tag=b"t") for i in range(n)],
        producer_id=pid, producer_epoch=epoch, base_sequence=seq)))


def stored(batch: bytes, base_offset: int, append_time: int = 77) -> bytes:
    """An envelope of ``batch`` as the log stores it at ``base_offset``."""
    env = wrap(batch, **LIMITS)
    head = bytearray(env[:STAMPED_HEAD_SIZE])
    stamp(head, base_offset, append_time)
    return bytes(head) + bytes(env[STAMPED_HEAD_SIZE:])


def _reseal(batch: bytearray) -> bytes:
    struct.pack_into(">I", batch, 17, crc32c(memoryview(batch)[kafka.CRC_START:]) & 0xFFFFFFFF)
    return bytes(batch)


def test_the_header_carries_the_kafka_batch_fields_and_the_batch_is_kept_as_sent() -> None:
    batch = kafka_batch(4, pid=9, epoch=2, seq=40)
    env = wrap(batch, **LIMITS)
    h = envelope_header(env)
    assert (h.magic, h.record_count, h.first_timestamp, h.max_timestamp) == (
        ENVELOPE_MAGIC, 4, 1000, 1030)
    assert (h.producer_id, h.producer_epoch, h.base_sequence, h.last_sequence) == (9, 2, 40, 43)
    assert h.size == len(env) == HEADER_SIZE + len(batch)
    assert env[HEADER_SIZE:] == batch  # the client's leader epoch was -1 already
    at = stored(batch, 500)
    assert decode_header(at).base_offset == 500
    assert kafka.decode_header(at, HEADER_SIZE).base_offset == 500
    assert at[HEADER_SIZE + 8:] == batch[8:]
    assert check_stored(at) == decode_header(at)


def test_a_client_leader_epoch_is_replaced_and_transactions_are_kept() -> None:
    b = bytearray(kafka_batch(1, pid=5, epoch=0, seq=0))
    struct.pack_into(">i", b, 12, 7)  # not under the Kafka CRC
    struct.pack_into(">h", b, 21, kafka.KAFKA_ATTR_TRANSACTIONAL)
    env = wrap(_reseal(b), **LIMITS)
    assert kafka.decode_header(env, HEADER_SIZE).leader_epoch == -1
    assert envelope_header(env).attributes == ATTR_TRANSACTIONAL


@given(st.data())
def test_every_byte_of_a_stored_envelope_is_checked(data: st.DataObject) -> None:
    at = bytearray(stored(kafka_batch(2), 3))
    pos = data.draw(st.integers(0, len(at) - 1))
    at[pos] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(CorruptRecordError):
        check_stored(bytes(at))


def test_what_wrap_refuses() -> None:
    batch = kafka_batch(3)
    with pytest.raises(CorruptRecordError, match="CRC-32C"):
        wrap(batch[:-1] + bytes([batch[-1] ^ 1]), **LIMITS)
    with pytest.raises(MessageTooLargeError, match="max_message_bytes"):
        wrap(batch, max_batch_bytes=len(batch) - 1, max_records=100)
    with pytest.raises(BatchTooLargeError, match="max 2"):
        wrap(batch, max_batch_bytes=1 << 20, max_records=2)
    control = bytearray(batch)
    struct.pack_into(">h", control, 21, kafka.KAFKA_ATTR_CONTROL | kafka.KAFKA_ATTR_TRANSACTIONAL)
    with pytest.raises(CorruptRecordError, match="only the broker writes"):
        wrap(_reseal(control), **LIMITS)
    gap = bytearray(batch)
    struct.pack_into(">i", gap, 23, 5)  # lastOffsetDelta
    with pytest.raises(CorruptRecordError, match="last offset delta 5"):
        wrap(_reseal(gap), **LIMITS)
    spread = bytearray(batch)
    struct.pack_into(">q", spread, 35, 1000 + 2**31)  # maxTimestamp
    with pytest.raises(BatchTooLargeError, match=r"24\.8 days"):
        wrap(_reseal(spread), **LIMITS)


@pytest.mark.parametrize("compressed", [False, True])
def test_an_unset_max_timestamp_is_set_from_the_records(compressed: bool) -> None:
    """Sarama 1.22 sends maxTimestamp -1; a Kafka broker sets it from the records and reseals
    the CRC, and so does wrap (the records are kept as sent)."""
    unset = bytearray(kafka_batch(3))
    struct.pack_into(">q", unset, 35, -1)  # maxTimestamp
    batch = _compressed(_reseal(unset)) if compressed else _reseal(unset)
    env = wrap(batch, **LIMITS)
    assert envelope_header(env).max_timestamp == 1020
    k = kafka.decode_header(env, HEADER_SIZE)
    assert (k.base_timestamp, k.max_timestamp) == (1000, 1020)
    assert env[HEADER_SIZE + kafka.HEADER_SIZE:] == batch[kafka.HEADER_SIZE:]
    at = stored(batch, 8)
    assert check_stored(at).max_timestamp == 1020  # both CRCs hold
    assert [r.body for r in decode_records(to_native(at, max_batch_bytes=1 << 20))] == [
        b"v0", b"v1", b"v2"]


def test_envelope_header_refuses_a_ferrymq_batch() -> None:
    with pytest.raises(CorruptRecordError, match="not one envelope"):
        envelope_header(encode_batch([RecordInput(b"x", 1)]))


def _compressed(batch: bytes) -> bytes:
    b = bytearray(batch[:kafka.HEADER_SIZE]) + gzip.compress(batch[kafka.HEADER_SIZE:])
    struct.pack_into(">i", b, 8, len(b) - 12)
    struct.pack_into(">h", b, 21, kafka.COMPRESSION_GZIP)
    return _reseal(b)


def test_both_ways_over_a_log_read_of_both_formats() -> None:
    native = bytearray(encode_batch([RecordInput(b"n0", 5), RecordInput(b"n1", 6)]))
    stamp_batch(native, 0, 0, 70)
    gz = _compressed(kafka_batch(3))
    tail = bytearray(encode_batch([RecordInput(b"n5", 8)]))
    stamp_batch(tail, 0, 5, 71)
    data = bytes(native) + stored(gz, 2) + bytes(tail)
    # FerryMQ readers: the envelope converted, FerryMQ batches untouched
    out = to_native(data, max_batch_bytes=1 << 20)
    assert [h.magic for _p, h in iter_batches(out)] == [MAGIC] * 3
    assert out.startswith(bytes(native)) and out.endswith(bytes(tail))
    assert [(r.offset, r.body, r.tag) for r in decode_records(out)] == [
        (0, b"n0", None), (1, b"n1", None), (2, b"v0", "t"), (3, b"v1", "t"), (4, b"v2", "t"),
        (5, b"n5", None)]
    [_a, (_pos, h), _b] = list(iter_batches(out))
    assert (h.base_offset, h.append_time_ms) == (2, 77)
    # Kafka readers: the stored Kafka batch still compressed, FerryMQ ones converted
    back = b"".join(kafka_pieces(data))
    k = kafka.decode_header(back)
    first = len(kafka.to_kafka(bytes(native)))
    assert back[:first] == kafka.to_kafka(bytes(native))
    assert back[first:first + len(gz)] == stored(gz, 2)[HEADER_SIZE:]
    assert kafka.decode_header(back, first).attributes & kafka.COMPRESSION_MASK == 1
    assert back[first + len(gz):] == kafka.to_kafka(bytes(tail))
    assert k.record_count == 2
    # a partial batch at the end is left out, as a fetch cut at its budget has one
    assert b"".join(kafka_pieces(data[:-3])) == back[:first + len(gz)]
    assert to_native(data[:-3], max_batch_bytes=1 << 20) == out[:-len(tail)]


def test_to_native_bounds_the_decompression() -> None:
    gz = _compressed(kafka_batch(3))
    with pytest.raises(MessageTooLargeError):
        to_native(stored(gz, 0), max_batch_bytes=10)


def test_a_read_budget_bounds_the_converted_batches() -> None:
    data = stored(kafka_batch(3), 0) + stored(kafka_batch(3), 3) + stored(kafka_batch(3), 6)
    whole = to_native(data, max_batch_bytes=1 << 20)
    one = len(whole) // 3
    assert [h.base_offset for _p, h in iter_batches(whole)] == [0, 3, 6]
    assert to_native(data, max_batch_bytes=1 << 20, max_bytes=2 * one) == whole[:2 * one]
    assert to_native(data, max_batch_bytes=1 << 20, max_bytes=2 * one - 1) == whole[:one]
    assert to_native(data, max_batch_bytes=1 << 20, max_bytes=1) == whole[:one]  # the first


def test_a_ferrymq_producer_cannot_store_an_envelope() -> None:
    with pytest.raises(CorruptRecordError, match="unknown batch magic 2"):
        validate_batch(wrap(kafka_batch(1), **LIMITS), max_message_bytes=1 << 20,
                       max_records=100)


def test_only_uncompressed_batches_naming_ferrymq_keys_are_marked_as_keyed() -> None:
    keyed = kafka.to_kafka(bytes(encode_batch([RecordInput(b"v", 1, keys=b"order-1")])))
    assert envelope_header(wrap(keyed, **LIMITS, mark_keys=True)).attributes == ATTR_HAS_KEYS
    assert envelope_header(wrap(kafka_batch(2), **LIMITS, mark_keys=True)).attributes == 0
    assert envelope_header(wrap(_compressed(keyed), **LIMITS, mark_keys=True)).attributes == 0
    assert envelope_header(wrap(keyed, **LIMITS)).attributes == 0  # unless asked: no scan


def _roomy(batch: bytes, garbage: int = 0xAB) -> memoryview:
    """``batch`` with HEADER_SIZE bytes of leftovers before it, in a writable buffer."""
    return memoryview(bytearray([garbage]) * HEADER_SIZE + batch)


@given(st.integers(1, 20), st.integers(0, 255))
def test_a_batch_wrapped_in_place_is_the_envelope_a_copy_makes(n: int, garbage: int) -> None:
    batch = kafka_batch(n)
    roomy = _roomy(batch, garbage)
    out = wrap(roomy[HEADER_SIZE:], **LIMITS, mark_keys=False, roomy=roomy)
    assert out is roomy  # nothing copied
    assert bytes(out) == bytes(wrap(batch, **LIMITS))
    check_stored(bytes(out))


def test_batches_that_are_changed_or_scanned_are_copied_all_the_same() -> None:
    unset = bytearray(kafka_batch(3))
    struct.pack_into(">q", unset, 35, -1)  # maxTimestamp: set by wrap, in a copy
    batch = _reseal(unset)
    roomy = _roomy(batch)
    out = wrap(roomy[HEADER_SIZE:], **LIMITS, mark_keys=False, roomy=roomy)
    assert out is not roomy and bytes(roomy[HEADER_SIZE:]) == batch  # the frame untouched
    assert envelope_header(out).max_timestamp == 1020
    keyed = kafka.to_kafka(bytes(encode_batch([RecordInput(b"v", 1, keys=b"order-1")])))
    roomy = _roomy(keyed)
    out = wrap(roomy[HEADER_SIZE:], **LIMITS, mark_keys=True, roomy=roomy)
    assert out is not roomy and envelope_header(out).attributes == ATTR_HAS_KEYS
