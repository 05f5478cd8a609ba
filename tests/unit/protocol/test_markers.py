"""Transaction markers (control batches) and the read_committed filter."""

from __future__ import annotations

import pytest

from ferrymq.errors import CorruptRecordError
from ferrymq.protocol.markers import (
    CONTROL_ATTRIBUTES,
    MARKER_ABORT,
    MARKER_COMMIT,
    Marker,
    ReadCommittedFilter,
    encode_marker,
    is_control,
    marker_of,
)
from ferrymq.protocol.records import (
    ATTR_CONTROL,
    ATTR_HAS_KEYS,
    ATTR_SCHEDULED,
    ATTR_TRANSACTIONAL,
    RecordInput,
    decode_header,
    decode_records,
    encode_batch,
    encode_properties,
    iter_batches,
    stamp_batch,
    validate_batch,
)

TXN = ATTR_TRANSACTIONAL
CTRL = ATTR_TRANSACTIONAL | ATTR_CONTROL


def _marker(commit: bool, *, pid: int = 7, epoch: int = 3, tid: str = "app-1", coord: int = 42) -> bytes:
    return encode_marker(
        producer_id=pid, producer_epoch=epoch, commit=commit, transactional_id=tid,
        coordinator_offset=coord, timestamp_ms=1_700_000_000_000,
    )


def test_marker_constants() -> None:
    assert (MARKER_ABORT, MARKER_COMMIT) == (0, 1)
    assert CONTROL_ATTRIBUTES == 0x30


@pytest.mark.parametrize("commit", [True, False])
def test_encode_marker_is_a_valid_one_record_control_batch(commit: bool) -> None:
    buf = _marker(commit)
    h = validate_batch(buf, max_message_bytes=1 << 20, max_records=10, check_header_crc=True)
    assert h.size == len(buf)
    assert h.attributes == ATTR_TRANSACTIONAL | ATTR_CONTROL  # no has-keys bit
    assert not h.attributes & ATTR_HAS_KEYS
    assert (h.base_offset, h.record_count, h.base_sequence) == (0, 1, -1)
    assert (h.producer_id, h.producer_epoch) == (7, 3)
    assert h.first_timestamp == 1_700_000_000_000
    (rec,) = decode_records(buf)
    assert rec.tag is None and rec.body == b"" and rec.keys == ()
    assert rec.properties == {
        "%TXN_MARKER": "COMMIT" if commit else "ABORT",
        "%TXN_ID": "app-1",
        "%TXN_COORD": "42",
    }
    assert marker_of(buf, 0, h) == Marker(commit, "app-1", 42)
    assert is_control(h.attributes)


def test_marker_of_after_stamping_and_inside_a_larger_buffer() -> None:
    data = bytearray(encode_batch([RecordInput(b"x", 1)]))
    stamp_batch(data, 0, 10, 5)
    pos = len(data)
    marker = bytearray(_marker(False, tid="t-ü", coord=0))
    stamp_batch(marker, 0, 11, 6)
    data += marker
    walked = list(iter_batches(bytes(data)))
    assert [p for p, _ in walked] == [0, pos]
    h = walked[1][1]
    assert h.base_offset == 11
    assert marker_of(bytes(data), pos, h) == Marker(False, "t-ü", 0)
    assert marker_of(memoryview(data), pos, h).transactional_id == "t-ü"


def test_is_control_reads_bit_5_only() -> None:
    assert is_control(ATTR_CONTROL)
    assert is_control(0xFF)
    assert not is_control(ATTR_TRANSACTIONAL)
    assert not is_control(ATTR_SCHEDULED | ATTR_HAS_KEYS)
    assert not is_control(0)


def test_encode_marker_needs_a_producer() -> None:
    with pytest.raises(ValueError, match="producer id and epoch"):
        _marker(True, pid=-1)
    with pytest.raises(ValueError, match="producer id and epoch"):
        _marker(True, epoch=-1)


def test_marker_of_refuses_non_markers() -> None:
    data = bytes(encode_batch([RecordInput(b"x", 1)], producer_id=1, producer_epoch=0, base_sequence=0))
    with pytest.raises(CorruptRecordError, match="not a control batch"):
        marker_of(data, 0, decode_header(data))
    wrong = bytes(encode_batch(
        [RecordInput(b"", 1, properties=encode_properties({"%TXN_MARKER": "MAYBE", "%TXN_ID": "t",
                                                            "%TXN_COORD": "1"}))],
        producer_id=1, producer_epoch=0, attributes=CTRL,
    ))
    with pytest.raises(CorruptRecordError, match="not a transaction marker"):
        marker_of(wrong, 0, decode_header(wrong))
    no_coord = bytes(encode_batch(
        [RecordInput(b"", 1, properties=encode_properties({"%TXN_MARKER": "ABORT", "%TXN_ID": "t",
                                                            "%TXN_COORD": "x1"}))],
        producer_id=1, producer_epoch=0, attributes=CTRL,
    ))
    with pytest.raises(CorruptRecordError, match="not a transaction marker"):
        marker_of(no_coord, 0, decode_header(no_coord))
    two = bytes(encode_batch([RecordInput(b"", 1), RecordInput(b"", 1)], producer_id=1,
                             producer_epoch=0, attributes=CTRL))
    with pytest.raises(CorruptRecordError, match="2 records"):
        marker_of(two, 0, decode_header(two))


