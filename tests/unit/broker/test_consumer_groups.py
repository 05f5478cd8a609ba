"""Consumer group coordinator rules: assignment, generations, fencing, expiry, durable offsets."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrymq.broker.consumer_groups import ConsumerGroupCoordinator, Member, assign_averagely
from ferrymq.errors import IllegalGenerationError, RebalanceInProgressError, UnknownMemberError


def _m(mid: str, topics: tuple[str, ...]) -> Member:
    return Member(mid, "c", "h", topics, 1000, 0)


def test_assign_averagely_splits_contiguous_ranges() -> None:
    plan = assign_averagely([_m("b", ("t",)), _m("a", ("t",)), _m("c", ("u",))], {"t": 5, "u": 2})
    assert plan == {"a": [("t", 0), ("t", 1), ("t", 2)], "b": [("t", 3), ("t", 4)],
                    "c": [("u", 0), ("u", 1)]}


def test_generation_fencing_and_expiry(tmp_path: Path) -> None:
    gc = ConsumerGroupCoordinator(tmp_path)
    gc.load()
    counts = {"t": 4}
    g, m1 = gc.join("g", "", "c1", "h", ["t"], 1000, now_ms=0, queue_counts=counts)
    assert g.generation == 1 and len(m1.assignment) == 4
    gc.commit("g", m1.member_id, 1, [("t", 0, 5)])
    g, m2 = gc.join("g", "", "c2", "h", ["t"], 1000, now_ms=10, queue_counts=counts)
    assert g.generation == 2
    with pytest.raises(RebalanceInProgressError):
        gc.heartbeat("g", m1.member_id, 1, now_ms=20)
    with pytest.raises(IllegalGenerationError):
        gc.commit("g", m1.member_id, 1, [("t", 0, 9)])
    assert gc.committed("g")[("t", 0)] == 5
    gc.heartbeat("g", m2.member_id, 2, now_ms=500)
    gone = gc.expire(now_ms=1500, queue_counts=counts)  # m1 last seen at 20: expired
    assert gone == [("g", m1.member_id)]
    assert len(g.members[m2.member_id].assignment) == 4
    with pytest.raises(UnknownMemberError):
        gc.heartbeat("g", m1.member_id, g.generation, now_ms=1600)


def test_offsets_survive_reload(tmp_path: Path) -> None:
    gc = ConsumerGroupCoordinator(tmp_path)
    gc.load()
    gc.commit("g.1", "", -1, [("t", 0, 7), ("t", 1, 9)])
    again = ConsumerGroupCoordinator(tmp_path)
    again.load()
    assert again.committed("g.1") == {("t", 0): 7, ("t", 1): 9}


def test_a_member_waits_for_a_topic_and_gets_its_queues_when_it_is_created(
        tmp_path: Path) -> None:
    gc = ConsumerGroupCoordinator(tmp_path)
    gc.load()
    gc.sync_queue_counts({"t": 2})
    g, m = gc.join("g", "", "c", "h", ["t", "later"], 1000, now_ms=0, queue_counts={"t": 2})
    assert g.generation == 1 and m.assignment == [("t", 0), ("t", 1)]
    other, _ = gc.join("o", "", "c", "h", ["t"], 1000, now_ms=0, queue_counts={"t": 2})
    assert gc.sync_queue_counts({"t": 2}) == []  # nothing changed: nothing to do
    assert gc.sync_queue_counts({"t": 2, "later": 3}) == ["g"]  # only the group reading it
    assert g.generation == 2 and other.generation == 1
    assert m.assignment == [("later", 0), ("later", 1), ("later", 2), ("t", 0), ("t", 1)]
    with pytest.raises(RebalanceInProgressError):  # the member learns it from its heartbeat
        gc.heartbeat("g", m.member_id, 1, now_ms=10)
    # a group that joined after the topic was created already has its share: left alone
    late, _ = gc.join("late", "", "c", "h", ["new"], 1000, now_ms=0, queue_counts={"new": 1})
    assert gc.sync_queue_counts({"t": 2, "later": 3, "new": 1}) == []
    assert late.generation == 1
    # deleted: its queues are taken away
    assert gc.sync_queue_counts({"t": 2, "new": 1}) == ["g"]
    assert m.assignment == [("t", 0), ("t", 1)]
