"""Log.flush_begin / flush_end: a flush that is one fsync, run by a caller with other logs'."""

from __future__ import annotations

import os
import threading

import pytest
from storage_support import BatchFactory, LogOpener

from ferrymq.errors import LogClosedError
from ferrymq.storage import LogConfig


def test_plain_flush_gives_the_active_descriptor_and_holds_the_flush_lock(
        open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log()
    log.flush()  # a new log's first flush also names its segment in the directory
    log.append(make_batch(2), now_ms=1)
    target = log.flush_begin()
    assert target is not None
    fd, end = target
    assert end == 2 and log.durable_offset == 0
    other = threading.Thread(target=log.flush)  # another flush waits for flush_end
    other.start()
    other.join(0.2)
    assert other.is_alive()
    os.fsync(fd)
    log.flush_end(end, True)
    other.join(10)
    assert not other.is_alive()
    assert log.durable_offset == 2


def test_a_failed_fsync_makes_nothing_durable(open_log: LogOpener,
                                              make_batch: BatchFactory) -> None:
    log, _ = open_log()
    log.flush()  # a new log's first flush also names its segment in the directory
    log.append(make_batch(1), now_ms=1)
    target = log.flush_begin()
    assert target is not None
    log.flush_end(target[1], False)
    assert log.durable_offset == 0
    assert log.flush() == 1  # the lock was released
    assert log.durable_offset == 1


def test_a_new_logs_first_flush_fsyncs_its_directory(open_log: LogOpener,
                                                      make_batch: BatchFactory) -> None:
    log, _ = open_log()
    log.append(make_batch(1), now_ms=1)
    assert log.flush_begin() is None  # not one fsync: the directory too
    assert log.flush() == 1
    log.append(make_batch(1), now_ms=2)
    target = log.flush_begin()
    assert target is not None
    log.flush_end(target[1], True)
    log.close()
    reopened, _ = open_log()  # an existing log's directory names its files already
    reopened.append(make_batch(1), now_ms=3)
    target = reopened.flush_begin()
    assert target is not None
    reopened.flush_end(target[1], True)


def test_after_a_roll_the_flush_is_not_one_fsync(open_log: LogOpener,
                                                 make_batch: BatchFactory) -> None:
    log, _ = open_log(LogConfig(segment_bytes=200))
    for _ in range(5):
        log.append(make_batch(1, b"x" * 80), now_ms=1)
    assert len(log.segments()) > 1
    assert log.flush_begin() is None  # the sealed segment and the directory need fsyncs too
    assert log.flush() == 5  # no lock left held
    target = log.flush_begin()  # now nothing is pending: one fsync again
    assert target is not None
    log.flush_end(target[1], True)


def test_a_closed_log_refuses(open_log: LogOpener) -> None:
    log, _ = open_log()
    log.close()
    with pytest.raises(LogClosedError):
        log.flush_begin()
