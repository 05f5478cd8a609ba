"""The per-queue key index: file format, lookups, repair and rebuild, retention, collisions."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq.protocol.records import RecordInput, crc32c, encode_batch, stamp_batch
from ferrymq.storage import Log, LogConfig
from ferrymq.storage.keyindex import (
    BLOCK_HEADER_SIZE,
    ENTRY_SIZE,
    FILE_HEADER_SIZE,
    KEY_INDEX_DIR,
    PROGRESS_BLOCK_OFFSETS,
    KeyIndex,
    key_hash,
    scan_keys,
)

COLLIDING = (b"key-1371838", b"key-2000402")
"""Two keys with the same CRC32C (found by search): the index cannot tell them apart."""


def keyed_batch(*keys: str, body: bytes = b"m", ts: int = 1000) -> bytearray:
    """One record per entry of ``keys``; an entry holds NUL-joined keys ("" for none)."""
    return encode_batch([RecordInput(body + str(i).encode(), ts, keys=k.encode())
                         for i, k in enumerate(keys)])


def candidates(idx: KeyIndex, key: bytes, start: int = 0) -> list[int]:
    return [o for chunk in idx.lookup(key, start) for o in chunk]


def index_files(queue_dir: Path) -> list[Path]:
    return sorted((queue_dir / KEY_INDEX_DIR).glob("*.kix"))


def open_log(log_dir: Path, config: LogConfig | None = None) -> Log:
    log, _ = Log.open(log_dir, config or LogConfig(), clean_shutdown=True, now_ms=0)
    return log


@pytest.fixture
def log(log_dir: Path) -> Iterator[Log]:
    lg = open_log(log_dir)
    yield lg
    lg.close()


def test_lookup_finds_every_record_with_the_key_newest_first(log: Log, log_dir: Path) -> None:
    log.append(keyed_batch("a", "b", "a\x00c", ""), now_ms=1)
    log.append(keyed_batch("c\x00a\x00a", "d"), now_ms=2)
    idx, report = KeyIndex.open(log_dir, log)
    assert (report.files, report.next_offset, report.rebuilt) == (0, 0, False)
    assert idx.index(log, log.end_offset, 1 << 20) > 0
    assert idx.next_offset == log.end_offset == 6
    assert candidates(idx, b"a") == [4, 2, 0]  # a key repeated in one record counts once
    assert candidates(idx, b"c") == [4, 2]
    assert candidates(idx, b"d") == [5]
    assert candidates(idx, b"zz") == []
    assert candidates(idx, b"a", start=3) == [4]


def test_file_layout_is_pinned(log: Log, log_dir: Path) -> None:
    b = log.append(keyed_batch("k1", "", "k2\x00k1"), now_ms=5)
    idx, _ = KeyIndex.open(log_dir, log)
    idx.index(log, log.end_offset, 1 << 20)
    (path,) = index_files(log_dir)
    assert path.name == "00000000000000000000.kix"
    data = path.read_bytes()
    # file header
    assert data[:4] == b"FKIX"
    assert struct.unpack_from("<HHq", data, 4) == (1, 0, 0)
    assert struct.unpack_from("<I", data, 16)[0] == crc32c(data[:16])
    # one block: magic, count, start, next, anchor (base offset, body crc of the last batch)
    blk = data[FILE_HEADER_SIZE:]
    magic, count, start, nxt, abase, acrc, crc = struct.unpack_from("<4sIqqqII", blk, 0)
    batch_crc = struct.unpack_from("<I", log.read(0, 1), 24)[0]
    assert (magic, count, start, nxt, abase, acrc) == (b"KBLK", 3, 0, 3, b.base_offset,
                                                        batch_crc)
    entries = [struct.unpack_from("<Iq", blk, BLOCK_HEADER_SIZE + i * ENTRY_SIZE)
               for i in range(count)]
    assert entries == [(crc32c(b"k1"), 0), (crc32c(b"k2"), 2), (crc32c(b"k1"), 2)]
    assert crc == crc32c(blk[BLOCK_HEADER_SIZE:], crc32c(blk[:36]))
    assert len(data) == FILE_HEADER_SIZE + BLOCK_HEADER_SIZE + 3 * ENTRY_SIZE


def test_reopen_keeps_the_index_and_its_progress(log: Log, log_dir: Path) -> None:
    for i in range(3):
        log.append(keyed_batch(f"k{i}", "shared"), now_ms=i)
    idx, _ = KeyIndex.open(log_dir, log)
    idx.index(log, log.end_offset, 1 << 20)
    log.append(keyed_batch("late"), now_ms=9)  # not indexed yet
    again, report = KeyIndex.open(log_dir, log)
    assert (report.next_offset, report.dropped_bytes, report.rebuilt) == (6, 0, False)
    assert candidates(again, b"shared") == [5, 3, 1]
    assert candidates(again, b"late") == []
    again.index(log, log.end_offset, 1 << 20)
    assert candidates(again, b"late") == [6]


def test_index_stops_at_upto_and_respects_the_byte_budget(log: Log, log_dir: Path) -> None:
    for i in range(10):
        log.append(keyed_batch(f"k{i}", body=b"x" * 1000), now_ms=i)
    idx, _ = KeyIndex.open(log_dir, log)
    idx.index(log, 4, 1 << 20)
    assert idx.next_offset == 4
    used = idx.index(log, log.end_offset, 1)  # at least one batch per call
    assert idx.next_offset == 5
    assert 1000 < used < 2000
    idx.index(log, log.end_offset, 1 << 20)
    assert idx.next_offset == 10
    assert [candidates(idx, f"k{i}".encode()) for i in range(10)] == [[i] for i in range(10)]


def test_torn_tail_is_cut_and_reindexed(log: Log, log_dir: Path) -> None:
    log.append(keyed_batch("a"), now_ms=1)
    idx, _ = KeyIndex.open(log_dir, log)
    idx.index(log, log.end_offset, 1 << 20)
    log.append(keyed_batch("b", "a"), now_ms=2)
    idx.index(log, log.end_offset, 1 << 20)
    (path,) = index_files(log_dir)
    size = path.stat().st_size
    with path.open("r+b") as f:  # the last block half written
        f.truncate(size - 5)
    again, report = KeyIndex.open(log_dir, log)
    assert report.next_offset == 1
    assert report.dropped_bytes > 0
    assert path.stat().st_size == FILE_HEADER_SIZE + BLOCK_HEADER_SIZE + ENTRY_SIZE
    assert candidates(again, b"a") == [0]
    again.index(log, log.end_offset, 1 << 20)
    assert candidates(again, b"a") == [2, 0]
    assert candidates(again, b"b") == [1]


@pytest.mark.parametrize("where", ["entry", "header", "file_header"])
def test_flipped_byte_drops_the_damaged_part_and_the_log_rebuilds_it(
    log: Log, log_dir: Path, where: str
) -> None:
    log.append(keyed_batch("a", "b"), now_ms=1)
    idx, _ = KeyIndex.open(log_dir, log)
    idx.index(log, log.end_offset, 1 << 20)
    log.append(keyed_batch("a"), now_ms=2)
    idx.index(log, log.end_offset, 1 << 20)
    (path,) = index_files(log_dir)
    data = bytearray(path.read_bytes())
    second = FILE_HEADER_SIZE + BLOCK_HEADER_SIZE + 2 * ENTRY_SIZE
    pos = {"entry": second + BLOCK_HEADER_SIZE + 2, "header": second + 10, "file_header": 9}
    data[pos[where]] ^= 0x40
    path.write_bytes(data)
    again, report = KeyIndex.open(log_dir, log)
    assert report.dropped_bytes > 0
    assert report.next_offset == (0 if where == "file_header" else 2)
    again.index(log, log.end_offset, 1 << 20)
    assert candidates(again, b"a") == [2, 0]
    assert candidates(again, b"b") == [1]


def test_damage_found_by_a_lookup_cuts_the_index_there(log: Log, log_dir: Path) -> None:
    log.append(keyed_batch("a"), now_ms=1)
    idx, _ = KeyIndex.open(log_dir, log)
    idx.index(log, log.end_offset, 1 << 20)
    log.append(keyed_batch("a"), now_ms=2)
    idx.index(log, log.end_offset, 1 << 20)
    (path,) = index_files(log_dir)
    data = bytearray(path.read_bytes())
    data[FILE_HEADER_SIZE + BLOCK_HEADER_SIZE + 1] ^= 1  # the first block's entry
    path.write_bytes(data)
    assert candidates(idx, b"a") == []  # nothing from a damaged or unverifiable block
    assert idx.next_offset == 0
    assert not index_files(log_dir)
    idx.index(log, log.end_offset, 1 << 20)
    assert candidates(idx, b"a") == [1, 0]


def test_missing_index_is_rebuilt_from_the_log(log: Log, log_dir: Path) -> None:
    log.append(keyed_batch("a", "b"), now_ms=1)
    idx, _ = KeyIndex.open(log_dir, log)
    idx.index(log, log.end_offset, 1 << 20)
    for p in index_files(log_dir):
        p.unlink()
    again, report = KeyIndex.open(log_dir, log)
    assert report.next_offset == 0
    assert candidates(again, b"a") == []
    again.index(log, log.end_offset, 1 << 20)
    assert candidates(again, b"a") == [0]
    assert index_files(log_dir)


def test_index_ahead_of_a_truncated_log_is_cut_back(log: Log, log_dir: Path) -> None:
    """After a crash the log may lose a torn tail and reuse its offsets for other records:
    index blocks whose anchor batch is gone are dropped, older ones kept."""
    log.append(keyed_batch("old0"), now_ms=1)
    idx, _ = KeyIndex.open(log_dir, log)
    idx.index(log, log.end_offset, 1 << 20)
    log.append(keyed_batch("old1"), now_ms=2)
    idx.index(log, log.end_offset, 1 << 20)
    log.append(keyed_batch("old2"), now_ms=3)
    idx.index(log, log.end_offset, 1 << 20)
    log.truncate_to(2)
    log.append(keyed_batch("new2", body=b"other"), now_ms=4)
    again, report = KeyIndex.open(log_dir, log)
    assert report.next_offset == 2
    assert not report.rebuilt
    again.index(log, log.end_offset, 1 << 20)
    assert candidates(again, b"old2") == []
    assert candidates(again, b"new2") == [2]
    assert candidates(again, b"old1") == [1]


def test_index_of_a_log_that_lost_everything_is_rebuilt(log: Log, log_dir: Path) -> None:
    log.append(keyed_batch("a"), now_ms=1)
    idx, _ = KeyIndex.open(log_dir, log)
    idx.index(log, log.end_offset, 1 << 20)
    log.truncate_to(0)
    log.append(keyed_batch("b"), now_ms=2)
    again, report = KeyIndex.open(log_dir, log)
    assert report.rebuilt
    again.index(log, log.end_offset, 1 << 20)
    assert candidates(again, b"a") == []
    assert candidates(again, b"b") == [0]


def test_colliding_keys_share_entries(log: Log, log_dir: Path) -> None:
    a, b = COLLIDING
    assert a != b
    assert key_hash(a) == key_hash(b)
    log.append(keyed_batch(a.decode(), "x", b.decode()), now_ms=1)
    idx, _ = KeyIndex.open(log_dir, log)
    idx.index(log, log.end_offset, 1 << 20)
    # the index gives both: a reader must check the record's keys
    assert candidates(idx, a) == [2, 0]
    assert candidates(idx, b) == [2, 0]


def test_keyless_data_writes_a_progress_block_only_now_and_then(log: Log, log_dir: Path) -> None:
    log.append(encode_batch([RecordInput(b"x", 1)] * 10), now_ms=1)
    idx, _ = KeyIndex.open(log_dir, log)
    idx.index(log, log.end_offset, 1 << 20)
    assert idx.next_offset == 10
    assert not index_files(log_dir)  # cheap to redo after a restart
    again, _ = KeyIndex.open(log_dir, log)
    assert again.next_offset == 0
    log.append(encode_batch([RecordInput(b"x", 1)] * PROGRESS_BLOCK_OFFSETS), now_ms=2)
    again.index(log, log.end_offset, 64 << 20)
    assert len(index_files(log_dir)) == 1
    third, _ = KeyIndex.open(log_dir, log)
    assert third.next_offset == log.end_offset


def test_files_roll_and_retention_deletes_the_old_ones(tmp_path: Path) -> None:
    qdir = tmp_path / "q"
    cfg = LogConfig(segment_bytes=400, retention_ms=None, retention_bytes=0)
    log = open_log(qdir, cfg)
    try:
        idx, _ = KeyIndex.open(qdir, log, file_bytes=100)
        for i in range(8):
            log.append(keyed_batch(f"k{i}", "all", body=b"x" * 100), now_ms=i)
            idx.index(log, log.end_offset, 1 << 20)
        files = index_files(qdir)
        assert len(files) == 8  # each block rolled a new file
        assert files[3].name == f"{6:020d}.kix"
        assert candidates(idx, b"all") == [15, 13, 11, 9, 7, 5, 3, 1]
        assert log.delete_old_segments(100) > 0
        start = log.start_offset
        assert start > 0
        idx.delete_below(start)
        kept = index_files(qdir)
        assert len(kept) < 8
        assert int(kept[0].name[:20]) <= start  # the first kept file still covers the start
        assert candidates(idx, b"all", start) == [o for o in range(15, 0, -2) if o >= start]
        _again, report = KeyIndex.open(qdir, log, file_bytes=100)
        assert (report.files, report.next_offset, report.rebuilt) == (len(kept), 16, False)
    finally:
        log.close()


def test_scan_keys_skips_a_malformed_batch_and_reports_the_anchor() -> None:
    good = keyed_batch("a", "b")
    bad = keyed_batch("c")
    # make the record's keys length run past the record (CRC not checked by the scan)
    struct.pack_into("<H", bad, 64 + 16, 500)
    stamp_batch(bad, 0, 2, 0)
    data = bytes(good + bad)
    entries, nxt, abase, acrc = scan_keys(data, 0)
    assert entries == [(key_hash(b"a"), 0), (key_hash(b"b"), 1)]
    assert (nxt, abase) == (3, 2)
    assert acrc == struct.unpack_from("<I", bad, 24)[0]
    assert scan_keys(data, 1)[0] == [(key_hash(b"b"), 1)]
    assert scan_keys(b"", 7) == ([], 7, -1, 0)
