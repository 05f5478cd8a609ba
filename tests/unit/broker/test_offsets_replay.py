"""Replaying a queue of ``%GROUPS%offsets`` (a real log on disk): snapshots are skipped while
the log starts at 0, used once its start moved, with the commits written between a snapshot's
``upto`` and the snapshot itself applied over it; an incomplete snapshot is never used."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from ferrymq.broker.cluster_offsets_log import OffsetsReplay, replay, snapshot_batches
from ferrymq.broker.topics import QueueState
from ferrymq.protocol.records import RecordInput, encode_batch
from ferrymq.storage import Log, LogConfig

IDS = {"orders": 7}


@pytest.fixture
def qs(tmp_path: Path) -> Iterator[QueueState]:
    lg, _ = Log.open(tmp_path / "q", LogConfig(segment_bytes=300), clean_shutdown=True,
                     now_ms=0)
    yield QueueState("%GROUPS%offsets", 1, 0, lg, 0)
    lg.close()


def append(qs: QueueState, rec: dict[str, Any]) -> int:
    body = bytes(msgpack.packb(rec, use_bin_type=True))
    return qs.log.append(encode_batch([RecordInput(body, 0, b"X")]), now_ms=0).last_offset


def commit(qs: QueueState, group: str, offset: int, topic_id: int = 7) -> int:
    return append(qs, {"t": "OFFSETS", "g": group, "o": [["orders", topic_id, 0, offset]]})


def snapshot_of(qs: QueueState, upto: int) -> OffsetsReplay:
    r = OffsetsReplay(IDS.get)
    r.advance(qs, upto)
    return r


def test_a_log_starting_at_zero_is_replayed_record_by_record(qs: QueueState) -> None:
    for i in range(5):
        commit(qs, "a", i)
    commit(qs, "b", 1, topic_id=99)  # a topic deleted and created again: skipped
    append(qs, {"t": "DELETE", "g": "c"})
    assert replay(qs, IDS) == {"a": {("orders", 0): 4}, "b": {}}


def test_a_moved_start_starts_from_the_snapshot_and_keeps_later_commits(qs: QueueState) -> None:
    for i in range(20):
        commit(qs, "a", i)
        commit(qs, "gone", i)
    upto = qs.log.end_offset
    r = snapshot_of(qs, upto)
    commit(qs, "a", 100)  # between the snapshot's upto and the snapshot: newer than it
    append(qs, {"t": "DELETE", "g": "gone"})
    for batch in snapshot_batches(r, 0):
        qs.log.append(batch, now_ms=0)
    commit(qs, "b", 5)
    assert qs.log.delete_before(upto, now_ms=0) > 0
    assert 0 < qs.log.start_offset <= upto
    assert replay(qs, IDS) == {"a": {("orders", 0): 100}, "b": {("orders", 0): 5}}


def test_an_incomplete_snapshot_is_not_used(qs: QueueState) -> None:
    for i in range(20):
        commit(qs, "a", i)
    upto = qs.log.end_offset
    good = snapshot_of(qs, upto)
    for batch in snapshot_batches(good, 0):
        qs.log.append(batch, now_ms=0)
    commit(qs, "a", 50)
    # a later snapshot whose writer died after its first part: says a=1, must not count
    append(qs, {"t": "SNAPSHOT", "upto": qs.log.end_offset, "n": 2, "i": 0,
                "gs": {"a": [["orders", 7, 0, 1]]}})
    qs.log.delete_before(upto, now_ms=0)
    assert qs.log.start_offset > 0
    assert replay(qs, IDS) == {"a": {("orders", 0): 50}}


def test_snapshots_are_split_into_parts(qs: QueueState) -> None:
    r = OffsetsReplay(IDS.get)
    r.position = 10
    r.ids = dict(IDS)
    r.groups = {f"group-{i:05d}": {("orders", q): i for q in range(8)} for i in range(4000)}
    batches = list(snapshot_batches(r, 0))
    assert len(batches) > 1
    assert all(len(b) < 2 * 256 * 1024 for b in batches)


def test_memberships_are_replayed_and_kept_by_a_snapshot(qs: QueueState) -> None:
    member = ["c-1", "app", "10.0.0.1:5", ["orders"], 15000, [["orders", 0]]]
    append(qs, {"t": "MEMBERS", "g": "a", "gen": 3, "m": [member]})
    append(qs, {"t": "MEMBERS", "g": "gone", "gen": 1, "m": []})
    for i in range(20):
        commit(qs, "a", i)
    append(qs, {"t": "DELETE", "g": "gone"})
    upto = qs.log.end_offset
    r = snapshot_of(qs, upto)
    assert r.members == {"a": [3, [member]]}
    append(qs, {"t": "MEMBERS", "g": "a", "gen": 4, "m": [member]})  # after upto: newer
    for batch in snapshot_batches(r, 0):
        qs.log.append(batch, now_ms=0)
    assert qs.log.delete_before(upto, now_ms=0) > 0
    again = snapshot_of(qs, qs.log.end_offset)
    assert again.members == {"a": [4, [member]]}
    assert again.groups == {"a": {("orders", 0): 19}}
