"""A follower's log: ``Log.append_replica`` and the leader epoch cache the log owns."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from storage_support import BatchFactory, build_batch

from ferrymq.errors import (
    CorruptRecordError,
    OffsetOutOfRangeError,
    OutOfOrderSequenceError,
    ProducerFencedError,
    UnexpectedAppendOffsetError,
)
from ferrymq.protocol.markers import encode_marker
from ferrymq.protocol.records import (
    ATTR_TRANSACTIONAL,
    RecordInput,
    encode_batch,
    iter_batches,
    restamp_producer,
    stamp_batch,
)
from ferrymq.storage import Log, LogConfig
from ferrymq.storage.files import LEADER_EPOCHS_FILE

SMALL = LogConfig(segment_bytes=600, index_interval_bytes=64)
PID = 11


class Pair:
    """A leader log and a follower log in two directories, closed at teardown."""

    def __init__(self, root: Path, config: LogConfig) -> None:
        self.root = root
        self.config = config
        self.leader = self.open("leader")
        self.follower = self.open("follower")

    def open(self, name: str, *, clean: bool = True) -> Log:
        log, _ = Log.open(self.root / name, self.config, clean_shutdown=clean, now_ms=0)
        return log

    def reopen_follower(self, *, clean: bool = True) -> Log:
        self.follower.close()
        self.follower = self.open("follower", clean=clean)
        return self.follower

    def copy(self, upto: int | None = None) -> int:
        """The follower copies the leader's batches from its end; returns how many."""
        n = 0
        end = self.leader.end_offset if upto is None else upto
        while self.follower.end_offset < end:
            data = self.leader.read(self.follower.end_offset, 1 << 20)
            for pos, h in iter_batches(data):
                if h.base_offset >= end:
                    break
                result = self.follower.append_replica(data[pos : pos + h.size])
                assert (result.base_offset, result.last_offset) == (h.base_offset, h.last_offset)
                assert (result.append_time_ms, result.duplicate) == (h.append_time_ms, False)
                n += 1
        return n

    def close(self) -> None:
        self.leader.close()
        self.follower.close()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path, SMALL)
    yield p
    p.close()


def _all_bytes(log: Log) -> bytes:
    out = b""
    offset = log.start_offset
    while offset < log.end_offset:
        data = log.read(offset, 1 << 20)
        out += data
        *_, (_pos, last) = iter_batches(data)
        offset = last.last_offset + 1
    return out


def _txn_batch(seq: int, *, epoch: int = 0) -> bytearray:
    records = [RecordInput(b"t%d" % seq, 0)]
    return encode_batch(records, producer_id=PID, producer_epoch=epoch, base_sequence=seq,
                        attributes=ATTR_TRANSACTIONAL)


def _marker(commit: bool, *, epoch: int = 0) -> bytes:
    return encode_marker(producer_id=PID, producer_epoch=epoch, commit=commit,
                         transactional_id="tid", coordinator_offset=0, timestamp_ms=0)


# --- append_replica -----------------------------------------------------------------------------


def test_a_follower_stores_the_leaders_bytes_offsets_and_times(
    pair: Pair, make_batch: BatchFactory
) -> None:
    for i in range(12):
        pair.leader.append(make_batch(1 + i % 3, b"x" * 30), now_ms=1000 + 7 * i)
    assert pair.copy() == 12
    assert pair.follower.end_offset == pair.leader.end_offset
    assert _all_bytes(pair.follower) == _all_bytes(pair.leader)
    assert len(pair.follower.segments()) > 1  # it rolled like any log
    reopened = pair.reopen_follower(clean=False)
    assert _all_bytes(reopened) == _all_bytes(pair.leader)  # and recovery accepts the copy


