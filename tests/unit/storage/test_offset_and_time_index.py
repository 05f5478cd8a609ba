"""Sparse offset and time indexes: lookup, persistence, validation."""

from __future__ import annotations

from pathlib import Path

from storage_support import build_batch

from ferrymq.storage import Log, LogConfig
from ferrymq.storage.files import INDEX_SUFFIX, segment_file_name
from ferrymq.storage.index import OffsetIndex
from ferrymq.storage.timeindex import TimeIndex


def test_offset_index_lookup_finds_largest_entry_not_above(tmp_path: Path) -> None:
    index = OffsetIndex(tmp_path / "i", 100)
    assert index.lookup(150) == (100, 0)
    for off, pos in [(110, 1000), (120, 2000), (130, 3000)]:
        index.append(off, pos)
    assert index.lookup(100) == (100, 0)
    assert index.lookup(109) == (100, 0)
    assert index.lookup(110) == (110, 1000)
    assert index.lookup(125) == (120, 2000)
    assert index.lookup(10**9) == (130, 3000)


def test_offset_index_persists_appends_and_loads(tmp_path: Path) -> None:
    path = tmp_path / "i"
    index = OffsetIndex(path, 5)
    index.append(7, 100)
    index.append(9, 250)
    assert not path.exists()  # entries live in memory until the file is written whole
    index.write_file()
    assert path.stat().st_size == 16
    loaded = OffsetIndex.load(path, 5, size_bytes=300, max_relative_offset=10)
    assert loaded is not None
    assert loaded.to_bytes() == index.to_bytes()
    assert loaded.lookup(8) == (7, 100)


def test_offset_index_load_rejects_inconsistent_files(tmp_path: Path) -> None:
    path = tmp_path / "i"
    assert OffsetIndex.load(path, 0, size_bytes=10, max_relative_offset=10) is None
    index = OffsetIndex(path, 0)
    index.append(1, 10)
    index.append(2, 20)
    index.write_file()
    assert OffsetIndex.load(path, 0, size_bytes=21, max_relative_offset=10) is not None
    assert OffsetIndex.load(path, 0, size_bytes=20, max_relative_offset=10) is None  # position
    assert OffsetIndex.load(path, 0, size_bytes=21, max_relative_offset=1) is None  # offset
    path.write_bytes(path.read_bytes()[:-1])
    assert OffsetIndex.load(path, 0, size_bytes=21, max_relative_offset=10) is None  # length
    path.write_bytes(index.to_bytes()[8:] + index.to_bytes()[:8])
    assert OffsetIndex.load(path, 0, size_bytes=21, max_relative_offset=10) is None  # order


def test_offset_index_truncate(tmp_path: Path) -> None:
    path = tmp_path / "i"
    index = OffsetIndex(path, 0)
    for i in range(1, 6):
        index.append(i, i * 100)
    index.write_file()
    index.truncate_to_position(300)
    assert index.last_entry == (2, 200)
    assert path.stat().st_size == 40  # memory only: the file is written when asked
    index.write_file()
    assert path.stat().st_size == 16


def test_time_index_lookup_and_persistence(tmp_path: Path) -> None:
    path = tmp_path / "t"
    ti = TimeIndex(path, 10)
    ti.maybe_append(1000, 10)
    ti.maybe_append(1000, 12)  # same time: skipped
    ti.maybe_append(2000, 15)
    ti.maybe_append(1500, 20)  # older time: skipped
    ti.maybe_append(3000, 20)
    assert len(ti) == 3
    assert ti.lookup_before(500) == 10
    assert ti.lookup_before(1000) == 10
    assert ti.lookup_before(1001) == 10
    assert ti.lookup_before(2500) == 15
    assert ti.lookup_before(10**12) == 20
    ti.write_file()
    loaded = TimeIndex.load(path, 10, max_relative_offset=100)
    assert loaded is not None
    assert loaded.to_bytes() == ti.to_bytes()
    assert TimeIndex.load(path, 10, max_relative_offset=5) is None
    ti.truncate_to_offset(15)
    assert ti.last_entry == (1000, 10)
    path.write_bytes(b"\x00" * 13)
    assert TimeIndex.load(path, 10, max_relative_offset=100) is None


def test_index_files_are_written_at_close_only_when_they_changed(tmp_path: Path) -> None:
    """The active segment's indexes live in memory; a close writes them if they changed, so
    closing an idle log costs no index write (brokers with many idle queues)."""
    config = LogConfig(index_interval_bytes=100)
    log, _ = Log.open(tmp_path, config, clean_shutdown=True, now_ms=0)
    for t in range(5):
        log.append(build_batch(2, b"x" * 50), now_ms=1000 + t)
    index = tmp_path / segment_file_name(0, INDEX_SUFFIX)
    assert not index.exists()  # nothing written while appending
    log.close()
    written = index.stat().st_ino
    assert OffsetIndex.load(index, 0, size_bytes=10**6, max_relative_offset=100) is not None
    log, _ = Log.open(tmp_path, config, clean_shutdown=True, now_ms=0)
    log.close()
    assert index.stat().st_ino == written  # unchanged: not rewritten
    log, _ = Log.open(tmp_path, config, clean_shutdown=True, now_ms=0)
    log.append(build_batch(2, b"y" * 50), now_ms=2000)
    log.close()
    assert index.stat().st_ino != written
