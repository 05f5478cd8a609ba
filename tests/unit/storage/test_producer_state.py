"""Idempotent producer rules, and their survival across clean and unclean reopen."""

from __future__ import annotations

import pytest
from storage_support import BatchFactory, LogOpener

from ferrymq.errors import OutOfOrderSequenceError, ProducerFencedError
from ferrymq.storage import LogConfig

SMALL = LogConfig(segment_bytes=400, index_interval_bytes=64)
PID = 7


def test_duplicate_returns_original_result_and_writes_nothing(
    open_log: LogOpener, make_batch: BatchFactory
) -> None:
    log, _ = open_log(SMALL)
    log.append(make_batch(1), now_ms=1)
    first = log.append(make_batch(3, pid=PID, epoch=0, seq=0), now_ms=100)
    second = log.append(make_batch(2, pid=PID, epoch=0, seq=3), now_ms=200)
    end, size = log.end_offset, log.size_bytes
    dup = log.append(make_batch(3, pid=PID, epoch=0, seq=0), now_ms=300)
    assert dup.duplicate
    assert (dup.base_offset, dup.last_offset, dup.append_time_ms) == (1, 3, 100)
    dup2 = log.append(make_batch(2, pid=PID, epoch=0, seq=3), now_ms=300)
    assert (dup2.base_offset, dup2.last_offset, dup2.duplicate) == (
        second.base_offset,
        second.last_offset,
        True,
    )
    assert (log.end_offset, log.size_bytes) == (end, size)
    assert not first.duplicate


def test_only_the_last_five_batches_are_remembered(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    for seq in range(6):
        log.append(make_batch(1, pid=PID, epoch=0, seq=seq), now_ms=0)
    assert log.append(make_batch(1, pid=PID, epoch=0, seq=1), now_ms=0).duplicate
    with pytest.raises(OutOfOrderSequenceError):
        log.append(make_batch(1, pid=PID, epoch=0, seq=0), now_ms=0)


def test_gap_is_out_of_order_with_expected_and_got(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    log.append(make_batch(2, pid=PID, epoch=0, seq=0), now_ms=0)
    end = log.end_offset
    with pytest.raises(OutOfOrderSequenceError, match="expected sequence 2, got 3"):
        log.append(make_batch(1, pid=PID, epoch=0, seq=3), now_ms=0)
    assert log.end_offset == end
    assert not log.append(make_batch(1, pid=PID, epoch=0, seq=2), now_ms=0).duplicate


def test_epochs_fence_and_restart_sequences(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    log.append(make_batch(2, pid=PID, epoch=3, seq=0), now_ms=0)
    with pytest.raises(ProducerFencedError):
        log.append(make_batch(1, pid=PID, epoch=2, seq=2), now_ms=0)
    with pytest.raises(OutOfOrderSequenceError, match="expected sequence 0"):
        log.append(make_batch(1, pid=PID, epoch=4, seq=2), now_ms=0)
    log.append(make_batch(1, pid=PID, epoch=4, seq=0), now_ms=0)
    with pytest.raises(ProducerFencedError):
        log.append(make_batch(1, pid=PID, epoch=3, seq=2), now_ms=0)
    log.append(make_batch(1, pid=PID, epoch=4, seq=1), now_ms=0)


def test_unknown_producer_starts_anywhere_and_no_checks_without_id(
    open_log: LogOpener, make_batch: BatchFactory
) -> None:
    log, _ = open_log(SMALL)
    assert not log.append(make_batch(1, pid=9, epoch=0, seq=41), now_ms=0).duplicate
    log.append(make_batch(1, pid=9, epoch=0, seq=42), now_ms=0)
    for _ in range(3):
        assert not log.append(make_batch(1), now_ms=0).duplicate


@pytest.mark.parametrize("clean", [True, False])
def test_state_survives_reopen(open_log: LogOpener, make_batch: BatchFactory, clean: bool) -> None:
    log, _ = open_log(SMALL)
    results = []
    for seq in range(0, 40, 2):  # rolls several segments: snapshots are taken at rolls
        results.append(log.append(make_batch(2, pid=PID, epoch=1, seq=seq), now_ms=seq))
    assert len(log.segments()) > 2
    if clean:
        log.close()
    else:
        log.flush()  # kill -9 after this: no close, no final snapshot
    reopened, _ = open_log(SMALL, clean=clean, now_ms=50)
    dup = reopened.append(make_batch(2, pid=PID, epoch=1, seq=38), now_ms=60)
    assert dup.duplicate
    assert dup.base_offset == results[-1].base_offset
    with pytest.raises(OutOfOrderSequenceError):
        reopened.append(make_batch(1, pid=PID, epoch=1, seq=41), now_ms=60)
    with pytest.raises(ProducerFencedError):
        reopened.append(make_batch(1, pid=PID, epoch=0, seq=40), now_ms=60)
    assert not reopened.append(make_batch(1, pid=PID, epoch=1, seq=40), now_ms=60).duplicate


def test_state_survives_reopen_without_snapshots(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    for seq in range(0, 20, 2):
        log.append(make_batch(2, pid=PID, epoch=1, seq=seq), now_ms=0)
    log.close()
    for snap in log.directory.glob("*.snapshot"):
        snap.write_bytes(b"garbage")
    reopened, _ = open_log(SMALL, clean=True)
    assert reopened.append(make_batch(2, pid=PID, epoch=1, seq=18), now_ms=0).duplicate
    with pytest.raises(OutOfOrderSequenceError):
        reopened.append(make_batch(1, pid=PID, epoch=1, seq=21), now_ms=0)


def test_idle_producers_expire(open_log: LogOpener, make_batch: BatchFactory) -> None:
    config = LogConfig(producer_id_expiry_ms=1000)
    log, _ = open_log(config)
    log.append(make_batch(1, pid=PID, epoch=0, seq=0), now_ms=0)
    log.delete_old_segments(now_ms=500)
    with pytest.raises(OutOfOrderSequenceError):
        log.append(make_batch(1, pid=PID, epoch=0, seq=5), now_ms=500)
    log.delete_old_segments(now_ms=2000)
    assert not log.append(make_batch(1, pid=PID, epoch=0, seq=5), now_ms=2000).duplicate


def test_truncate_rolls_back_producer_state(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    for seq in range(10):
        log.append(make_batch(1, pid=PID, epoch=0, seq=seq), now_ms=0)
    log.truncate_to(5)
    assert log.end_offset == 5
    with pytest.raises(OutOfOrderSequenceError, match="expected sequence 5"):
        log.append(make_batch(1, pid=PID, epoch=0, seq=9), now_ms=0)
    assert log.append(make_batch(1, pid=PID, epoch=0, seq=5), now_ms=0).base_offset == 5