def test_a_follower_rolls_by_the_leaders_append_times(tmp_path: Path) -> None:
    p = Pair(tmp_path, LogConfig(segment_ms=50, index_interval_bytes=64))
    try:
        for t in (0, 10, 100, 120, 400, 401, 402):
            p.leader.append(build_batch(2), now_ms=t)
        p.copy()
        assert p.follower.segments() == p.leader.segments()
    finally:
        p.close()


@pytest.mark.parametrize("where", ["gap", "overlap"])
def test_a_batch_not_at_the_end_is_refused_and_nothing_written(
    pair: Pair, make_batch: BatchFactory, where: str
) -> None:
    for _ in range(3):
        pair.leader.append(make_batch(2), now_ms=5)
    pair.copy(upto=2)
    batches = list(iter_batches(pair.leader.read(0, 1 << 20)))
    data = pair.leader.read(0, 1 << 20)
    pos, h = batches[2] if where == "gap" else batches[0]
    size = pair.follower.size_bytes
    with pytest.raises(UnexpectedAppendOffsetError, match="follower") as exc:
        pair.follower.append_replica(data[pos : pos + h.size])
    assert (exc.value.base_offset, exc.value.end_offset) == (h.base_offset, 2)
    assert "starts at offset" in str(exc.value)
    assert (pair.follower.end_offset, pair.follower.size_bytes) == (2, size)


def test_a_damaged_or_partial_batch_is_refused_and_nothing_written(
    pair: Pair, make_batch: BatchFactory
) -> None:
    pair.leader.append(make_batch(2, b"body"), now_ms=5)
    pair.leader.append(make_batch(1), now_ms=6)
    data = pair.leader.read(0, 1 << 20)
    (_, first), _second = iter_batches(data)
    flipped = bytearray(data[: first.size])
    flipped[-1] ^= 1
    restamped = bytearray(data[: first.size])
    restamped[12] ^= 1  # the append time, without fixing the header CRC
    for bad, says in [(flipped, "batch CRC mismatch"), (restamped, "header CRC mismatch"),
                      (data, "holds a"), (data[: first.size - 1], "truncated")]:
        with pytest.raises(CorruptRecordError, match=says):
            pair.follower.append_replica(bad)
        assert (pair.follower.end_offset, pair.follower.size_bytes) == (0, 0)


# --- producer state ---------------------------------------------------------------------------


def _idempotent(seq: int, count: int = 2, *, epoch: int = 1) -> bytearray:
    return build_batch(count, b"p%d-" % seq, pid=PID, epoch=epoch, seq=seq)


@pytest.mark.parametrize("reopen", [False, True])
def test_a_follower_turned_leader_recognises_a_retry_of_a_copied_batch(
    pair: Pair, reopen: bool
) -> None:
    """Exactly-once across a failover: the new leader answers a retried batch with the
    original offsets and stores nothing."""
    sent = [_idempotent(seq) for seq in (0, 2, 4)]
    originals = [pair.leader.append(b, now_ms=100 + i) for i, b in enumerate(sent)]
    pair.copy()
    follower = pair.reopen_follower(clean=False) if reopen else pair.follower
    end = follower.end_offset
    for batch, original in zip(sent, originals, strict=True):
        again = follower.append(batch, now_ms=500)  # the producer retries at the new leader
        assert again.duplicate
        assert (again.base_offset, again.last_offset, again.append_time_ms) == (
            original.base_offset, original.last_offset, original.append_time_ms)
    assert follower.end_offset == end
    with pytest.raises(OutOfOrderSequenceError, match="expected sequence 6, got 8"):
        follower.append(_idempotent(8), now_ms=500)
    with pytest.raises(ProducerFencedError):
        follower.append(_idempotent(6, epoch=0), now_ms=500)
    nxt = follower.append(_idempotent(6), now_ms=500)
    assert (nxt.base_offset, nxt.duplicate) == (end, False)
    assert follower.producer_state.entries[PID].last_seq == 7


