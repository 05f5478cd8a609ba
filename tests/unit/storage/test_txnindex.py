"""The aborted-transaction index: the file, Log.aborted_txns / has_control, rebuild, deletion."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from storage_support import BatchFactory, LogOpener

from ferrymq.errors import CorruptRecordError
from ferrymq.protocol.markers import encode_marker
from ferrymq.protocol.records import (
    ATTR_CONTROL,
    ATTR_TRANSACTIONAL,
    RecordInput,
    encode_batch,
    encode_properties,
)
from ferrymq.storage import Log, LogConfig
from ferrymq.storage.txnindex import TXN_ENTRY, AbortedTxn, TxnIndex

SMALL = LogConfig(segment_bytes=600, index_interval_bytes=64)


def txn_batch(pid: int, seq: int, count: int = 1, body: bytes = b"t") -> bytearray:
    records = [RecordInput(body * 20, 0) for _ in range(count)]
    return encode_batch(records, producer_id=pid, producer_epoch=0, base_sequence=seq,
                        attributes=ATTR_TRANSACTIONAL)


def marker(pid: int, commit: bool) -> bytes:
    return encode_marker(producer_id=pid, producer_epoch=0, commit=commit, transactional_id=f"t{pid}",
                         coordinator_offset=1, timestamp_ms=0)


def txnindex_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.txnindex"))


def crash(log: Log) -> None:
    """kill -9: descriptors vanish; nothing flushed, closed or snapshotted."""
    for seg in log._segments:
        seg.close()
    log._closed = True


# --- the file ---------------------------------------------------------------------------------


def test_txnindex_append_reload_and_collect(tmp_path: Path) -> None:
    path = tmp_path / "00000000000000000100.txnindex"
    idx = TxnIndex(path, 100, present=False)
    assert not idx.present and idx.entries() == [] and not path.exists()
    assert idx.mark()
    assert not idx.mark()
    assert path.exists() and path.stat().st_size == 0
    idx.append(AbortedTxn(1, 90, 100))
    idx.append(AbortedTxn(2, 101, 120))
    idx.fsync()
    assert path.read_bytes() == TXN_ENTRY.pack(1, 90, 100) + TXN_ENTRY.pack(2, 101, 120)
    again = TxnIndex(path, 100, present=True)
    assert again.entries() == [AbortedTxn(1, 90, 100), AbortedTxn(2, 101, 120)]
    out: list[tuple[int, int]] = []
    again.collect(0, 95, out)
    assert out == [(1, 90)]
    out.clear()
    again.collect(101, 1000, out)
    assert out == [(2, 101)]
    out.clear()
    again.collect(121, 1000, out)
    assert out == []


def test_torn_entry_is_cut_on_load(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "00000000000000000000.txnindex"
    path.write_bytes(TXN_ENTRY.pack(3, 1, 5) + TXN_ENTRY.pack(4, 2, 9)[:13])
    idx = TxnIndex(path, 0, present=True)
    assert idx.entries() == [AbortedTxn(3, 1, 5)]
    assert path.stat().st_size == 24
    assert "torn entry" in caplog.text
    idx.append(AbortedTxn(4, 2, 9))  # appends after the cut, aligned
    assert TxnIndex(path, 0, present=True).entries() == [AbortedTxn(3, 1, 5), AbortedTxn(4, 2, 9)]


def test_impossible_entries_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "00000000000000000010.txnindex"
    path.write_bytes(TXN_ENTRY.pack(1, 20, 15) + TXN_ENTRY.pack(1, 2, 5) + TXN_ENTRY.pack(1, 3, 12))
    assert TxnIndex(path, 10, present=True).entries() == [AbortedTxn(1, 3, 12)]


# --- on a real log ----------------------------------------------------------------------------


def test_plain_log_has_no_txnindex_and_no_control(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    for _ in range(20):
        log.append(make_batch(3, b"x" * 30), now_ms=0)
    log.append(txn_batch(1, 0), now_ms=0)  # open, never ended: still no control batch
    assert len(log.segments()) > 2
    assert not log.has_control(0, log.end_offset)
    assert log.aborted_txns(0, log.end_offset) == []
    assert txnindex_files(log.directory) == []


def test_commit_marker_creates_an_empty_index_and_sets_has_control(open_log: LogOpener) -> None:
    log, _ = open_log(SMALL)
    log.append(txn_batch(1, 0), now_ms=0)  # 0
    m = log.append(marker(1, True), now_ms=0).base_offset  # 1
    assert txnindex_files(log.directory) == ["00000000000000000000.txnindex"]
    assert (log.directory / "00000000000000000000.txnindex").stat().st_size == 0
    assert log.aborted_txns(0, log.end_offset) == []
    assert log.has_control(0, 2) and log.has_control(m, m + 1) and not log.has_control(2, 10)


def test_abort_marker_writes_an_entry(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    log.append(make_batch(1), now_ms=0)  # 0
    log.append(txn_batch(1, 0), now_ms=0)  # 1
    log.append(txn_batch(2, 0), now_ms=0)  # 2
    log.append(txn_batch(1, 1), now_ms=0)  # 3
    log.append(marker(1, False), now_ms=0)  # 4
    log.append(marker(2, True), now_ms=0)  # 5
    log.append(marker(3, False), now_ms=0)  # 6: producer 3 had nothing open: no entry
    log.append(txn_batch(2, 1), now_ms=0)  # 7
    assert log.aborted_txns(0, 8) == [(1, 1)]
    assert log.aborted_txns(4, 8) == [(1, 1)]  # marker inside the range
    assert log.aborted_txns(5, 8) == []  # marker before the range
    assert log.aborted_txns(0, 1) == []  # opened at or after upto
    assert log.aborted_txns(0, 2) == [(1, 1)]
    raw = (log.directory / "00000000000000000000.txnindex").read_bytes()
    assert raw == TXN_ENTRY.pack(1, 1, 4)
    assert log.ongoing_txns() == {2: 7}


def test_entries_live_in_the_segment_of_the_marker(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    log.append(txn_batch(1, 0), now_ms=0)  # the transaction opens in segment 0
    first = 0
    seq = 1
    while len(log.segments()) < 3:
        log.append(make_batch(3, b"x" * 30), now_ms=0)
        log.append(txn_batch(1, seq), now_ms=0)
        seq += 1
    m = log.append(marker(1, False), now_ms=0).base_offset
    marker_segment = log.segments()[-1].base_offset
    assert txnindex_files(log.directory) == [f"{marker_segment:020d}.txnindex"]
    assert log.aborted_txns(0, log.end_offset) == [(1, first)]
    assert log.aborted_txns(m, m + 1) == [(1, first)]
    assert log.aborted_txns(m + 1, m + 5) == []
    # has_control is per segment: the earlier segments say no
    assert not log.has_control(0, marker_segment)
    assert log.has_control(0, marker_segment + 1)


def test_control_batch_checks(open_log: LogOpener) -> None:
    log, _ = open_log(SMALL)
    anon = encode_batch([RecordInput(b"", 0)], attributes=ATTR_TRANSACTIONAL | ATTR_CONTROL)
    with pytest.raises(CorruptRecordError, match="producer id"):
        log.append(anon, now_ms=0)
    junk = encode_batch([RecordInput(b"", 0, properties=encode_properties({"a": "b"}))],
                        producer_id=1, producer_epoch=0, attributes=ATTR_TRANSACTIONAL | ATTR_CONTROL)
    with pytest.raises(CorruptRecordError, match="not a transaction marker"):
        log.append(junk, now_ms=0)
    assert log.end_offset == 0
    assert not log.has_control(0, 1)


@pytest.mark.parametrize("clean", [True, False])
def test_index_and_flag_survive_reopen(open_log: LogOpener, make_batch: BatchFactory, clean: bool) -> None:
    log, _ = open_log(SMALL)
    log.append(txn_batch(1, 0), now_ms=0)
    log.append(marker(1, False), now_ms=0)
    while len(log.segments()) < 3:
        log.append(make_batch(3, b"x" * 30), now_ms=0)
    log.append(txn_batch(2, 0), now_ms=0)
    log.append(marker(2, True), now_ms=0)
    before = (log.aborted_txns(0, log.end_offset), log.segments())
    flags = [log.has_control(s.base_offset, s.base_offset + 1) for s in log.segments()]
    assert flags[0] and flags[-1] and not any(flags[1:-1])
    if clean:
        log.close()
    else:
        log.flush()
        crash(log)
    reopened, _ = open_log(SMALL, clean=clean)
    assert (reopened.aborted_txns(0, reopened.end_offset), reopened.segments()) == before
    assert [reopened.has_control(s.base_offset, s.base_offset + 1) for s in reopened.segments()] == flags


def test_unclean_open_rebuilds_lost_and_stale_indexes(
    open_log: LogOpener, make_batch: BatchFactory, log_dir: Path
) -> None:
    log, _ = open_log(SMALL)
    log.append(txn_batch(1, 0), now_ms=0)  # 0
    log.append(txn_batch(2, 0), now_ms=0)  # 1
    log.append(marker(1, False), now_ms=0)  # 2
    log.append(marker(2, False), now_ms=0)  # 3
    crash(log)  # not even flushed: the active segment is rescanned
    path = log_dir / "00000000000000000000.txnindex"
    path.unlink()  # a power loss lost the file
    reopened, report = open_log(SMALL, clean=False)
    assert report.segments_scanned == 1
    assert reopened.aborted_txns(0, 10) == [(1, 0), (2, 1)]
    assert path.read_bytes() == TXN_ENTRY.pack(1, 0, 2) + TXN_ENTRY.pack(2, 1, 3)
    assert reopened.has_control(0, 1)
    reopened.close()
    # garbage and stale entries are replaced by what the log says
    path.write_bytes(TXN_ENTRY.pack(9, 0, 1) + b"\x01\x02")
    again, _ = open_log(SMALL, clean=False)
    assert again.aborted_txns(0, 10) == [(1, 0), (2, 1)]


def test_unclean_open_after_a_torn_marker(open_log: LogOpener, log_dir: Path) -> None:
    log, _ = open_log(SMALL)
    log.append(txn_batch(1, 0), now_ms=0)
    end = log.size_bytes
    log.append(marker(1, False), now_ms=0)
    assert log.aborted_txns(0, 10) == [(1, 0)]
    crash(log)
    seg = log_dir / "00000000000000000000.log"
    os.truncate(seg, end + 30)  # the marker was torn
    reopened, report = open_log(SMALL, clean=False)
    assert report.truncated_bytes == 30
    assert reopened.end_offset == 1
    assert reopened.aborted_txns(0, 10) == []
    assert not reopened.has_control(0, 10)
    assert not (log_dir / "00000000000000000000.txnindex").exists()
    assert reopened.ongoing_txns() == {1: 0}  # still open: the coordinator will write it again


def test_rebuild_finds_first_offsets_before_the_scanned_segments(
    open_log: LogOpener, make_batch: BatchFactory, log_dir: Path
) -> None:
    """The transaction opened in a segment below the recovery point (not rescanned): its first
    offset comes from the producer snapshot taken at the scanned segment's roll."""
    log, _ = open_log(SMALL)
    log.append(make_batch(1), now_ms=0)  # 0
    log.append(txn_batch(1, 0), now_ms=0)  # 1: opens in segment 0
    while len(log.segments()) < 3:
        log.append(make_batch(3, b"x" * 30), now_ms=0)
    log.flush()  # the recovery point moves into the last segment
    first2 = log.append(txn_batch(2, 0), now_ms=0).base_offset  # opens in a scanned segment
    log.append(txn_batch(1, 1), now_ms=0)  # more of pid 1's transaction
    log.append(marker(1, False), now_ms=0)
    log.append(marker(2, False), now_ms=0)
    log.append(txn_batch(1, 2), now_ms=0)  # pid 1's next transaction, left open
    expected = log.aborted_txns(0, log.end_offset)
    assert expected == [(1, 1), (2, first2)]
    segments = log.segments()
    crash(log)
    for path in log_dir.glob("*.txnindex"):
        path.unlink()
    reopened, report = open_log(SMALL, clean=False)
    assert 1 <= report.segments_scanned <= len(segments) - 2  # segment 0 is trusted
    assert reopened.aborted_txns(0, reopened.end_offset) == expected
    assert reopened.ongoing_txns() == {1: reopened.end_offset - 1}


