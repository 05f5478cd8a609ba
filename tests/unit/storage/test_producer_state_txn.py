"""Producer state and transactions: open transactions, control batches, expiry, snapshot v2."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from storage_support import BatchFactory, LogOpener

from ferrymq.errors import OutOfOrderSequenceError, ProducerFencedError
from ferrymq.protocol.markers import encode_marker
from ferrymq.protocol.records import ATTR_TRANSACTIONAL, RecordInput, encode_batch
from ferrymq.storage import Log, LogConfig
from ferrymq.storage.checkpoint import write_checkpoint
from ferrymq.storage.producer_state import NO_TXN, ProducerStateManager

SMALL = LogConfig(segment_bytes=400, index_interval_bytes=64)
PID = 7


def txn_batch(count: int = 1, *, pid: int = PID, epoch: int = 0, seq: int = 0, ts: int = 0) -> bytearray:
    """A transactional data batch."""
    records = [RecordInput(b"t" + str(i).encode(), ts) for i in range(count)]
    return encode_batch(records, producer_id=pid, producer_epoch=epoch, base_sequence=seq,
                        attributes=ATTR_TRANSACTIONAL)


def marker(commit: bool, *, pid: int = PID, epoch: int = 0) -> bytes:
    return encode_marker(producer_id=pid, producer_epoch=epoch, commit=commit,
                         transactional_id="tid", coordinator_offset=0, timestamp_ms=0)


def crash(log: Log) -> None:
    """kill -9: the descriptors vanish, nothing is flushed, closed or snapshotted."""
    for seg in log._segments:
        seg.close()
    log._closed = True


def test_first_transactional_batch_opens_and_marker_closes(
    open_log: LogOpener, make_batch: BatchFactory
) -> None:
    log, _ = open_log(SMALL)
    log.append(make_batch(2), now_ms=0)  # 0-1, not idempotent
    log.append(make_batch(1, pid=PID, epoch=0, seq=0), now_ms=0)  # 2: idempotent, not txn
    assert log.ongoing_txns() == {}
    assert log.append(txn_batch(2, seq=1), now_ms=0).base_offset == 3
    log.append(txn_batch(1, seq=3), now_ms=0)  # 5: same transaction
    log.append(txn_batch(1, pid=8, seq=0), now_ms=0)  # 6: another producer
    assert log.ongoing_txns() == {PID: 3, 8: 6}
    entry = log.producer_state.entries[PID]
    assert entry.txn_first_offset == 3
    assert log.append(marker(True), now_ms=0).base_offset == 7
    assert log.ongoing_txns() == {8: 6}
    assert log.producer_state.entries[PID].txn_first_offset == NO_TXN
    ongoing = log.ongoing_txns()
    ongoing.clear()  # a copy
    assert log.ongoing_txns() == {8: 6}
    log.append(txn_batch(1, seq=4), now_ms=0)  # 8: the next transaction of PID
    assert log.ongoing_txns() == {8: 6, PID: 8}


def test_marker_skips_sequence_checks_and_sequences_continue(open_log: LogOpener) -> None:
    log, _ = open_log(SMALL)
    log.append(txn_batch(3, seq=0), now_ms=0)
    assert not log.append(marker(False), now_ms=0).duplicate
    assert not log.append(marker(False), now_ms=0).duplicate  # a second marker: no txn, no check
    with pytest.raises(OutOfOrderSequenceError, match="expected sequence 3, got 0"):
        log.append(txn_batch(1, seq=0), now_ms=0)
    log.append(txn_batch(1, seq=3), now_ms=0)
    assert log.append(txn_batch(1, seq=3), now_ms=0).duplicate  # retries still deduplicated


def test_marker_with_newer_epoch_replaces_the_entry(open_log: LogOpener) -> None:
    log, _ = open_log(SMALL)
    log.append(txn_batch(2, epoch=0, seq=0), now_ms=0)
    log.append(marker(False, epoch=1), now_ms=0)  # fenced by INIT_TXN: abort at the new epoch
    entry = log.producer_state.entries[PID]
    assert (entry.epoch, len(entry.batches), entry.txn_first_offset) == (1, 0, NO_TXN)
    with pytest.raises(ProducerFencedError):  # the zombie's late batch
        log.append(txn_batch(1, epoch=0, seq=2), now_ms=0)
    with pytest.raises(ProducerFencedError):
        log.append(marker(True, epoch=0), now_ms=0)
    with pytest.raises(OutOfOrderSequenceError, match="expected sequence 0, got 5"):
        log.append(txn_batch(1, epoch=1, seq=5), now_ms=0)
    log.append(txn_batch(1, epoch=1, seq=0), now_ms=0)
    assert log.ongoing_txns() == {PID: 3}


def test_data_batch_of_newer_epoch_keeps_the_open_transaction(open_log: LogOpener) -> None:
    log, _ = open_log(SMALL)
    log.append(txn_batch(1, epoch=0, seq=0), now_ms=0)
    log.append(txn_batch(1, epoch=1, seq=0), now_ms=0)
    assert log.ongoing_txns() == {PID: 0}  # only a marker ends a transaction


def test_producers_with_open_transactions_never_expire(tmp_path: Path) -> None:
    log, _ = Log.open(tmp_path, LogConfig(producer_id_expiry_ms=1000), clean_shutdown=True, now_ms=0)
    log.append(txn_batch(1, pid=1), now_ms=10)
    log.append(encode_batch([RecordInput(b"x", 0)], producer_id=2, producer_epoch=0, base_sequence=0),
               now_ms=10)
    state = log.producer_state
    assert state.remove_expired(now_ms=10_000) == 1
    assert set(state.entries) == {1}
    assert log.ongoing_txns() == {1: 0}
    log.append(marker(False, pid=1), now_ms=20)
    assert state.remove_expired(now_ms=10_000) == 1
    assert state.entries == {}
    log.close()


@pytest.mark.parametrize("clean", [True, False])
def test_ongoing_survives_reopen(open_log: LogOpener, make_batch: BatchFactory, clean: bool) -> None:
    log, _ = open_log(SMALL)
    for i in range(6):  # rolls segments: snapshots (v2) at each roll
        log.append(txn_batch(1, pid=1, seq=i), now_ms=0)
        log.append(make_batch(3), now_ms=0)
    log.append(txn_batch(1, pid=2, seq=0), now_ms=0)
    log.append(marker(True, pid=2), now_ms=0)
    log.append(txn_batch(1, pid=3, seq=0), now_ms=0)
    assert len(log.segments()) > 2
    expected = log.ongoing_txns()
    assert expected == {1: 0, 3: log.end_offset - 1}
    if clean:
        log.close()
    else:
        log.flush()
        crash(log)
    reopened, _ = open_log(SMALL, clean=clean)
    assert reopened.ongoing_txns() == expected
    with pytest.raises(OutOfOrderSequenceError):
        reopened.append(txn_batch(1, pid=1, seq=0), now_ms=0)
    reopened.append(txn_batch(1, pid=1, seq=6), now_ms=0)


def test_snapshot_v2_round_trip(tmp_path: Path) -> None:
    state = ProducerStateManager(tmp_path, producer_id_expiry_ms=1000)
    log, _ = Log.open(tmp_path / "q", LogConfig(), clean_shutdown=True, now_ms=0)
    log.append(txn_batch(2, pid=1, seq=0), now_ms=5)
    log.append(txn_batch(1, pid=2, seq=0), now_ms=5)
    log.append(marker(False, pid=2), now_ms=5)
    log.producer_state.take_snapshot(log.end_offset)
    payload = msgpack.unpackb(_checkpoint_payload(tmp_path / "q" / "00000000000000000004.snapshot"))
    assert payload["version"] == 2
    assert sorted(row[:4] for row in payload["producers"]) == [[1, 0, 5, 0], [2, 0, 5, -1]]
    state = ProducerStateManager(tmp_path / "q", producer_id_expiry_ms=1000)
    assert state.load_snapshot(4) == 4
    assert state.ongoing == {1: 0}
    assert state.entries[1].last_seq == 1
    assert state.entries[2].txn_first_offset == NO_TXN
    log.close()


def test_version_1_snapshot_still_loads(tmp_path: Path) -> None:
    v1 = {"version": 1, "producers": [[9, 2, 77, [[0, 4, 10, 14, 77], [5, 5, 15, 15, 78]]]]}
    write_checkpoint(tmp_path / "00000000000000000016.snapshot", msgpack.packb(v1))
    state = ProducerStateManager(tmp_path, producer_id_expiry_ms=1000)
    assert state.load_snapshot(100) == 16
    entry = state.entries[9]
    assert (entry.epoch, entry.last_append_time_ms, entry.last_seq) == (2, 77, 5)
    assert entry.txn_first_offset == NO_TXN
    assert state.ongoing == {}


def test_unknown_snapshot_version_is_skipped(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "00000000000000000016.snapshot",
                     msgpack.packb({"version": 3, "producers": []}))
    state = ProducerStateManager(tmp_path, producer_id_expiry_ms=1000)
    assert state.load_snapshot(100) == -1


def test_snapshot_retention_keeps_the_one_at_the_recovery_base(tmp_path: Path) -> None:
    state = ProducerStateManager(tmp_path, producer_id_expiry_ms=1000)
    for offset in (10, 20, 30, 40):
        state.take_snapshot(offset, keep_at_or_below=25)
    assert state.snapshot_offsets() == [20, 30, 40]
    state.take_snapshot(50)
    assert state.snapshot_offsets() == [40, 50]


def _checkpoint_payload(path: Path) -> bytes:
    from ferrymq.storage.checkpoint import read_checkpoint

    payload = read_checkpoint(path)
    assert payload is not None
    return payload
