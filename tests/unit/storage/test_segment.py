"""One segment: append, read, recover, truncate."""

from __future__ import annotations

from pathlib import Path

import pytest
from storage_support import BatchFactory

from ferrymq.protocol.records import BatchHeader, decode_header, stamp_batch
from ferrymq.storage.segment import Segment


def _fill(seg: Segment, make_batch: BatchFactory, n: int, *, t0: int = 1000) -> list[int]:
    positions = []
    offset = seg.base_offset
    for i in range(n):
        batch = make_batch(2, b"x" * (i * 7))
        stamp_batch(batch, 0, offset, t0 + i)
        positions.append(seg.append(batch, decode_header(batch)))
        offset += 2
    return positions


def test_append_read_and_find(tmp_path: Path, make_batch: BatchFactory) -> None:
    seg = Segment.create(tmp_path, 50, index_interval_bytes=200)
    positions = _fill(seg, make_batch, 20)
    assert seg.next_offset == 90
    assert seg.max_append_time_ms == 1019
    assert seg.first_append_time_ms == 1000
    assert len(seg.index) > 0
    for i, pos in enumerate(positions):
        for off in (50 + 2 * i, 51 + 2 * i):
            found = seg.find_batch(off)
            assert found is not None
            assert found[0] == pos
            assert found[1].base_offset == 50 + 2 * i
    assert seg.find_batch(90) is None
    assert seg.read(positions[1], 10) == seg.read(0, positions[1] + 10)[positions[1] :]
    seg.close()


def test_recover_rebuilds_identical_indexes(tmp_path: Path, make_batch: BatchFactory) -> None:
    seg = Segment.create(tmp_path, 0, index_interval_bytes=150)
    _fill(seg, make_batch, 30)
    seg.flush()
    live_index = seg.index.to_bytes()
    seg.close()
    reopened = Segment.open(tmp_path, 0, index_interval_bytes=150)
    scan = reopened.recover(check_crc=True)
    assert scan.error is None
    assert scan.next_offset == 60
    assert scan.batches == 30
    assert reopened.index.to_bytes() == live_index
    assert (tmp_path / "00000000000000000000.index").read_bytes() == live_index
    reopened.close()


def test_recover_stops_at_a_torn_batch(tmp_path: Path, make_batch: BatchFactory) -> None:
    seg = Segment.create(tmp_path, 0, index_interval_bytes=150)
    positions = _fill(seg, make_batch, 5)
    size = seg.size_bytes
    seg.close()
    with open(tmp_path / "00000000000000000000.log", "r+b") as f:
        f.truncate(size - 3)
    reopened = Segment.open(tmp_path, 0, index_interval_bytes=150)
    scan = reopened.recover()
    assert scan.error is not None
    assert scan.valid_bytes == positions[-1]
    assert scan.next_offset == 8
    reopened.truncate_to(scan.valid_bytes)
    assert reopened.size_bytes == positions[-1]
    assert reopened.next_offset == 8
    reopened.close()


def test_truncate_to_fixes_indexes_and_end(tmp_path: Path, make_batch: BatchFactory) -> None:
    seg = Segment.create(tmp_path, 0, index_interval_bytes=100)
    positions = _fill(seg, make_batch, 30)
    seg.truncate_to(positions[10])
    assert seg.next_offset == 20
    assert seg.max_append_time_ms == 1009
    last = seg.index.last_entry
    assert last is not None and last[1] < positions[10]
    assert seg.find_batch(19) is not None
    assert seg.find_batch(20) is None
    seg.close()


def test_a_lookup_at_the_end_starts_at_a_recent_batch_not_the_index_entry(
        tmp_path: Path, make_batch: BatchFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long poll woken by an append reads the batch just written: its lookup starts at that
    batch (kept in memory), not one index interval of headers before it; after a truncation
    the recent positions are those of the batches left."""
    from ferrymq.storage import segment as segment_module

    seg = Segment.create(tmp_path, 0, index_interval_bytes=1 << 20)  # one index entry at most
    positions = _fill(seg, make_batch, 200)
    decoded: list[int] = []
    real = segment_module.decode_header

    def counting(buf: bytes | bytearray | memoryview, pos: int = 0) -> BatchHeader:
        decoded.append(pos)
        return real(buf, pos)

    monkeypatch.setattr(segment_module, "decode_header", counting)
    assert seg.find_batch(399) == (positions[199], decode_header(seg.read(positions[199], 64)))
    assert len(decoded) == 1
    decoded.clear()
    found = seg.find_batch(10)  # long before the recent ones: the walk from the index
    assert found is not None and found[0] == positions[5] and len(decoded) == 6
    seg.truncate_to(positions[150])
    decoded.clear()
    found = seg.find_batch(299)
    assert found is not None and found[0] == positions[149] and len(decoded) <= 2
    assert seg.find_batch(300) is None
    seg.close()
