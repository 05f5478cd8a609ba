"""A full disk (ENOSPC) in the middle of an append or after a failed fsync never corrupts the
log: a failed append leaves no trace, and a tail whose fsync failed can be written again."""

from __future__ import annotations

import errno
import os

import pytest
from storage_support import BatchFactory, LogOpener

import ferrymq.storage.segment as segment_module
from ferrymq.errors import CorruptRecordError
from ferrymq.protocol.records import decode_records
from ferrymq.storage import Log, LogConfig

EVERY_BATCH = LogConfig(index_interval_bytes=0)  # an index entry for every batch


def test_write_enospc_part_way_undoes_the_whole_append(
    open_log: LogOpener, make_batch: BatchFactory, monkeypatch: pytest.MonkeyPatch,
) -> None:
    log, _ = open_log(EVERY_BATCH, clean=False)
    for i in range(3):
        log.append(make_batch(2), now_ms=1000 + i)
    size = log.size_bytes

    def half(fd: int, parts: list[memoryview]) -> int:  # injected fault: the disk fills up
        return os.write(fd, parts[0][:40])  # inside the header, then:

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_module.os, "writev", half)
    monkeypatch.setattr(segment_module.os, "write", full)
    with pytest.raises(OSError, match="No space"):
        log.append(make_batch(2), now_ms=2000)
    monkeypatch.undo()
    assert (log.end_offset, log.size_bytes) == (6, size)  # no trace: file cut back
    assert os.path.getsize(log_files(log)[-1]) == size
    assert log.append(make_batch(2), now_ms=3000).base_offset == 6  # offsets not reused
    assert [r.offset for r in decode_records(log.read(0, 10**6))] == list(range(8))
    log.close()
    again, report = open_log(EVERY_BATCH, clean=False)
    assert (report.truncated_bytes, again.end_offset) == (0, 8)


def log_files(log: Log) -> list[str]:
    return sorted(str(p) for p in log.directory.glob("*.log"))


def test_rewrite_tail_writes_the_same_bytes_again(open_log: LogOpener,
                                                  make_batch: BatchFactory) -> None:
    log, _ = open_log(EVERY_BATCH)
    for i in range(5):
        log.append(make_batch(3), now_ms=1000 + i)
    before = log.read(0, 10**6)
    assert log.rewrite_tail(6) == 15
    assert log.read(0, 10**6) == before
    assert log.durable_offset == 15
    assert log.append(make_batch(1), now_ms=2000).base_offset == 15


def test_rewrite_tail_refuses_bytes_the_page_cache_lost(open_log: LogOpener, log_dir: os.PathLike[str],
                                                        make_batch: BatchFactory) -> None:
    log, _ = open_log(EVERY_BATCH)
    for i in range(4):
        log.append(make_batch(3), now_ms=1000 + i)
    seg = next(p for p in sorted(os.listdir(log_dir)) if p.endswith(".log"))
    fd = os.open(os.path.join(log_dir, seg), os.O_WRONLY)
    try:
        os.pwrite(fd, b"\0" * 8, log.size_bytes - 8)  # what a dropped page reads back as
    finally:
        os.close(fd)
    with pytest.raises(CorruptRecordError):
        log.rewrite_tail(9)