def test_a_replica_copy_is_not_checked_against_producer_state(pair: Pair) -> None:
    """What the leader stored the follower stores, unchecked (the leader checked; e.g. the
    leader had expired a producer the follower still knew): an older epoch, a sequence gap and
    a repeated sequence are all stored, and the state follows them as a replay would."""
    pair.leader.append(_idempotent(0, epoch=3), now_ms=1)
    pair.copy()
    for i, batch in enumerate([_idempotent(0, epoch=1), _idempotent(9, epoch=1),
                               _idempotent(9, epoch=1)]):
        stamp_batch(batch, 0, pair.follower.end_offset, 2 + i)
        result = pair.follower.append_replica(batch)
        assert not result.duplicate
    entry = pair.follower.producer_state.entries[PID]
    assert (entry.epoch, entry.last_seq) == (1, 10)
    assert pair.follower.end_offset == 8


def test_transactions_copied_to_a_follower(pair: Pair) -> None:
    leader = pair.leader
    leader.append(_txn_batch(0), now_ms=1)
    leader.append(_txn_batch(1), now_ms=2)
    leader.append(_marker(False), now_ms=3)  # abort
    leader.append(_txn_batch(2), now_ms=4)
    leader.append(_marker(True), now_ms=5)  # commit
    leader.append(_txn_batch(3), now_ms=6)  # open
    pair.copy()
    for log in (pair.follower, pair.reopen_follower(clean=False)):
        assert log.aborted_txns(0, log.end_offset) == leader.aborted_txns(0, leader.end_offset)
        assert log.aborted_txns(0, log.end_offset) == [(PID, 0)]
        assert log.ongoing_txns() == leader.ongoing_txns() == {PID: 5}
        assert log.has_control(0, log.end_offset)


def test_a_control_batch_without_a_producer_is_refused(pair: Pair) -> None:
    marker = bytearray(_marker(True))
    restamp_producer(marker, -1, -1, -1)
    stamp_batch(marker, 0, 0, 1)
    with pytest.raises(CorruptRecordError, match="needs a producer id"):
        pair.follower.append_replica(marker)
    assert pair.follower.end_offset == 0


# --- the epoch cache the log owns -------------------------------------------------------------


def test_truncate_to_cuts_the_epoch_cache(pair: Pair, make_batch: BatchFactory) -> None:
    log = pair.leader
    log.epochs.assign(1, 0)
    for _ in range(3):
        log.append(make_batch(2), now_ms=1)
    log.epochs.assign(2, 6)
    for _ in range(3):
        log.append(make_batch(2), now_ms=1)
    log.epochs.assign(4, 12)
    log.truncate_to(20)  # past the end: batches stay, the epoch that wrote nothing goes
    assert log.end_offset == 12
    assert log.epochs.entries() == [(1, 0), (2, 6)]
    log.truncate_to(7)  # inside a batch: the batch goes, so does the epoch starting at 6
    assert log.end_offset == 6
    assert log.epochs.entries() == [(1, 0)]
    log.close()
    assert pair.open("leader").epochs.entries() == [(1, 0)]


def test_retention_moves_the_first_epoch_up(tmp_path: Path, make_batch: BatchFactory) -> None:
    log, _ = Log.open(tmp_path, LogConfig(segment_bytes=300, retention_ms=10), clean_shutdown=True,
                      now_ms=0)
    log.epochs.assign(0, 0)
    for i in range(20):
        if i == 10:
            log.epochs.assign(3, log.end_offset)
        log.append(make_batch(1, b"r" * 40), now_ms=i)
    assert log.delete_old_segments(now_ms=10_000) > 0
    start = log.start_offset
    assert start > 10
    assert log.epochs.entries() == [(3, start)]
    log.close()


def _log_of_epoch_zero(directory: Path, make_batch: BatchFactory) -> Log:
    """A log whose 3 offsets epoch 0 wrote, flushed."""
    log, _ = Log.open(directory, SMALL, clean_shutdown=True, now_ms=0)
    log.epochs.assign(0, 0)
    log.append(make_batch(3), now_ms=1)
    log.flush()
    return log


