"""The scheduler's bucket files: entries, CRCs, torn tails, pending arithmetic, watermarks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ferrymq.storage.checkpoint import write_checkpoint
from ferrymq.storage.handles import FileHandles
from ferrymq.storage.schedule import (
    CANCELLED,
    ENTRY_SIZE,
    FIRED,
    MAX_SKEW_MS,
    SCHEDULED,
    WATERMARKS_FILE,
    ScheduleStore,
    decode_entries,
    encode_entries,
    pending_entries,
)

E1 = (SCHEDULED, 1_700_000_000_000, 7, 3, 42, 0)
E2 = (SCHEDULED, 1_700_000_000_500, 7, 3, 43, -3_600_000)
E3 = (SCHEDULED, 1_700_000_001_000, 8, 0, 2**40, MAX_SKEW_MS)


def test_entries_round_trip_and_are_32_bytes() -> None:
    data = encode_entries([E1, E2, E3])
    assert len(data) == 3 * ENTRY_SIZE == 96
    scan = decode_entries(data)
    assert [tuple(e) for e in scan.entries] == [E1, E2, E3]
    assert scan.corrupt == 0 and scan.torn_bytes == 0


def test_pending_is_scheduled_minus_fired_minus_cancelled_by_position_and_due() -> None:
    entries = decode_entries(encode_entries([
        E1, E2, E3,
        (FIRED, E1[1], 7, 3, 42, 0),
        (CANCELLED, E3[1], 8, 0, 2**40, 0),
        (FIRED, E2[1] + 1, 7, 3, 43, 0),  # another due time: settles nothing
    ])).entries
    assert pending_entries(entries) == {(7, 3, 43): (E2[1], E2[5])}


def test_a_position_scheduled_again_after_its_mark_is_pending_again() -> None:
    # the log lost a torn tail and reused the offset for a new scheduled message
    entries = decode_entries(encode_entries([E1, (FIRED, E1[1], 7, 3, 42, 0),
                                             (SCHEDULED, E1[1] + 9, 7, 3, 42, 0)])).entries
    assert pending_entries(entries) == {(7, 3, 42): (E1[1] + 9, 0)}


@pytest.mark.parametrize("skew", [1, -1, 65_535, 65_536, -65_537, 2**32 + 5, -(2**35), 10**15])
def test_skews_round_trip_in_the_reserved_bytes_and_huge_ones_clamp(skew: int) -> None:
    entry = (SCHEDULED, 1_700_000_000_000, 7, 3, 42, skew)
    [got] = decode_entries(encode_entries([entry])).entries
    assert got == (*entry[:5], max(-MAX_SKEW_MS, min(MAX_SKEW_MS, skew)))


def test_entries_written_without_a_skew_read_as_skew_zero() -> None:
    # the layout before the skew: reserved bytes were zero
    import struct

    from ferrymq.protocol.records import crc32c
    body = struct.pack("<B3xqIH2xq", SCHEDULED, 1_700_000_000_000, 7, 3, 42)
    data = body + crc32c(body).to_bytes(4, "little")
    assert decode_entries(data).entries == [(SCHEDULED, 1_700_000_000_000, 7, 3, 42, 0)]


@pytest.mark.parametrize("cut", [1, 5, 28, 31])
def test_torn_tail_is_ignored(cut: int) -> None:
    data = encode_entries([E1, E2])[: ENTRY_SIZE + cut]
    scan = decode_entries(data)
    assert [tuple(e) for e in scan.entries] == [E1]
    assert scan.torn_bytes == cut and scan.corrupt == 0


@pytest.mark.parametrize("byte", [0, 4, 11, 12, 16, 20, 27, 28, 31])
def test_a_flipped_bit_anywhere_in_an_entry_is_detected(byte: int) -> None:
    data = bytearray(encode_entries([E1, E2, E3]))
    data[ENTRY_SIZE + byte] ^= 0x10
    scan = decode_entries(data)
    assert [tuple(e) for e in scan.entries] == [E1, E3]
    assert scan.corrupt == 1 and scan.torn_bytes == 0


def test_bad_entries_at_the_end_count_as_torn_not_corrupt() -> None:
    data = encode_entries([E1]) + os.urandom(ENTRY_SIZE * 2)
    scan = decode_entries(data)
    assert [tuple(e) for e in scan.entries] == [E1]
    assert scan.corrupt == 0 and scan.torn_bytes == 2 * ENTRY_SIZE


def test_store_append_read_delete(tmp_path: Path) -> None:
    store = ScheduleStore(tmp_path / "schedule")
    store.append(60_000, encode_entries([E1]))
    store.append(60_000, encode_entries([E2]))
    store.append(0, encode_entries([E3]))
    assert store.bucket_starts() == [0, 60_000]
    assert [tuple(e) for e in store.read(60_000).entries] == [E1, E2]
    assert store.has_unsynced
    store.sync()
    assert not store.has_unsynced
    store.delete(0)
    assert store.bucket_starts() == [60_000]
    assert store.read(0).entries == []
    store.close()
    # reopened: the entries are there, names sort by start
    again = ScheduleStore(tmp_path / "schedule")
    assert [tuple(e) for e in again.read(60_000).entries] == [E1, E2]
    assert sorted(p.name for p in (tmp_path / "schedule").iterdir()) == [
        "00000000000000060000.bucket"]
    again.close()


@pytest.mark.parametrize("garbage", [b"\x00" * 5, b"\xff" * ENTRY_SIZE])
def test_append_after_a_torn_tail_cuts_it_first(tmp_path: Path, garbage: bytes) -> None:
    store = ScheduleStore(tmp_path)
    store.append(0, encode_entries([E1]))
    store.close()
    with open(store.path(0), "ab") as f:  # a crash in the middle of a write
        f.write(garbage)
    store = ScheduleStore(tmp_path)
    store.append(0, encode_entries([E2]))
    store.close()
    scan = ScheduleStore(tmp_path).read(0)
    assert [tuple(e) for e in scan.entries] == [E1, E2]
    assert scan.corrupt == 0 and scan.torn_bytes == 0
    assert store.path(0).stat().st_size == 2 * ENTRY_SIZE


def test_many_buckets_open_at_once_stay_bounded(tmp_path: Path) -> None:
    handles = FileHandles(4)
    store = ScheduleStore(tmp_path, handles=handles)
    for i in range(20):
        store.append(i * 1000, encode_entries([(SCHEDULED, i * 1000, 1, 0, i, 0)]))
    assert handles.open_count == 20  # written, not yet fsynced: none may be closed
    store.sync()
    store.append(20_000, encode_entries([(SCHEDULED, 20_000, 1, 0, 20, 0)]))
    assert handles.open_count == 4  # fsynced ones were evicted for the new one
    store.append(0, encode_entries([(SCHEDULED, 0, 1, 0, 0, 1)]))  # reopened on demand
    store.close()
    assert handles.open_count == 0
    assert all(len(store.read(i * 1000).entries) == 1 for i in range(1, 21))
    assert len(store.read(0).entries) == 2


def test_watermarks_round_trip_and_damage_means_rescan(tmp_path: Path) -> None:
    store = ScheduleStore(tmp_path)
    assert store.read_watermarks() is None
    store.write_watermarks({(1, 0): 10, (2, 3): 0})
    assert store.read_watermarks() == {(1, 0): 10, (2, 3): 0}
    assert store.read_clock() is None
    store.write_watermarks({(1, 0): 11}, (5_000, 4_000, -7, 9))
    assert store.read_watermarks() == {(1, 0): 11}
    assert store.read_clock() == (5_000, 4_000, -7, 9)
    raw = bytearray((tmp_path / WATERMARKS_FILE).read_bytes())
    raw[-1] ^= 1
    (tmp_path / WATERMARKS_FILE).write_bytes(bytes(raw))
    assert store.read_watermarks() is None
    write_checkpoint(tmp_path / WATERMARKS_FILE, b"\x91\x01")  # valid file, wrong payload
    assert store.read_watermarks() is None
    store.close()


def test_stray_tmp_files_are_removed(tmp_path: Path) -> None:
    (tmp_path / "scheduler.checkpoint.tmp").write_bytes(b"x")
    ScheduleStore(tmp_path).close()
    assert not (tmp_path / "scheduler.checkpoint.tmp").exists()


def test_retention_never_deletes_a_segment_at_or_above_the_scheduler_floor(tmp_path: Path) -> None:
    from ferrymq.protocol.records import RecordInput, encode_batch
    from ferrymq.storage import Log, LogConfig

    log, _ = Log.open(tmp_path / "q", LogConfig(segment_bytes=300, retention_ms=0),
                      clean_shutdown=False, now_ms=0)
    for i in range(30):
        log.append(encode_batch([RecordInput(b"x" * 50, i)]), now_ms=i)
    segments = log.segments()
    assert len(segments) > 4
    floor = segments[2].base_offset + 1  # a pending scheduled original inside segment 2
    assert log.delete_old_segments(10**9, keep_from=floor) == 2
    assert log.start_offset == segments[2].base_offset
    assert log.delete_old_segments(10**9, keep_from=segments[2].base_offset) == 0
    assert log.delete_old_segments(10**9) == len(segments) - 3  # no floor: all but the active
    log.close()
