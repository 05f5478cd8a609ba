"""Half messages' state table and check-back book (broker/half_messages/state.py), without a
broker: every (state, event) pair moves as the table says or is refused; the schedule counts
checks from the store time and the interval; limits hold."""

from __future__ import annotations

import itertools

import pytest

from ferrymq.broker.half_messages.state import (
    TRANSITIONS,
    HalfBook,
    HalfEvent,
    HalfPhase,
    PendingHalf,
    outcome_of,
    step,
)
from ferrymq.errors import BusyError, HalfMessageResolvedError
from ferrymq.protocol.half_messages import (
    COMMITTED,
    HALF_MSGID,
    HALF_OP,
    HALF_REASON,
    HALF_SOURCE,
    OP_COMMIT,
    OP_ROLLBACK,
    ROLLED_BACK,
)
from ferrymq.protocol.records import encode_msg_id

FINAL = (HalfPhase.COMMITTED, HalfPhase.ROLLED_BACK)


def half(offset: int, *, now: float = 0.0, after_ms: int = 1000, interval_ms: int = 500,
         max_checks: int = 3) -> PendingHalf:
    return PendingHalf(offset, "g", "c", "t", 0, 0, after_ms, interval_ms, max_checks,
                       now + after_ms / 1000)


@pytest.mark.parametrize(("state", "event"), list(itertools.product(HalfPhase, HalfEvent)))
def test_every_pair_moves_by_the_table_or_is_refused(state: HalfPhase, event: HalfEvent) -> None:
    if (state, event) in TRANSITIONS:
        assert step(state, event) is TRANSITIONS[(state, event)]
    else:
        with pytest.raises(HalfMessageResolvedError, match=event.value):
            step(state, event)


def test_an_outcome_never_changes() -> None:
    for (state, _event), nxt in TRANSITIONS.items():
        if state in FINAL:
            assert nxt is state
    with pytest.raises(HalfMessageResolvedError):
        step(HalfPhase.COMMITTED, HalfEvent.ROLLBACK)
    with pytest.raises(HalfMessageResolvedError):
        step(HalfPhase.ROLLED_BACK, HalfEvent.COMMIT)
    with pytest.raises(HalfMessageResolvedError):
        step(HalfPhase.COMMITTING, HalfEvent.ROLLBACK)  # the commit was taken


def test_checks_start_after_check_after_then_every_interval_then_roll_back() -> None:
    book = HalfBook(max_pending=10)
    h = half(7)
    book.add(h)
    assert list(book.due(0.999)) == []
    got = list(book.due(1.0))
    assert got == [(h, False)] and h.checks == 1 and h.next_check == 1.5
    assert list(book.due(1.4)) == []
    assert list(book.due(1.5)) == [(h, False)] and h.checks == 2
    assert list(book.due(2.0)) == [(h, False)] and h.checks == 3
    assert list(book.due(2.5)) == [(h, True)]  # out of checks: the caller rolls it back
    assert h.checks == 3


def test_a_committing_half_message_is_not_checked_but_looked_at_again() -> None:
    book = HalfBook(max_pending=10)
    h = half(1)
    book.add(h)
    book.step(h, HalfEvent.COMMIT)
    assert list(book.due(1.0)) == []
    assert h.checks == 0 and h.next_check == 1.5
    book.step(h, HalfEvent.COPY_LOST)  # the copy's fsync failed: checked again
    assert list(book.due(1.5)) == [(h, False)]


def test_resolve_forgets_the_half_message_and_remembers_a_bounded_number_of_outcomes() -> None:
    book = HalfBook(max_pending=2)
    for off in range(3):
        h = half(off)
        book.add(h)
        book.resolve(h, outcome_of("g", "t", 0, {HALF_OP: OP_ROLLBACK, HALF_SOURCE: "producer",
                                                 HALF_REASON: "no"}, 5))
        assert book.get(off) is None and h.state is HalfPhase.ROLLED_BACK
    assert book.outcome(0) is None  # the least recently resolved went first
    out = book.outcome(2)
    assert out is not None and out.state == ROLLED_BACK and out.reason == "no"
    assert list(book.due(100.0)) == []  # resolved ones are never checked


def test_a_commit_outcome_names_the_copy() -> None:
    copy = encode_msg_id(3, 1, 42)
    out = outcome_of("g", "t", 1, {HALF_OP: OP_COMMIT, HALF_MSGID: copy, HALF_SOURCE: "check"}, 9)
    assert (out.state, out.offset, out.msg_id, out.source) == (COMMITTED, 42, copy, "check")
    bad = outcome_of("g", "t", 1, {HALF_OP: OP_COMMIT, HALF_MSGID: "nonsense"}, 9)
    assert (bad.offset, bad.msg_id) == (-1, "")


def test_room_is_checked_before_anything_is_stored() -> None:
    book = HalfBook(max_pending=2)
    book.add(half(0))
    book.check_room()
    book.add(half(1))
    with pytest.raises(BusyError, match="half_max_pending 2"):
        book.check_room()
    assert book.floor([], 99) == 0
    assert book.floor([-5], 99) == -5
    assert HalfBook(1).floor([], 99) == 99
