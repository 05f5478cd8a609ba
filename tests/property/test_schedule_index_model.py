"""Model test of the scheduler's time index (``broker/scheduler/buckets.py``) over real bucket
files, no broker: random registers (due now, soon, beyond the look-ahead; with and without a
skew), firing rounds, settles, cancels, deletion of finished buckets and reloads from the files,
against a dict of entries and their states.

Invariants: the pending count and each topic's earliest fire time are the model's; a round takes
only due entries, in fire order, at most its limit, and leaves none due behind; ``find`` names
each entry's state; retention keeps every pending or firing original; a reload from the files
agrees (entries firing when it happened are pending again: they fire a second time)."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ferrymq.broker.scheduler.buckets import (
    CANCELLED_ENTRY,
    FIRED_ENTRY,
    NOT_FOUND,
    PENDING_ENTRY,
    BucketIndex,
    Item,
)
from ferrymq.storage.schedule import FIRED, ScheduleStore

WIDTH = 1_000
LOOKAHEAD = 2_000
START_MS = 10_000
QUEUES = [(1, 0), (1, 1), (2, 0)]  # (topic id, queue)

PENDING, FIRING, FIRED_DONE, CANCELLED, GONE = "pending", "firing", "fired", "cancelled", "gone"


@dataclass
class Entry:
    """The model of one scheduled entry."""

    tid: int
    q: int
    off: int
    due: int
    skew: int
    start: int  # the bucket it was written to
    state: str = PENDING

    @property
    def fire(self) -> int:
        return self.due + self.skew

    @property
    def item(self) -> Item:
        return (self.off, self.due, self.start)


class ScheduleIndexModel(RuleBasedStateMachine):
    """Drives one ``BucketIndex`` and a dict of :class:`Entry` side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="ferrymq-schedule-model-"))
        self.store = ScheduleStore(self.directory)
        self.index = BucketIndex(self.store, WIDTH, LOOKAHEAD)
        self.now = float(START_MS)
        self.entries: dict[tuple[int, int, int], Entry] = {}
        self.next_off = dict.fromkeys(QUEUES, 0)
        self.skew_lo = 0
        self.skew_hi = 0

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    # --- helpers ------------------------------------------------------------------------------

    def _in(self, *states: str) -> list[Entry]:
        return [e for e in self.entries.values() if e.state in states]

    def _buckets_in_use(self) -> set[int]:
        return {e.start for e in self._in(PENDING, FIRING)}

    # --- rules --------------------------------------------------------------------------------

    @rule(key=st.sampled_from(QUEUES),
          delays=st.lists(st.integers(-3_000, 9_000), min_size=1, max_size=5),
          skew=st.sampled_from([0, 0, 0, -2_500, 1_500]))
    def register(self, key: tuple[int, int], delays: list[int], skew: int) -> None:
        tid, q = key
        now = self.now
        cur = int(now) - int(now) % WIDTH
        items = []
        for delay in delays:
            off = self.next_off[key]
            self.next_off[key] += 1
            due = int(now) + delay
            start = max((due + skew) - (due + skew) % WIDTH, cur)  # past buckets stay closed
            self.entries[(tid, q, off)] = Entry(tid, q, off, due, skew, start)
            items.append((off, due))
        self.index.register(tid, q, items, skew, now=now)
        self.skew_lo = min(self.skew_lo, skew)
        self.skew_hi = max(self.skew_hi, skew)

    @rule(dt=st.integers(0, 3_000))
    def advance(self, dt: int) -> None:
        """Time passes; the timer woke at :meth:`BucketIndex.next_wake` meanwhile and loaded
        the buckets that came near (as ``Firer._fire`` does before it takes due entries)."""
        self.now += dt
        wake = self.index.next_wake()
        if wake is not None and wake <= self.now:
            self.index.load_near(self.now)

    @rule(limit=st.sampled_from([1, 2, 1_000]))
    def fire_due(self, limit: int) -> None:
        """A firing round as ``Firer._fire`` runs it: load what came near, take what is due."""
        self.index.load_near(self.now)
        due_before = [e for e in self._in(PENDING) if e.fire <= self.now]
        groups = self.index.pop_due(self.now, limit)
        taken = [self.entries[(tid, q, off)] for (tid, q), items in groups.items()
                 for off, _due, _start in items]
        assert len(taken) == min(limit, len(due_before))
        for (tid, q), items in groups.items():
            for item in items:
                e = self.entries[(tid, q, item[0])]
                assert e.state == PENDING and e.fire <= self.now
                assert item == e.item
                e.state = FIRING
        left = [e.fire for e in self._in(PENDING) if e.fire <= self.now]
        if left:
            assert max(e.fire for e in taken) <= min(left)  # in fire order
            assert self.index.more_due(self.now)
        elif limit > len(due_before):
            assert not self.index.more_due(self.now)

    @precondition(lambda self: any(e.state == FIRING for e in self.entries.values()))
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        firing = self._in(FIRING)
        chosen = data.draw(st.lists(st.sampled_from(firing), min_size=1, unique_by=id))
        by_queue: dict[tuple[int, int], list[Entry]] = {}
        for e in chosen:
            by_queue.setdefault((e.tid, e.q), []).append(e)
        for (tid, q), es in by_queue.items():
            assert self.index.settle(tid, q, [e.item for e in es], FIRED) == []
            for e in es:
                e.state = FIRED_DONE

    @precondition(lambda self: any(e.state == PENDING for e in self.entries.values()))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        e = data.draw(st.sampled_from(self._in(PENDING)))
        b, state = self.index.find((e.tid, e.q, e.off), e.due, self.skew_lo, self.skew_hi)
        assert b is not None and b.start == e.start and state == PENDING_ENTRY
        self.index.cancel(b, (e.tid, e.q, e.off), e.due)
        e.state = CANCELLED

    @rule()
    def maintain(self) -> None:
        """The maintenance tick's part: load what came near, delete finished buckets."""
        self.index.load_near(self.now)
        in_use = self._buckets_in_use()
        self.index.delete_finished(self.now, lambda _b: True)
        for e in self._in(FIRED_DONE, CANCELLED):
            if e.start + WIDTH <= self.now and e.start not in in_use:
                e.state = GONE
        assert set(self.index.buckets) >= in_use

    @rule()
    def reload(self) -> None:
        """A restart: a new index over the same files (after they were fsynced)."""
        self.store.close()
        self.store = ScheduleStore(self.directory)
        self.index = BucketIndex(self.store, WIDTH, LOOKAHEAD)
        skews: list[int] = []
        known, total, corrupt = self.index.load({}, self.now, skews.append)
        for e in self._in(FIRING):
            e.state = PENDING  # its fired entry was never written: it fires again
        on_disk = [e for e in self.entries.values() if e.state != GONE]
        assert corrupt == 0
        assert total == len(self._in(PENDING))
        assert known == {(e.tid, e.q, e.off, e.due) for e in on_disk}
        assert sorted(skews) == sorted(e.skew for e in on_disk if e.skew)

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def counts_agree(self) -> None:
        pending = self._in(PENDING)
        assert self.index.pending == len(pending)
        for b in self.index.buckets.values():
            assert b.pending == sum(1 for e in pending if e.start == b.start)
            assert b.firing == sum(1 for e in self._in(FIRING) if e.start == b.start)

    @invariant()
    def earliest_fire_per_topic(self) -> None:
        pending = self._in(PENDING)
        if any(e.fire <= self.now for e in pending):
            return  # due, not yet fired: a round takes them (their bucket may not be the first)
        for tid in {t for t, _q in QUEUES}:
            fires = [e.fire for e in pending if e.tid == tid]
            assert self.index.topic_stats(tid) == (len(fires), min(fires) if fires else None)

    @invariant()
    def retention_keeps_every_original_not_settled(self) -> None:
        floors = self.index.retention_floors()
        for key in QUEUES:
            pending = [e.off for e in self._in(PENDING) if (e.tid, e.q) == key]
            firing = [e for e in self._in(FIRING) if (e.tid, e.q) == key]
            if firing:
                assert floors[key] == 0  # a crash fires the originals again: keep them all
            elif pending:
                assert floors[key] <= min(pending)
            elif key in floors:  # kept only for another queue's copy in flight in its bucket
                starts = {e.start for e in self.entries.values() if (e.tid, e.q) == key}
                assert floors[key] == 0
                assert any(e.start in starts for e in self._in(FIRING))

    @invariant()
    def find_names_each_state(self) -> None:
        expected = {PENDING: PENDING_ENTRY, FIRING: FIRED_ENTRY, FIRED_DONE: FIRED_ENTRY,
                    CANCELLED: CANCELLED_ENTRY, GONE: NOT_FOUND}
        for e in self.entries.values():
            if e.state != PENDING and e.start != e.fire - e.fire % WIDTH:
                continue  # written to the current bucket (due already): only pending is found
            b, state = self.index.find((e.tid, e.q, e.off), e.due, self.skew_lo, self.skew_hi)
            assert state == expected[e.state], (e, state)
            assert (b is None) == (e.state == GONE)
            if b is not None:
                assert b.start == e.start


ScheduleIndexModel.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_schedule_index_model = ScheduleIndexModel.TestCase