def test_retention_deletes_the_index_with_its_segment(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    log.append(txn_batch(1, 0), now_ms=0)
    log.append(marker(1, False), now_ms=0)
    while len(log.segments()) < 3:
        log.append(make_batch(3, b"x" * 30), now_ms=10)
    assert txnindex_files(log.directory) == ["00000000000000000000.txnindex"]
    log.flush()
    assert log.delete_old_segments(now_ms=10**12) == 2
    assert txnindex_files(log.directory) == []
    assert list(log.directory.glob("*.deleted")) == []
    assert log.aborted_txns(0, log.end_offset) == []
    assert not log.has_control(0, log.end_offset)


def test_orphan_and_deleted_indexes_are_cleaned_at_open(open_log: LogOpener, log_dir: Path) -> None:
    log, _ = open_log(SMALL)
    log.append(txn_batch(1, 0), now_ms=0)
    log.close()
    (log_dir / "00000000000000009999.txnindex").write_bytes(TXN_ENTRY.pack(1, 1, 9999))
    (log_dir / "00000000000000000000.txnindex.deleted").write_bytes(b"")
    reopened, _ = open_log(SMALL)
    assert txnindex_files(log_dir) == []
    assert list(log_dir.glob("*.deleted")) == []
    assert not reopened.has_control(0, 10)


def test_truncation_drops_entries_above_the_new_end(open_log: LogOpener, make_batch: BatchFactory) -> None:
    log, _ = open_log(SMALL)
    log.append(txn_batch(1, 0), now_ms=0)  # 0
    log.append(marker(1, False), now_ms=0)  # 1
    log.append(txn_batch(2, 0), now_ms=0)  # 2
    log.append(marker(2, False), now_ms=0)  # 3
    while len(log.segments()) < 2:
        log.append(make_batch(3, b"x" * 30), now_ms=0)
    log.append(txn_batch(3, 0), now_ms=0)
    log.append(marker(3, False), now_ms=0)
    assert [pid for pid, _ in log.aborted_txns(0, log.end_offset)] == [1, 2, 3]
    log.truncate_to(3)
    assert log.aborted_txns(0, log.end_offset) == [(1, 0)]
    assert log.ongoing_txns() == {2: 2}
    assert txnindex_files(log.directory) == ["00000000000000000000.txnindex"]
    log.close()
    reopened, _ = open_log(SMALL)
    assert reopened.aborted_txns(0, reopened.end_offset) == [(1, 0)]
