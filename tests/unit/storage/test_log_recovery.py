"""Reopen after clean shutdown and after crashes: torn tails, mid-log corruption, indexes."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from storage_support import BatchFactory, LogOpener

from ferrymq.errors import CorruptRecordError
from ferrymq.protocol.records import decode_records, iter_batches
from ferrymq.storage import Log, LogConfig

CONFIG = LogConfig(segment_bytes=100_000, index_interval_bytes=150)
LOG0 = "00000000000000000000.log"
INDEX0 = "00000000000000000000.index"


def _write(log: Log, make_batch: BatchFactory, n: int) -> list[int]:
    """Append ``n`` 2-record batches; return each batch's end position in the file."""
    ends = []
    for i in range(n):
        log.append(make_batch(2, b"r" * (i % 5)), now_ms=1000 + i)
        ends.append(log.size_bytes)
    return ends


def _offsets(log: Log) -> list[int]:
    """Every offset readable from the start, following segments."""
    seen: list[int] = []
    offset = log.start_offset
    while offset < log.end_offset:
        records = decode_records(log.read(offset, 10**9))
        seen += [r.offset for r in records]
        offset = records[-1].offset + 1
    return seen


@pytest.mark.parametrize("clean", [True, False])
def test_reopen_keeps_everything(open_log: LogOpener, make_batch: BatchFactory, clean: bool) -> None:
    config = LogConfig(segment_bytes=500, index_interval_bytes=100)
    log, _ = open_log(config)
    _write(log, make_batch, 30)
    segments = log.segments()
    if clean:
        log.close()
    else:
        log.flush()
    reopened, report = open_log(config, clean=clean)
    assert report.end_offset == 60
    assert report.truncated_bytes == 0
    assert report.lost_offsets is None
    assert reopened.segments() == segments
    assert _offsets(reopened) == list(range(60))
    assert reopened.durable_offset == reopened.end_offset
    assert reopened.append(make_batch(), now_ms=0).base_offset == 60


def test_torn_tail_at_every_byte_of_the_last_batch(
    tmp_path: Path, make_batch: BatchFactory, caplog: pytest.LogCaptureFixture
) -> None:
    source = tmp_path / "source"
    log, _ = Log.open(source, CONFIG, clean_shutdown=True, now_ms=0)
    ends = _write(log, make_batch, 8)
    log.close()
    data = (source / LOG0).read_bytes()
    last_start = ends[-2]
    # The index a fresh rebuild of the 7 intact batches produces.
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / LOG0).write_bytes(data[:last_start])
    ref_log, _ = Log.open(ref, CONFIG, clean_shutdown=False, now_ms=0)
    ref_log.close()
    ref_index = (ref / INDEX0).read_bytes()
    caplog.set_level(logging.WARNING, logger="ferrymq.storage")
    for cut in range(last_start + 1, len(data)):
        work = tmp_path / f"cut{cut}"
        shutil.copytree(source, work)
        with open(work / LOG0, "r+b") as f:
            f.truncate(cut)
        caplog.clear()
        recovered, report = Log.open(work, CONFIG, clean_shutdown=False, now_ms=0)
        assert report.end_offset == 14, cut
        assert report.truncated_bytes == cut - last_start
        assert report.lost_offsets is not None and report.lost_offsets[0] == 14
        assert report.segments_scanned == 1
        assert any("torn tail" in r.message for r in caplog.records)
        assert _offsets(recovered) == list(range(14))
        assert (work / LOG0).stat().st_size == last_start
        assert (work / INDEX0).read_bytes() == ref_index
        assert recovered.append(make_batch(), now_ms=0).base_offset == 14
        recovered.close()
        shutil.rmtree(work)


def test_torn_tail_with_trailing_garbage_and_zeros(
    open_log: LogOpener, make_batch: BatchFactory, log_dir: Path
) -> None:
    log, _ = open_log(CONFIG)
    ends = _write(log, make_batch, 5)
    log.flush()
    with open(log_dir / LOG0, "ab") as f:
        f.write(b"\x00" * 5000 + bytes(range(256)) * 3)
    reopened, report = open_log(CONFIG, clean=False)
    assert report.end_offset == 10
    assert report.truncated_bytes == 5000 + 768
    assert (log_dir / LOG0).stat().st_size == ends[-1]
    assert reopened.append(make_batch(), now_ms=0).base_offset == 10


