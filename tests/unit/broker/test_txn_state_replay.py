"""Replaying ``%TXN%state`` (a real log on disk) with the snapshots a cluster's coordinator
writes when it compacts: a complete snapshot is merged (an id set by a record at or after its
``upto`` keeps that record's state, every other id takes the snapshot's, ids it lacks are
gone), wherever the replay starts; an incomplete one is never used."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from ferrymq.broker.topics import QueueState
from ferrymq.broker.txn import statelog
from ferrymq.broker.txn.state import TxnMeta
from ferrymq.broker.txn.statelog import StateReplay, meta_record, sink_record
from ferrymq.protocol.messages import TxnState
from ferrymq.protocol.records import RecordInput, encode_batch
from ferrymq.storage import Log, LogConfig

DAY_MS = 86_400_000


@pytest.fixture
def qs(tmp_path: Path) -> Iterator[QueueState]:
    lg, _ = Log.open(tmp_path / "q", LogConfig(segment_bytes=400), clean_shutdown=True,
                     now_ms=0)
    yield QueueState("%TXN%state", 1, 0, lg, 0)
    lg.close()


def append(qs: QueueState, rec: dict[str, Any]) -> int:
    body = bytes(msgpack.packb(rec, use_bin_type=True))
    return qs.log.append(encode_batch([RecordInput(body, 0, b"X")]), now_ms=0).last_offset


def txn(qs: QueueState, tid: str, epoch: int, state: TxnState = TxnState.COMPLETE_COMMIT,
        updated_ms: int = 10 * DAY_MS) -> int:
    meta = TxnMeta(tid, 100 + ord(tid[0]), epoch, state, 60_000, updated_ms=updated_ms)
    return append(qs, meta_record(meta))


def replay(qs: QueueState, start: int | None = None) -> StateReplay:
    r = StateReplay(position=qs.log.start_offset if start is None else start)
    r.advance(qs, qs.log.end_offset)
    return r


def epochs(r: StateReplay) -> dict[str, int]:
    return {tid: m.epoch for tid, m in r.book.txns.items()}


def test_a_snapshot_is_merged_with_the_records_after_its_upto(qs: QueueState) -> None:
    for e in range(5):
        txn(qs, "a", e)
        txn(qs, "gone", e, updated_ms=0)  # idle for days: left out of the snapshot
    append(qs, sink_record("spark", 7, 5, []))
    view = replay(qs)
    upto = view.position
    txn(qs, "a", 50)  # between the snapshot's upto and the snapshot: newer than it
    txn(qs, "b", 1)
    for rec in view.snapshot_records(now_ms=10 * DAY_MS, expiration_ms=DAY_MS):
        append(qs, rec)
    txn(qs, "c", 3)
    full = replay(qs)  # from offset 0: records, then the snapshot merged over them
    assert epochs(full) == {"a": 50, "b": 1, "c": 3}
    assert full.book.sinks == {"spark": (7, 5)}
    qs.log.delete_before(upto, now_ms=0)
    assert qs.log.start_offset > 0
    assert epochs(replay(qs)) == {"a": 50, "b": 1, "c": 3}  # from the moved start
    assert replay(qs).book.sinks == {"spark": (7, 5)}


def test_an_incomplete_snapshot_is_not_used(qs: QueueState,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statelog, "SNAPSHOT_PART_BYTES", 1000)  # parts of a few ids each
    for i in range(30):
        txn(qs, f"t{i:03d}", 1)
    view = replay(qs)
    parts = view.snapshot_records(now_ms=10 * DAY_MS, expiration_ms=DAY_MS)
    assert len(parts) > 1
    txn(qs, "late", 2)
    for rec in parts[:-1]:  # its writer died before the last part
        append(qs, rec)
    r = replay(qs)
    assert len(r.book.txns) == 31  # nothing forgotten on the strength of half a snapshot
    for rec in parts:  # a complete one after it
        append(qs, rec)
    r = replay(qs)
    assert len(r.book.txns) == 31 and r.book.txns["late"].epoch == 2


def test_a_sink_commit_after_the_upto_keeps_its_members_state(qs: QueueState) -> None:
    txn(qs, "s1", 4, TxnState.STAGED)
    view = replay(qs)
    snap = view.snapshot_records(now_ms=10 * DAY_MS, expiration_ms=DAY_MS)
    member = ["s1", 100 + ord("s"), 4]
    rec = {**meta_record(TxnMeta("s1", 100 + ord("s"), 4, TxnState.STAGED, 60_000,
                                 sink=("spark", 8), updated_ms=10 * DAY_MS))}
    append(qs, rec)
    append(qs, sink_record("spark", 8, 9, [tuple(member)]))  # type: ignore[list-item]
    for r in snap:
        append(qs, r)
    got = replay(qs)
    assert got.book.txns["s1"].state == TxnState.PREPARE_COMMIT  # not the snapshot's STAGED
    assert got.book.sinks == {"spark": (8, 9)}
