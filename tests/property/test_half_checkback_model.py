"""Model test of the half-message checker (broker/half_messages/state.py) without a broker.

Rules: prepare half messages with random check settings, let time pass, run check-back rounds,
answer COMMIT / ROLLBACK / UNKNOWN (as a producer or a check would, also to half messages
resolved long ago), let a committed copy become durable or fail its fsync. Invariants: an
outcome never changes once decided; a half message is never checked before ``check_after`` nor
twice within ``check_interval``, never more than ``max_checks`` times, and is rolled back only
when due after its last check; a committing one is never checked; the pending set and the
remembered outcomes stay within ``half_max_pending``; the retention floor is the oldest pending
offset.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ferrymq.broker.half_messages.state import (
    TRANSITIONS,
    HalfBook,
    HalfEvent,
    HalfPhase,
    Outcome,
    PendingHalf,
    outcome_of,
)
from ferrymq.errors import BusyError, HalfMessageResolvedError
from ferrymq.protocol.half_messages import (
    COMMITTED,
    HALF_MSGID,
    HALF_OP,
    HALF_SOURCE,
    OP_COMMIT,
    OP_ROLLBACK,
)
from ferrymq.protocol.records import encode_msg_id

MAX_PENDING = 4
EPS = 1e-9


@dataclass
class Seen:
    """What the model knows of one half message."""

    stored: float
    after: float
    interval: float
    max_checks: int
    checks: int = 0
    last_check: float | None = None


class HalfCheckerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.book = HalfBook(MAX_PENDING)
        self.now = 0.0
        self.next_offset = 0
        self.seen: dict[int, Seen] = {}
        self.decided: dict[int, str] = {}  # offset -> COMMITTED / ROLLED_BACK, never changes
        self.outcomes: dict[int, Outcome] = {}

    # -- rules -----------------------------------------------------------------------------------

    @rule(after=st.integers(0, 3000), interval=st.integers(1, 2000), max_checks=st.integers(0, 4))
    def prepare(self, after: int, interval: int, max_checks: int) -> None:
        if len(self.book.pending) >= MAX_PENDING:
            try:
                self.book.check_room()
            except BusyError:
                return
            raise AssertionError("a full book took another half message")
        self.book.check_room()
        off = self.next_offset
        self.next_offset += 3  # op records sit between half messages
        self.book.add(PendingHalf(off, "g", "c", "t", 0, 0, after, interval, max_checks,
                                  self.now + after / 1000))
        self.seen[off] = Seen(self.now, after / 1000, interval / 1000, max_checks)

    @rule(ms=st.integers(0, 2500))
    def time_passes(self, ms: int) -> None:
        self.now += ms / 1000

    @rule()
    def check_round(self) -> None:
        for h, out_of_checks in self.book.due(self.now):
            s = self.seen[h.offset]
            assert h.state is HalfPhase.PREPARED, "a committing half message was checked"
            assert self.now + EPS >= s.stored + s.after, "checked before check_after"
            if s.last_check is not None:
                assert self.now + EPS >= s.last_check + s.interval, "checked within the interval"
            if out_of_checks:
                assert s.checks == s.max_checks == h.checks
                self._decide(h, OP_ROLLBACK, "max_checks")
                continue
            s.checks += 1
            s.last_check = self.now
            assert h.checks == s.checks <= s.max_checks

    @rule(data=st.data(), answer=st.sampled_from(
        [HalfEvent.COMMIT, HalfEvent.ROLLBACK, HalfEvent.UNKNOWN]))
    def answer(self, data: st.DataObject, answer: HalfEvent) -> None:
        if not self.seen:
            return
        off = data.draw(st.sampled_from(sorted(self.seen)))
        h = self.book.get(off)
        if h is None:  # resolved: the same answer (or UNKNOWN) is answered, the other refused
            state = HalfPhase(self.decided[off])
            if (state, answer) in TRANSITIONS:
                return
            try:
                self.book.step(PendingHalf(off, "g", "", "t", 0, 0, 0, 0, 0, 0.0, state=state),
                               answer)
            except HalfMessageResolvedError:
                return
            raise AssertionError(f"a {state} transaction took {answer}")
        if h.state is HalfPhase.COMMITTING:
            if answer is HalfEvent.ROLLBACK:
                try:
                    self.book.step(h, answer)
                except HalfMessageResolvedError:
                    assert h.state is HalfPhase.COMMITTING
                    return
                raise AssertionError("a committing transaction was rolled back")
            self.book.step(h, answer)  # joins the commit in progress
            assert h.state is HalfPhase.COMMITTING
            return
        if answer is HalfEvent.ROLLBACK:
            self._decide(h, OP_ROLLBACK, "producer")
        elif answer is HalfEvent.COMMIT:
            self.book.step(h, answer)
            assert h.state is HalfPhase.COMMITTING
        else:
            self.book.step(h, answer)
            assert h.state is HalfPhase.PREPARED

    @rule(data=st.data(), durable=st.booleans())
    def copy_settles(self, data: st.DataObject, durable: bool) -> None:
        committing = sorted(o for o, h in self.book.pending.items()
                            if h.state is HalfPhase.COMMITTING)
        if not committing:
            return
        h = self.book.pending[data.draw(st.sampled_from(committing))]
        if durable:
            self._decide(h, OP_COMMIT, "producer")
        else:
            self.book.step(h, HalfEvent.COPY_LOST)
            assert h.state is HalfPhase.PREPARED

    @precondition(lambda self: bool(self.decided))
    @rule()
    def decided_ones_refuse_the_other_answer(self) -> None:
        for off, state in self.decided.items():
            other = HalfEvent.ROLLBACK if state == COMMITTED else HalfEvent.COMMIT
            h = PendingHalf(off, "g", "", "t", 0, 0, 0, 0, 0, 0.0, state=HalfPhase(state))
            try:
                self.book.step(h, other)
            except HalfMessageResolvedError:
                continue
            raise AssertionError(f"{state} became {h.state}")

    def _decide(self, h: PendingHalf, op: str, source: str) -> None:
        props = {HALF_OP: op, HALF_SOURCE: source}
        if op == OP_COMMIT:
            props[HALF_MSGID] = encode_msg_id(1, 0, h.offset)
        out = outcome_of(h.group, h.topic, h.queue, props, int(self.now * 1000))
        assert h.offset not in self.decided, "decided twice"
        self.book.resolve(h, out)
        self.decided[h.offset] = out.state
        self.outcomes[h.offset] = out
        assert h.state.value == out.state

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def outcomes_never_change(self) -> None:
        for off, state in self.decided.items():
            assert self.book.get(off) is None
            out = self.book.outcome(off)
            if out is not None:  # still remembered: the first outcome
                assert out == self.outcomes[off] and out.state == state

    @invariant()
    def limits_hold(self) -> None:
        assert len(self.book.pending) <= MAX_PENDING
        remembered = sum(1 for off in self.decided if self.book.outcome(off) is not None)
        assert remembered <= MAX_PENDING
        for h in self.book.pending.values():
            assert h.state in (HalfPhase.PREPARED, HalfPhase.COMMITTING)
            assert h.checks <= h.max_checks

    @invariant()
    def floor_is_the_oldest_pending(self) -> None:
        pending = [o for o in self.seen if o not in self.decided]
        assert self.book.floor([], self.next_offset) == min(pending, default=self.next_offset)


HalfCheckerModel.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_half_checker_model = HalfCheckerModel.TestCase
