"""DeliveryGroup's transitions and the journal's replay, on the pure objects (no I/O, no clock):
the failure table, receipts, lease renewal and expiry, and that replaying the records the
manager journals for a sequence of changes gives the state those changes made."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from ferrymq.broker.delivery.group import (
    FAILURE_OUTCOMES,
    DeliveryGroup,
    FailureOutcome,
    split_receipts,
)
from ferrymq.broker.delivery.orderly import Failure, OrderlyCursor
from ferrymq.broker.delivery.replay import (
    Replay,
    mark_dlq_done,
    move_dlq_floor,
    runs,
    set_tag_filter,
    snapshot,
)
from ferrymq.broker.delivery.state import Lease, SourceCursor
from ferrymq.errors import CorruptRecordError
from ferrymq.protocol.letters import Letter

KEY = ("t", 0)


def group(*, orderly: bool = False, max_reconsume: int = 2) -> DeliveryGroup:
    g = DeliveryGroup("g", [10, 20, 30], max_reconsume, orderly=orderly)
    g.sources[KEY] = g.new_cursor("t", 0, 0)
    return g


def state(g: DeliveryGroup) -> dict[str, Any]:
    """What replay must rebuild (ids, members, deadlines, offsets, finished positions)."""
    cur = g.sources[KEY]
    out: dict[str, Any] = {
        "leases": {i: (ls.member, ls.key, ls.deadline, ls.reconsume, sorted(ls.offsets))
                   for i, ls in g.leases.items()},
        "in_flight": dict(g.in_flight),
        "next": cur.next,
        "leased": {o: ls.lease_id for o, ls in cur.leased.items()},
        "retry": (g.retry.next, sorted(g.retry.done), {o: ls.lease_id
                                                        for o, ls in g.retry.leased.items()}),
        "policy": (g.retry_delays_ms, g.max_reconsume, g.start_from, g.orderly, g.ephemeral),
        "dlq_floor": g.dlq_floor,
        "dlq_done": sorted(g.dlq_done),
        "acked": list(g.acked),
        "filters": {t: (f.expression, f.since) for t, f in g.tag_filters.items()},
    }
    if isinstance(cur, OrderlyCursor):
        out["pending"] = sorted(cur.pending)
        out["failures"] = dict(cur.failures)
    return out


def test_the_failure_table_has_every_combination_and_follows_the_rules() -> None:
    assert set(FAILURE_OUTCOMES) == set(itertools.product([False, True], repeat=3))
    for (orderly, dead, exhausted), outcome in FAILURE_OUTCOMES.items():
        if dead or exhausted:
            assert outcome is FailureOutcome.DEAD
        elif orderly:
            assert outcome is FailureOutcome.IN_PLACE
        else:
            assert outcome is FailureOutcome.RETRY


@pytest.mark.parametrize("orderly", [False, True])
def test_failure_outcome_counts_attempts_and_retry_letters_go_through_the_retry_queue(
        orderly: bool) -> None:
    g = group(orderly=orderly, max_reconsume=2)
    first = FailureOutcome.IN_PLACE if orderly else FailureOutcome.RETRY
    assert g.failure_outcome(KEY, 2, dead=False) is first
    assert g.failure_outcome(KEY, 3, dead=False) is FailureOutcome.DEAD
    assert g.failure_outcome(KEY, 0, dead=True) is FailureOutcome.DEAD
    # a retry letter (a redriven dead letter, in an orderly group) is never retried in place
    assert g.failure_outcome((g.retry_topic, 0), 1, dead=False) is FailureOutcome.RETRY


def test_the_retry_ladder_is_indexed_by_attempt_and_its_last_step_repeats() -> None:
    g = group()
    assert [g.retry_delay_ms(n) for n in range(6)] == [10, 10, 20, 30, 30, 30]


def test_only_the_current_receipt_settles_and_a_renewal_voids_the_old_one() -> None:
    g = group()
    cur = g.sources[KEY]
    first = Lease(1, "m", KEY, 100, 0)
    g.grant(cur, [0, 1, 2], first)
    done, refused, held = split_receipts(cur, [0, 1, 5], 1)
    assert (done, refused, held) == ([0, 1], [5], first)
    renewed = Lease(2, "m", KEY, 200, 0)
    g.renew(KEY, [(first, 1)], renewed)
    assert g.lease_of(KEY, 1, 1) is None and g.lease_of(KEY, 1, 2) is renewed
    assert split_receipts(cur, [1], 1)[0] == []
    assert g.in_flight == {"m": 3}
    done, _, held = split_receipts(cur, [1], 2)
    assert held is renewed
    g.settle(cur, done, held)
    assert g.in_flight == {"m": 2} and 2 not in g.leases and cur.floor == 0
    g.settle(cur, [0, 2], first)
    assert g.leases == {} and g.in_flight == {} and cur.floor == 3 == cur.next


def test_an_expired_lease_stays_due_until_its_handling_is_done() -> None:
    g = group()
    cur = g.sources[KEY]
    g.grant(cur, [0], Lease(1, "m", KEY, 100, 0))
    g.grant(cur, [1], Lease(2, "m", KEY, 300, 0))
    due = g.expired(150)
    assert next(due).lease_id == 1
    due.close()  # its move met no descriptor: the tick stops there
    assert [ls.lease_id for ls in g.expired(150)] == [1]  # due again, then done
    assert list(g.expired(150)) == []
    renewed = Lease(3, "m", KEY, 400, 0)
    g.renew(KEY, [(g.leases[2], 1)], renewed)
    assert [ls.lease_id for ls in g.expired(350)] == []  # lease 2 is empty: gone
    assert [ls.lease_id for ls in g.expired(400)] == [3]


def test_a_member_that_leaves_hands_back_every_lease_it_holds() -> None:
    g = group()
    cur = g.sources[KEY]
    g.grant(cur, [0, 1], Lease(1, "a", KEY, 100, 0))
    g.grant(cur, [2], Lease(2, "b", KEY, 100, 0))
    g.grant(cur, [3], Lease(3, "a", KEY, 100, 1))
    g.hand_back("a", counts=True, reason="evicted")
    assert [(ls.lease_id, c, r) for ls, c, r in g.returning] == [(1, True, "evicted"),
                                                                  (3, True, "evicted")]


def test_an_orderly_head_failed_in_place_comes_back_after_its_backoff() -> None:
    g = group(orderly=True)
    cur = g.sources[KEY]
    assert isinstance(cur, OrderlyCursor)
    for o, k in enumerate(["a", "a", "b"]):
        cur.examine(o, k)
    assert sorted(cur.heads.values()) == [0, 2]  # 1 waits behind 0 (key a)
    g.grant(cur, [0, 2], Lease(1, "m", KEY, 100, 0))
    g.fail_in_place(cur, 0, Failure(1, 50, 0, "nack"), now=10)
    assert cur.take_ready(49) == [] and cur.take_ready(50) == [0]
    cur.unready([0])
    g.finish(KEY, 0)
    assert cur.take_ready(60) == [1]  # the key's next message is its head now


def records_of_a_session(g: DeliveryGroup) -> Iterator[list[Any]]:
    """Changes made on ``g`` and the journal records the manager writes for each (in the
    manager's forms), in order."""
    cur = g.sources[KEY]
    yield ["P", [5, 6], 3, -1, g.orderly, False]
    g.set_policy([5, 6], 3, -1, g.orderly, False)
    yield ["N", "t", 0, 0]
    yield ["T", "t", "a || b", [[0, 0]]]
    set_tag_filter(g, "t", "a || b", {0: 0})
    yield ["N", "t", 0, 3]  # (an orderly scan journals its position before it leases)
    if isinstance(cur, OrderlyCursor):
        for o in (0, 1, 2):
            cur.examine(o, "")
    l1 = Lease(7, "m", KEY, 1_000, 0)
    yield ["L", "t", 0, 7, "m", 1_000, 0, runs([0, 1, 2])]
    g.grant(cur, [0, 1, 2], l1)
    if isinstance(cur, SourceCursor):
        cur.skip_to(3)
    rec = ["A", "t", 0, runs([1]), 55]
    yield rec
    g.settle(cur, [1], l1)
    g.record_acks("t", 0, [[1, 1]], 55, 100)
    l2 = Lease(8, "m", KEY, 2_000, 0)
    yield ["C", "t", 0, 8, "m", 2_000, 0, runs([2])]
    g.renew(KEY, [(l1, 2)], l2)
    letter = g.retry_topic
    l3 = Lease(9, "n", (letter, 0), 3_000, 1)
    yield ["L", letter, 0, 9, "n", 3_000, 1, [[4, 1]]]
    g.retry.add(4, Letter("t", 0, 0, "id", 1))
    g.retry.passed(4, 4, plain=True)
    g.grant_letter(4, l3)
    yield ["D", 12]
    g.dlq_floor = 12
    for off in (15, 17, 13):  # dead letters done one by one above the floor
        yield ["DX", off]
        g.dlq_done.add(off)


@pytest.mark.parametrize("orderly", [False, True])
def test_replaying_the_journal_rebuilds_the_state_the_changes_made(orderly: bool) -> None:
    live = group(orderly=orderly)
    records = [msgpack.unpackb(msgpack.packb(r), raw=False) for r in records_of_a_session(live)]
    replayed = DeliveryGroup("g", [1], 1, orderly=orderly)
    replay = Replay(lambda wall: wall, 100, 1)
    for rec in records:
        replay.apply(replayed, rec)
    cur = replayed.sources[KEY]
    if isinstance(cur, OrderlyCursor):
        cur.rebuild(dict.fromkeys(cur.pending, ""), 0)
    cur.advance_floor()
    live.sources[KEY].advance_floor()
    want = state(live)
    want["retry"] = (0, [], want["retry"][2])  # the retry scan position is in snapshots only
    assert state(replayed) == want
    assert replay.next_lease == 10


@pytest.mark.parametrize("orderly", [False, True])
def test_a_snapshot_reads_back_as_the_state_it_was_taken_of(orderly: bool) -> None:
    live = group(orderly=orderly)
    for _rec in records_of_a_session(live):
        pass
    cur = live.sources[KEY]
    if isinstance(cur, OrderlyCursor):
        cur.failures[0] = Failure(2, 900, 40, "why")
    snap = msgpack.unpackb(msgpack.packb(snapshot(live, lambda mono: mono, 10)), raw=False,
                           strict_map_key=False)
    back = DeliveryGroup("g", [1], 1)
    replay = Replay(lambda wall: wall, 100, 1)
    replay.apply_snapshot(back, snap)
    assert state(back) == state(live)
    assert replay.next_lease == 10


def test_every_journal_record_kind_has_a_transition_and_others_are_refused() -> None:
    assert set(Replay.TRANSITIONS) == {*"LCANFPDT", "DX"}
    with pytest.raises(CorruptRecordError, match="unknown record 'Z'"):
        Replay(lambda wall: wall, 100, 1).apply(group(), ["Z"])


def test_a_retry_letter_acked_after_a_replay_before_the_scan_reaches_it_is_not_read_again(
) -> None:
    # After a kill -9 the retry scan starts where the last snapshot left it (0 here), but the
    # journal leased the letter at offset 4: once it is acked the scan must skip it.
    g = group()
    replay = Replay(lambda wall: wall, 100, 1)
    replay.apply(g, ["L", g.retry_topic, 0, 9, "m", 1_000, 1, [[4, 1]]])
    rc = g.retry
    assert rc.next == 0 and not rc.is_finished(4)
    lease = g.lease_of((g.retry_topic, 0), 4, 9)
    assert lease is not None
    g.settle(rc, [4], lease)
    assert rc.is_finished(4) and 4 in rc.done and g.leases == {}


def test_dead_letters_done_one_by_one_are_folded_into_the_floor_as_it_reaches_them() -> None:
    g = group()
    g.dlq_floor = 10
    for off in (12, 14, 15, 9):  # 9: below the floor, done already
        mark_dlq_done(g, off)
    assert (g.dlq_floor, g.dlq_done) == (10, {12, 14, 15})
    mark_dlq_done(g, 10)  # the oldest: the floor moves past it (11 is still dead)
    assert (g.dlq_floor, g.dlq_done) == (11, {12, 14, 15})
    move_dlq_floor(g, 12)  # 11 purged: the floor passes 12 too, stops at 13
    assert (g.dlq_floor, g.dlq_done) == (13, {14, 15})
    move_dlq_floor(g, 15)  # past 14, and 15 right above: folded
    assert (g.dlq_floor, g.dlq_done) == (16, set())
    move_dlq_floor(g, 3)  # never back
    assert g.dlq_floor == 16
