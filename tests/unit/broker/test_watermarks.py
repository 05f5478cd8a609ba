"""Watermarks decide from samples; errors carry the retry-after; producers wait for it."""

from __future__ import annotations

import errno
import random
from pathlib import Path

import pytest

from ferrymq.broker.watermarks import DISK_FULL_PROBE_S, Watermarks, is_disk_full
from ferrymq.client.retry import Backoff, refused_before_effect, retry_after_s
from ferrymq.errors import (
    BusyError,
    StorageFailureError,
    StorageFullError,
    error_for_code,
)
from ferrymq.protocol.codes import ErrorCode

MiB = 1024 * 1024


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _marks(tmp_path: Path, *, memory: int = -1, disk: int = 0) -> tuple[Watermarks, Path, _Clock]:
    statm = tmp_path / "statm"
    statm.write_text("1000 10 0 0 0 0 0\n")
    clock = _Clock()
    w = Watermarks(tmp_path, memory_high_bytes=memory, disk_free_low_bytes=disk,
                   disk_check_interval_s=1.0, retry_after_ms=250, clock=clock,
                   statm_path=str(statm))
    return w, statm, clock


def test_memory_watermark_refuses_with_busy_and_clears(tmp_path: Path) -> None:
    w, statm, _ = _marks(tmp_path, memory=1 * MiB)
    w.sample()
    w.check_produce()  # 10 pages: below
    statm.write_text(f"1000 {4 * MiB // w._page_size} 0 0 0 0 0\n")
    w.check_produce()  # not sampled yet: the produce path never reads the file
    w.sample()
    with pytest.raises(BusyError, match="memory_high_watermark_bytes=1048576") as info:
        w.check_produce()
    assert info.value.retry_after_ms == 250 and w.refused == 1
    statm.write_text("1000 10 0 0 0 0 0\n")
    w.sample()
    w.check_produce()


def test_memory_watermark_off_and_auto(tmp_path: Path) -> None:
    off, _, _ = _marks(tmp_path, memory=-1)
    assert off.memory_high_bytes == 0
    auto, _, _ = _marks(tmp_path, memory=0)
    assert auto.memory_high_bytes > 0


def test_disk_watermark_sampled_at_its_interval(tmp_path: Path) -> None:
    w, _, clock = _marks(tmp_path, disk=1 << 62)  # more than any disk has free
    w.sample()
    with pytest.raises(StorageFullError, match="disk_free_low_watermark_bytes"):
        w.check_produce()
    w.free_bytes = 1 << 63  # a stale sample that would clear it
    clock.now += 0.5
    w.sample()  # statvfs not due: the stale sample stands
    w.check_produce()
    clock.now += 0.6
    w.sample()  # sampled again
    with pytest.raises(StorageFullError):
        w.check_produce()


def test_enospc_refuses_until_space_grows_or_the_probe(tmp_path: Path) -> None:
    w, _, clock = _marks(tmp_path)
    exc = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(exc) and not is_disk_full(OSError(errno.EIO, "EIO"))
    err = w.full_error(exc)
    assert isinstance(err, StorageFullError) and err.retry_after_ms == 250
    clock.now += 2
    w.sample()  # free space did not grow by DISK_FULL_RESUME_BYTES
    with pytest.raises(StorageFullError, match="ENOSPC"):
        w.check_produce()
    clock.now += DISK_FULL_PROBE_S
    w.sample()
    w.check_produce()


def test_retry_after_travels_in_the_message() -> None:
    err = BusyError("produce refused: memory", retry_after_ms=300)
    assert str(err).endswith("(retry_after_ms=300)")
    back = error_for_code(ErrorCode.BUSY, str(err))
    assert isinstance(back, BusyError) and back.retry_after_ms == 300
    assert refused_before_effect(back) and retry_after_s(back) == 0.3
    plain = error_for_code(ErrorCode.STORAGE_ERROR, "write failed (retry_after_ms=x)")
    assert isinstance(plain, StorageFailureError) and plain.retry_after_ms == 0
    assert not refused_before_effect(plain)
    assert not refused_before_effect(BusyError("too many pending"))


def test_backoff_waits_at_least_the_retry_after() -> None:
    b = Backoff(base_s=0.01, cap_s=0.05, rng=random.Random(7))
    err = StorageFullError("full", retry_after_ms=500)
    for attempt in range(1, 6):
        assert 0.5 <= b.delay_after(err, attempt) <= 0.55
    assert b.delay_after(OSError(), 1) <= 0.05
