"""The scheduler's time index in memory (broker/scheduler/buckets.py) over real bucket files in
tmp_path, without a broker: near buckets loaded, far ones counted, due entries taken in fire
order, fired and cancelled entries settle, finished buckets deleted, a reload agrees."""

from __future__ import annotations

from pathlib import Path

from ferrymq.broker.scheduler.buckets import (
    CANCELLED_ENTRY,
    FIRED_ENTRY,
    NOT_FOUND,
    PENDING_ENTRY,
    BucketIndex,
)
from ferrymq.storage.schedule import FIRED, ScheduleStore

WIDTH = 1000
LOOKAHEAD = 2000
TID, Q = 7, 1


def index(tmp_path: Path) -> tuple[BucketIndex, ScheduleStore]:
    store = ScheduleStore(tmp_path / "schedule")
    return BucketIndex(store, WIDTH, LOOKAHEAD), store


def test_near_entries_are_loaded_and_fired_in_order_far_ones_counted(tmp_path: Path) -> None:
    ix, store = index(tmp_path)
    ix.register(TID, Q, [(12, 5_000), (11, 1_500), (10, 500)], 0, now=0.0)
    assert ix.write_seq == 3  # one write per bucket
    assert sorted(ix.buckets) == [0, 1_000, 5_000]
    assert (ix.buckets[5_000].entries, ix.buckets[0].entries is not None) == (None, True)
    assert ix.pending == 3 and ix.topic_stats(TID) == (3, 500)
    assert ix.retention_floors() == {(TID, Q): 10}
    assert ix.next_wake() == 500
    assert ix.pop_due(499.0, 10) == {}
    assert ix.pop_due(1_600.0, 1) == {(TID, Q): [(10, 500, 0)]}  # at most one per call
    assert ix.more_due(1_600.0)
    assert ix.pop_due(1_600.0, 10) == {(TID, Q): [(11, 1_500, 1_000)]}
    assert ix.buckets[0].firing == 1 and ix.pending == 1
    assert ix.retention_floors() == {(TID, Q): 0}  # a copy in flight: its original is kept
    ix.settle(TID, Q, [(10, 500, 0), (11, 1_500, 1_000)], FIRED)
    assert ix.buckets[0].firing == 0
    assert ix.find((TID, Q, 10), 500, 0, 0) == (ix.buckets[0], FIRED_ENTRY)
    assert ix.next_wake() == 5_000 - LOOKAHEAD  # the far bucket comes near then
    ix.load_near(3_000.0)
    assert ix.buckets[5_000].entries == {(TID, Q, 12): 5_000}
    ix.delete_finished(2_000.0, lambda _b: True)
    assert sorted(ix.buckets) == [5_000] and store.bucket_starts() == [5_000]
    store.close()


def test_a_due_entry_goes_to_the_current_bucket_and_skew_moves_its_fire_time(
        tmp_path: Path) -> None:
    ix, store = index(tmp_path)
    ix.register(TID, Q, [(3, 100)], 0, now=4_200.0)  # due long ago: past buckets stay closed
    assert list(ix.buckets) == [4_000]
    ix.register(TID, Q, [(4, 4_300)], 1_000, now=4_200.0)  # fires when S reaches 5300
    assert ix.buckets[5_000].entries == {(TID, Q, 4): 5_300}
    assert ix.find((TID, Q, 4), 4_300, 0, 1_000) == (ix.buckets[5_000], PENDING_ENTRY)
    assert ix.find((TID, Q, 4), 4_300, 0, 0)[1] == PENDING_ENTRY  # loaded: found in memory
    store.close()


def test_cancel_settles_the_entry_where_it_is(tmp_path: Path) -> None:
    ix, store = index(tmp_path)
    ix.register(TID, Q, [(1, 800), (2, 9_000)], 0, now=0.0)
    near, far = ix.buckets[0], ix.buckets[9_000]
    ix.cancel(near, (TID, Q, 1), 800)
    ix.cancel(far, (TID, Q, 2), 9_000)  # not loaded: its counters are rebuilt from the file
    assert ix.pending == 0 and near.pending == 0 and far.pending == 0
    assert ix.pop_due(10_000.0, 10) == {}  # the heap item of a cancelled entry is skipped
    assert ix.find((TID, Q, 1), 800, 0, 0) == (near, CANCELLED_ENTRY)
    assert ix.find((TID, Q, 2), 9_000, 0, 0) == (far, CANCELLED_ENTRY)
    assert ix.find((TID, Q, 3), 800, 0, 0) == (None, NOT_FOUND)
    assert ix.topic_stats(TID) == (0, None) and ix.retention_floors() == {}
    store.close()


def test_a_reload_from_the_files_agrees(tmp_path: Path) -> None:
    ix, store = index(tmp_path)
    ix.register(TID, Q, [(5, 900), (6, 1_900), (7, 7_000)], 0, now=0.0)
    ix.register(TID, Q, [(8, 900)], -3_000, now=0.0)
    ix.settle(TID, Q, list(ix.pop_due(950.0, 10)[(TID, Q)]), FIRED)
    store.sync()
    skews: list[int] = []
    again, again_store = index(tmp_path)
    known, total, corrupt = again.load({(TID, Q): 6}, 0.0, skews.append)
    assert (total, corrupt) == (2, 0)
    assert skews == [-3_000]
    assert known == {(TID, Q, 6, 1_900), (TID, Q, 7, 7_000), (TID, Q, 8, 900)}
    assert again.pending == ix.pending == 2
    assert again.topic_stats(TID) == ix.topic_stats(TID) == (2, 1_900)
    assert again.retention_floors() == {(TID, Q): 6}
    store.close()
    again_store.close()
