"""Retention by age and size, truncation, and flush from another thread."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from storage_support import BatchFactory, LogOpener

from ferrymq.errors import OffsetOutOfRangeError
from ferrymq.protocol.records import iter_batches
from ferrymq.storage import Log, LogConfig


def _fill(log: Log, make_batch: BatchFactory, n: int, *, t0: int = 0) -> None:
    for i in range(n):
        log.append(make_batch(2, b"d" * 20), now_ms=t0 + i * 10)


def test_retention_by_age_deletes_old_sealed_segments(
    open_log: LogOpener, make_batch: BatchFactory, log_dir: Path
) -> None:
    log, _ = open_log(LogConfig(segment_bytes=500, retention_ms=1000))
    _fill(log, make_batch, 40)  # append times 0..390
    segments = log.segments()
    assert len(segments) > 3
    assert log.delete_old_segments(now_ms=1000) == 0
    second_newest = segments[1].max_append_time_ms
    assert second_newest is not None
    deleted = log.delete_old_segments(now_ms=second_newest + 1001)
    assert deleted == 2
    assert log.start_offset == segments[2].base_offset
    assert log.segments() == segments[2:]
    with pytest.raises(OffsetOutOfRangeError):
        log.read(0, 100)
    assert next(iter_batches(log.read(log.start_offset, 1)))[1].base_offset == log.start_offset
    assert not list(log_dir.glob("*.deleted"))
    assert len(list(log_dir.glob("*.log"))) == len(segments) - 2
    # Never the active segment, however old.
    assert log.delete_old_segments(now_ms=10**12) == len(segments) - 3
    assert len(log.segments()) == 1
    log.close()
    reopened, _ = open_log(LogConfig(segment_bytes=500), clean=True)
    assert reopened.start_offset == segments[-1].base_offset
    assert reopened.end_offset == 80


def test_retention_by_size_keeps_at_least_retention_bytes(
    open_log: LogOpener, make_batch: BatchFactory
) -> None:
    log, _ = open_log(LogConfig(segment_bytes=500, retention_ms=None, retention_bytes=1200))
    _fill(log, make_batch, 40)
    before = log.size_bytes
    deleted = log.delete_old_segments(now_ms=10**12)
    assert deleted > 0
    assert log.size_bytes >= 1200
    assert log.size_bytes - log.segments()[0].size_bytes < 1200
    assert before > log.size_bytes
    assert log.end_offset == 80


def test_no_retention_keeps_forever(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(LogConfig(segment_bytes=500, retention_ms=None))
    _fill(log, make_batch, 40)
    assert log.delete_old_segments(now_ms=10**15) == 0


def test_truncate_to_across_segments(open_log: LogOpener, make_batch: BatchFactory, log_dir: Path) -> None:
    config = LogConfig(segment_bytes=500, index_interval_bytes=100)
    log, _ = open_log(config)
    _fill(log, make_batch, 40)
    log.flush()
    log.truncate_to(81)  # past the end: no-op
    assert log.end_offset == 80
    log.truncate_to(31)  # inside batch 30..31: the whole batch goes
    assert log.end_offset == 30
    assert log.durable_offset == 30
    assert log.segments()[-1].base_offset <= 30
    assert not log.read(28, 10**6)[200:]
    assert [h.base_offset for _p, h in iter_batches(log.read(28, 10**6))] == [28]
    assert log.append(make_batch(), now_ms=0).base_offset == 30
    log.truncate_to(log.segments()[-1].base_offset)
    assert log.end_offset == log.segments()[-1].base_offset
    with pytest.raises(OffsetOutOfRangeError):
        log.truncate_to(-1)
    end = log.end_offset
    log.close()
    reopened, _ = open_log(config, clean=False)
    assert reopened.end_offset == end


def test_flush_from_another_thread_while_appending(open_log: LogOpener, make_batch: BatchFactory) -> None:
    config = LogConfig(segment_bytes=2000, index_interval_bytes=100)
    log, _ = open_log(config)
    stop = threading.Event()
    durable: list[int] = []
    errors: list[BaseException] = []

    def flusher() -> None:
        try:
            while not stop.is_set():
                durable.append(log.flush())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=flusher)
    thread.start()
    try:
        for i in range(600):
            log.append(make_batch(2, b"t" * 30), now_ms=i)
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert durable == sorted(durable)
    assert log.flush() == log.end_offset == 1200
    assert log.durable_offset == 1200
    assert len(log.segments()) > 10
    log.close()
    _reopened, report = open_log(config, clean=False)
    assert report.end_offset == 1200
    assert report.truncated_bytes == 0