# --- ReadCommittedFilter ---------------------------------------------------------------------


def _kept(f: ReadCommittedFilter, batches: list[tuple[int, int, int]]) -> list[int]:
    """Base offsets of the (pid, base_offset, attributes) batches the filter keeps."""
    return [base for pid, base, attrs in batches if f.keep(pid, base, attrs)]


def test_non_transactional_batches_are_always_kept() -> None:
    f = ReadCommittedFilter([(1, 0), (-1, 0)])
    assert _kept(f, [(-1, 0, 0), (1, 1, 0), (1, 2, ATTR_HAS_KEYS), (2, 3, ATTR_SCHEDULED)]) == [0, 1, 2, 3]


def test_no_aborted_list_drops_only_control_batches() -> None:
    f = ReadCommittedFilter([])
    batches = [(1, 0, TXN), (1, 1, TXN), (1, 2, CTRL), (2, 3, 0), (1, 4, TXN), (1, 5, CTRL)]
    assert _kept(f, batches) == [0, 1, 3, 4]


def test_interleaved_producers_one_aborted_one_committed() -> None:
    # pid 1 aborts (first 0, marker 6); pid 2 commits (marker 5); plain batches between.
    f = ReadCommittedFilter([(1, 0)])
    batches = [
        (1, 0, TXN), (2, 1, TXN), (-1, 2, 0), (1, 3, TXN), (2, 4, TXN),
        (2, 5, CTRL), (1, 6, CTRL), (1, 7, TXN), (3, 8, 0),
    ]
    # pid 1's next transaction (from 7) is not aborted: kept.
    assert _kept(f, batches) == [1, 2, 4, 7, 8]
    assert f.aborting == frozenset()


def test_range_is_active_between_first_offset_and_marker() -> None:
    f = ReadCommittedFilter([(1, 10)])
    assert f.keep(1, 3, TXN)  # an earlier (committed) transaction of the same producer
    assert not f.keep(1, 4, CTRL)  # its COMMIT marker: dropped, starts nothing
    assert f.aborting == frozenset()
    assert not f.keep(1, 10, TXN)
    assert f.aborting == frozenset({1})
    assert f.keep(2, 11, TXN)
    assert not f.keep(1, 12, TXN)
    assert not f.keep(1, 13, CTRL)
    assert f.aborting == frozenset()
    assert f.keep(1, 14, TXN)


def test_transaction_spanning_two_fetch_answers() -> None:
    # The aborted transaction of pid 5 opened at 3, before this answer (which starts at 20):
    # its later batches are dropped up to its marker, then pid 5's next transaction is kept.
    f = ReadCommittedFilter([(5, 3)])
    batches = [(5, 20, TXN), (6, 21, TXN), (5, 22, TXN), (5, 23, CTRL), (5, 24, TXN), (6, 25, CTRL)]
    assert _kept(f, batches) == [21, 24]


def test_answer_holding_only_markers() -> None:
    # The answer starts at the ABORT marker of pid 5 (its data were in the previous answer):
    # the entry is used up by the marker and does not hide pid 5's next transaction.
    f = ReadCommittedFilter([(5, 3), (6, 1)])
    assert _kept(f, [(5, 30, CTRL), (6, 31, CTRL), (7, 32, CTRL)]) == []
    assert f.aborting == frozenset()
    assert _kept(f, [(5, 33, TXN), (6, 34, TXN)]) == [33, 34]


def test_commit_markers_and_committed_data() -> None:
    f = ReadCommittedFilter([])
    batches = [(1, 0, TXN), (1, 1, TXN), (1, 2, CTRL), (2, 3, TXN), (2, 4, CTRL)]
    assert _kept(f, batches) == [0, 1, 3]


def test_two_aborted_transactions_of_one_producer_in_one_answer() -> None:
    f = ReadCommittedFilter([(1, 8), (1, 2)])  # any order
    batches = [
        (1, 2, TXN), (1, 3, CTRL),  # aborted
        (1, 4, TXN), (1, 5, CTRL),  # committed
        (1, 8, TXN), (1, 9, TXN), (1, 10, CTRL),  # aborted
        (1, 11, TXN),
    ]
    assert _kept(f, batches) == [4, 11]


def test_filter_over_a_real_fetch_buffer() -> None:
    """Walk encoded batches with iter_batches, as the client and broker do."""
    buf = bytearray()

    def add(batch: bytes | bytearray, offset: int) -> None:
        b = bytearray(batch)
        stamp_batch(b, 0, offset, 0)
        buf.extend(b)

    def data(pid: int, attrs: int, body: bytes) -> bytearray:
        return encode_batch([RecordInput(body, 0)], producer_id=pid, producer_epoch=0,
                            base_sequence=0, attributes=attrs)

    add(data(1, TXN, b"a1"), 0)
    add(data(2, TXN, b"c1"), 1)
    add(data(-1, 0, b"plain"), 2)
    add(_marker(False, pid=1), 3)
    add(_marker(True, pid=2), 4)
    add(data(1, TXN, b"a2"), 5)
    f = ReadCommittedFilter([(1, 0)])
    kept = bytearray()
    for pos, h in iter_batches(bytes(buf)):
        if f.keep(h.producer_id, h.base_offset, h.attributes):
            kept += buf[pos : pos + h.size]
    assert [r.body for r in decode_records(kept)] == [b"c1", b"plain", b"a2"]