def test_open_cuts_a_cache_left_ahead_of_the_log(tmp_path: Path, make_batch: BatchFactory) -> None:
    """A power loss: the epoch file was fsynced, the batches it describes were not."""
    log = _log_of_epoch_zero(tmp_path, make_batch)
    segment = tmp_path / f"{0:020d}.log"
    durable = segment.stat().st_size
    log.epochs.assign(1, 3)
    log.append(make_batch(2), now_ms=2)
    log.epochs.assign(2, 5)
    log.append(make_batch(2), now_ms=3)
    for seg in log._segments:  # the machine stops: no flush, no close
        seg.close()
    with segment.open("r+b") as f:
        f.truncate(durable)  # what the disk had
    log, _ = Log.open(tmp_path, SMALL, clean_shutdown=False, now_ms=0)
    assert log.end_offset == 3
    assert log.epochs.entries() == [(0, 0)]
    assert log.epochs.end_offset_for(2, log.end_offset) == (0, 3)
    log.close()


def test_open_refuses_an_unreadable_epoch_file(tmp_path: Path, make_batch: BatchFactory) -> None:
    _log_of_epoch_zero(tmp_path, make_batch).close()
    path = tmp_path / LEADER_EPOCHS_FILE
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CorruptRecordError, match=LEADER_EPOCHS_FILE):
        Log.open(tmp_path, SMALL, clean_shutdown=True, now_ms=0)
    path.unlink()  # what the operator may do: the data then has no known epoch
    log, _ = Log.open(tmp_path, SMALL, clean_shutdown=True, now_ms=0)
    assert (log.end_offset, log.epochs.entries(), log.epochs.epoch_at(0)) == (3, [], -1)
    log.close()


def test_a_log_without_replication_writes_no_epoch_file(
    pair: Pair, make_batch: BatchFactory
) -> None:
    pair.leader.append(make_batch(2), now_ms=1)
    pair.leader.truncate_to(1)
    pair.leader.delete_old_segments(now_ms=1)
    assert not (pair.leader.directory / LEADER_EPOCHS_FILE).exists()


@pytest.mark.parametrize("clean", [True, False])
def test_a_follower_starts_again_where_the_leaders_log_starts(
    pair: Pair, make_batch: BatchFactory, clean: bool
) -> None:
    """The leader's retention removed what the follower still needs: the follower's log is
    emptied and starts at the leader's start offset."""
    follower = pair.follower
    follower.epochs.assign(0, 0)
    follower.append_replica(_stamped(make_batch(2), 0))
    follower.append_replica(_stamped(_idempotent(0), 2))
    follower.close()  # a producer snapshot at 4
    follower = pair.follower = pair.open("follower")
    assert list(follower.directory.glob("*.snapshot"))
    follower.truncate_fully_and_start_at(50)
    assert (follower.start_offset, follower.end_offset, follower.durable_offset) == (50, 50, 50)
    assert follower.epochs.entries() == []
    assert follower.producer_state.entries == {}
    assert follower.read(50, 100) == b""
    assert [p.name for p in sorted(follower.directory.iterdir())] == [
        f"{50:020d}.log", LEADER_EPOCHS_FILE, "recovery-point.checkpoint"]
    follower.epochs.assign(3, 50)
    follower.append_replica(_stamped(make_batch(1), 50))
    if clean:
        follower = pair.reopen_follower()
    else:
        for seg in follower._segments:
            seg.close()
        follower = pair.follower = pair.open("follower", clean=False)
    assert (follower.start_offset, follower.end_offset) == (50, 51)
    assert follower.epochs.entries() == [(3, 50)]
    with pytest.raises(OffsetOutOfRangeError):
        follower.truncate_fully_and_start_at(-1)


def _stamped(batch: bytearray, offset: int) -> bytearray:
    stamp_batch(batch, 0, offset, 7)
    return batch