def _flip(path: Path, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(data)


def test_any_bit_flip_in_a_middle_batch_refuses_to_start(tmp_path: Path, make_batch: BatchFactory) -> None:
    source = tmp_path / "source"
    log, _ = Log.open(source, CONFIG, clean_shutdown=True, now_ms=0)
    ends = _write(log, make_batch, 5)
    log.close()
    original = (source / LOG0).read_bytes()
    work = tmp_path / "work"
    shutil.copytree(source, work)
    for bit in range(ends[1] * 8, ends[2] * 8):  # every bit of batch 2 (offsets 4..5)
        (work / LOG0).write_bytes(original)
        _flip(work / LOG0, bit)
        with pytest.raises(CorruptRecordError, match="mid-log corruption") as info:
            Log.open(work, CONFIG, clean_shutdown=False, now_ms=0)
        assert LOG0 in str(info.value)
        assert (work / LOG0).read_bytes()[ends[2] :] == original[ends[2] :], bit


def test_bit_flip_in_the_last_batch_is_a_torn_tail(
    open_log: LogOpener, make_batch: BatchFactory, log_dir: Path
) -> None:
    log, _ = open_log(CONFIG)
    ends = _write(log, make_batch, 5)
    log.flush()
    _flip(log_dir / LOG0, ends[3] * 8 + 300)
    _reopened, report = open_log(CONFIG, clean=False)
    assert report.end_offset == 8
    assert report.lost_offsets == (8, 9)


def test_corruption_before_a_later_segment_refuses_to_start(
    open_log: LogOpener, make_batch: BatchFactory, log_dir: Path
) -> None:
    config = LogConfig(segment_bytes=400, index_interval_bytes=100)
    log, _ = open_log(config)
    _write(log, make_batch, 20)
    log.flush()
    first = sorted(log_dir.glob("*.log"))[0]
    with open(first, "r+b") as f:
        f.truncate(first.stat().st_size - 10)
    (log_dir / "recovery-point.checkpoint").unlink()
    with pytest.raises(CorruptRecordError, match="holds valid offsets"):
        Log.open(log_dir, config, clean_shutdown=False, now_ms=0)


def test_empty_trailing_segment_after_torn_one_is_removed(
    open_log: LogOpener, make_batch: BatchFactory, log_dir: Path
) -> None:
    log, _ = open_log(CONFIG)
    _write(log, make_batch, 3)
    log.flush()
    with open(log_dir / LOG0, "ab") as f:
        f.write(b"\x01" * 30)
    (log_dir / "00000000000000000009.log").write_bytes(b"\x00" * 100)
    reopened, report = open_log(CONFIG, clean=False)
    assert report.deleted_segments == 1
    assert report.end_offset == 6
    assert [s.base_offset for s in reopened.segments()] == [0]
    assert not (log_dir / "00000000000000000009.log").exists()


@pytest.mark.parametrize("damage", ["missing", "garbage", "truncated", "wrong positions"])
@pytest.mark.parametrize("clean", [True, False])
def test_damaged_indexes_are_rebuilt(
    open_log: LogOpener, make_batch: BatchFactory, log_dir: Path, damage: str, clean: bool
) -> None:
    config = LogConfig(segment_bytes=1000, index_interval_bytes=100)
    log, _ = open_log(config)
    _write(log, make_batch, 40)
    log.close()
    reference = {p.name: p.read_bytes() for p in log_dir.glob("*.*index")}
    for path in log_dir.glob("*.*index"):
        if damage == "missing":
            path.unlink()
        elif damage == "garbage":
            path.write_bytes(b"\xff" * 37)
        elif damage == "truncated":
            path.write_bytes(path.read_bytes()[:-3])
        elif path.suffix == ".index" and path.stat().st_size >= 16:
            data = bytearray(path.read_bytes())
            data[4] ^= 0x01  # first position off by one: still monotonic
            path.write_bytes(data)
    reopened, _ = open_log(config, clean=clean)
    assert _offsets(reopened) == list(range(80))
    for offset in range(80):
        assert next(iter_batches(reopened.read(offset, 1)))[1].last_offset >= offset
    assert reopened.offset_for_time(1020) == 40
    reopened.close()
    rebuilt = {p.name: p.read_bytes() for p in log_dir.glob("*.*index")}
    assert rebuilt == reference


def test_leftover_tmp_and_deleted_files_are_removed(
    open_log: LogOpener, make_batch: BatchFactory, log_dir: Path
) -> None:
    log, _ = open_log(CONFIG)
    _write(log, make_batch, 2)
    log.close()
    (log_dir / "00000000000000000000.snapshot.tmp").write_bytes(b"half")
    (log_dir / "00000000000000000077.log.deleted").write_bytes(b"old")
    (log_dir / "00000000000000000077.index").write_bytes(b"orphan")
    _reopened, report = open_log(CONFIG, clean=False)
    names = sorted(p.name for p in log_dir.iterdir())
    assert not [n for n in names if n.endswith((".tmp", ".deleted")) or "77" in n]
    assert report.end_offset == 4


def test_corrupt_recovery_point_falls_back_to_full_scan(
    open_log: LogOpener, make_batch: BatchFactory, log_dir: Path
) -> None:
    config = LogConfig(segment_bytes=400, index_interval_bytes=100)
    log, _ = open_log(config)
    _write(log, make_batch, 20)
    log.close()
    (log_dir / "recovery-point.checkpoint").write_bytes(b"junk")
    reopened, report = open_log(config, clean=False)
    assert report.segments_scanned == len(reopened.segments())
    assert report.end_offset == 40


def test_unclean_reopen_scans_only_from_the_recovery_point(
    open_log: LogOpener, make_batch: BatchFactory
) -> None:
    config = LogConfig(segment_bytes=400, index_interval_bytes=100)
    log, _ = open_log(config)
    _write(log, make_batch, 30)
    log.flush()
    segments = len(log.segments())
    reopened, report = open_log(config, clean=False)
    assert segments > 3
    assert report.segments_scanned <= 2
    assert _offsets(reopened) == list(range(60))
