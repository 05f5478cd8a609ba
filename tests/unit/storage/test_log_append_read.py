"""Log append and read: rolls, KIP-74, upto_offset, seek by time, errors."""

from __future__ import annotations

import pytest
from storage_support import BatchFactory, LogOpener

from ferrymq.errors import ConfigError, LogClosedError, OffsetOutOfRangeError
from ferrymq.protocol.records import decode_records, iter_batches
from ferrymq.storage import LogConfig

SMALL = LogConfig(segment_bytes=600, index_interval_bytes=128)


def _bases(data: bytes) -> list[int]:
    return [h.base_offset for _pos, h in iter_batches(data)]


def test_append_assigns_contiguous_offsets_and_stamps(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, report = open_log(SMALL, clean=False)
    assert (report.start_offset, report.end_offset) == (0, 0)
    results = [log.append(make_batch(3), now_ms=1000 + i) for i in range(10)]
    assert [r.base_offset for r in results] == list(range(0, 30, 3))
    assert [r.last_offset for r in results] == list(range(2, 30, 3))
    assert not any(r.duplicate for r in results)
    assert log.end_offset == 30
    records = decode_records(log.read(0, 10**6))
    assert [r.offset for r in records][:3] == [0, 1, 2]


def test_append_time_never_decreases(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    assert log.append(make_batch(), now_ms=5000).append_time_ms == 5000
    assert log.append(make_batch(), now_ms=4000).append_time_ms == 5000
    assert log.append(make_batch(), now_ms=6000).append_time_ms == 6000


def test_read_across_rolls_returns_everything_in_order(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    for i in range(40):
        log.append(make_batch(2, b"b" * (i % 9)), now_ms=i)
    assert len(log.segments()) > 3
    seen: list[int] = []
    offset = 0
    while offset < log.end_offset:
        data = log.read(offset, 200)
        assert data
        recs = decode_records(data)
        seen += [r.offset for r in recs]
        offset = recs[-1].offset + 1
    assert seen == list(range(80))
    assert log.read(80, 100) == b""


def test_read_starts_with_the_batch_containing_offset(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    for _ in range(10):
        log.append(make_batch(5), now_ms=0)
    for offset in range(50):
        assert _bases(log.read(offset, 1))[0] == offset - offset % 5


def test_read_never_exceeds_max_bytes_except_for_one_batch(
    open_log: LogOpener, make_batch: BatchFactory
) -> None:
    log, _ = open_log(LogConfig(segment_bytes=10_000))
    sizes = []
    for i in range(10):
        batch = make_batch(1, b"z" * (i * 30))
        sizes.append(len(batch))
        log.append(batch, now_ms=0)
    # KIP-74: a single batch larger than max_bytes is still returned whole.
    data = log.read(5, 10)
    assert len(data) == sizes[5]
    assert _bases(data) == [5]
    # Otherwise stop before exceeding max_bytes, with whole batches only.
    data = log.read(0, sizes[0] + sizes[1] + sizes[2] - 1)
    assert _bases(data) == [0, 1]
    assert len(data) == sizes[0] + sizes[1]


def test_read_respects_upto_offset(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    for _ in range(6):
        log.append(make_batch(2), now_ms=0)
    assert _bases(log.read(0, 10**6, upto_offset=6)) == [0, 2, 4]
    assert _bases(log.read(0, 10**6, upto_offset=5)) == [0, 2]  # batch 4..5 has last 5 >= 5
    assert log.read(4, 10**6, upto_offset=5) == b""
    assert log.read(6, 10**6, upto_offset=6) == b""


def test_read_out_of_range(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    log.append(make_batch(2), now_ms=0)
    assert log.read(2, 100) == b""
    with pytest.raises(OffsetOutOfRangeError):
        log.read(3, 100)
    with pytest.raises(OffsetOutOfRangeError):
        log.read(-1, 100)


def test_offset_for_time(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    for i in range(30):
        log.append(make_batch(2), now_ms=1000 + 10 * i)
    assert log.offset_for_time(0) == 0
    assert log.offset_for_time(1000) == 0
    assert log.offset_for_time(1001) == 2
    assert log.offset_for_time(1150) == 30
    assert log.offset_for_time(1155) == 32
    assert log.offset_for_time(1290) == 58
    assert log.offset_for_time(1291) == 60
    log.close()
    reopened, _ = open_log(SMALL, clean=True)
    assert reopened.offset_for_time(1155) == 32
    assert reopened.offset_for_time(1291) == 60


def test_segments_describe(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    for i in range(20):
        log.append(make_batch(2), now_ms=i)
    infos = log.segments()
    assert infos[0].base_offset == 0
    assert sum(i.size_bytes for i in infos) == log.size_bytes
    assert all(i.size_bytes <= SMALL.segment_bytes for i in infos)
    assert infos[-1].max_append_time_ms == 19


def test_closed_log_refuses_operations(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    log.close()
    log.close()
    with pytest.raises(LogClosedError):
        log.append(make_batch(), now_ms=0)
    with pytest.raises(LogClosedError):
        log.read(0, 1)
    with pytest.raises(LogClosedError):
        log.flush()


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        LogConfig(segment_bytes=0)
    with pytest.raises(ConfigError):
        LogConfig(retention_ms=-1)


def test_roll_by_age(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(LogConfig(segment_ms=100))
    log.append(make_batch(), now_ms=1000)
    log.append(make_batch(), now_ms=1100)
    assert len(log.segments()) == 1
    log.append(make_batch(), now_ms=1101)
    assert [s.base_offset for s in log.segments()] == [0, 2]
