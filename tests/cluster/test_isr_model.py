"""Model test of the leader's ISR bookkeeping
(:class:`~ferrymq.cluster.replication.isr.IsrTracker`), pure.

Rules: the leader appends and flushes, followers fetch (their log end and durable offset only
grow, up to the leader's), time passes, the leader proposes what :meth:`IsrTracker.proposal`
says, and the store commits or refuses the proposal (as the node's compare-and-swap would).
Both flush modes. Invariants after every step:

* the high watermark never goes back and never passes the leader's own position (durable
  offset with ``flush sync``, log end with ``flush async``);
* every member of the maximal ISR (committed and proposed: KIP-497) holds everything under the
  high watermark, so a member the store committed, or may have committed, can be elected
  without losing an acknowledged record;
* a proposal takes a follower back only once its position reached the high watermark and the
  start of the leader's epoch, and drops only followers not caught up for ``replica_lag_ms``:
  one whose fetch reached the leader's end within the lag is never dropped, and one behind the
  leader's end that has not fetched for longer than the lag always is.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ferrymq.cluster.replication.isr import IsrTracker

LEADER = 1
FOLLOWERS = (2, 3, 4)
LAG_MS = 1_000


class IsrModel(RuleBasedStateMachine):
    @initialize(sync_mode=st.booleans(), start=st.integers(0, 50))
    def elected(self, sync_mode: bool, start: int) -> None:
        self.sync = sync_mode
        self.now = 10_000
        self.end = self.durable = start
        self.epoch_start = start
        self.tracker = IsrTracker(LEADER, [LEADER, *FOLLOWERS], [LEADER], sync=sync_mode,
                                  lag_ms=LAG_MS, now_ms=self.now)
        self.pos = {b: (0, 0) for b in FOLLOWERS}  # (log end, durable)
        self.reached_end_ms = {b: self.now for b in FOLLOWERS}
        self.fetched_ms = {b: self.now for b in FOLLOWERS}
        self.hw = self.tracker.high_watermark(self.own(), 0)

    def own(self) -> int:
        return self.durable if self.sync else self.end

    def position(self, b: int) -> int:
        end, durable = self.pos[b]
        return durable if self.sync else end

    @rule(n=st.integers(1, 20), flush=st.booleans())
    def leader_appends(self, n: int, flush: bool) -> None:
        self.end += n
        if flush:
            self.durable = self.end

    @rule()
    def leader_flushes(self) -> None:
        self.durable = self.end

    @rule(b=st.sampled_from(FOLLOWERS), data=st.data())
    def follower_fetches(self, b: int, data: st.DataObject) -> None:
        end, durable = self.pos[b]
        new_end = data.draw(st.integers(end, self.end))
        new_durable = data.draw(st.integers(durable, new_end))
        self.pos[b] = (new_end, new_durable)
        self.tracker.on_fetch(b, new_end, new_durable, self.end, self.now)
        if new_end >= self.end:
            self.reached_end_ms[b] = self.now
        self.fetched_ms[b] = self.now

    @rule(ms=st.integers(1, 800))
    def time_passes(self, ms: int) -> None:
        self.now += ms

    @rule()
    def leader_proposes(self) -> None:
        t = self.tracker
        self.hw = t.high_watermark(self.own(), self.hw)
        proposal = t.proposal(self.now, self.end, self.hw, self.epoch_start)
        if proposal is None:
            return
        assert LEADER in proposal
        for b in set(t.isr) - set(proposal):  # dropped: not caught up for the lag
            assert self.now - self.reached_end_ms[b] > LAG_MS, (b, self.now, self.reached_end_ms)
        for b in set(proposal) - set(t.isr):  # taken back: at the HW and past the epoch start
            assert self.position(b) >= self.hw and self.pos[b][0] >= self.epoch_start
        t.pending = proposal

    @rule(commit=st.booleans())
    def store_answers(self, commit: bool) -> None:
        t = self.tracker
        if t.pending is None:
            return
        if commit:
            t.isr = list(t.pending)
        t.pending = None

    @invariant()
    def every_maximal_member_holds_what_the_hw_covers(self) -> None:
        hw = self.tracker.high_watermark(self.own(), self.hw)
        assert hw >= self.hw and hw <= max(self.own(), self.hw)
        self.hw = hw
        for b in self.tracker.maximal():
            if b != LEADER:
                assert self.position(b) >= hw, (b, self.pos, hw, self.tracker.maximal())

    @invariant()
    def a_follower_caught_up_within_the_lag_stays(self) -> None:
        t = self.tracker
        for b in t.isr:
            if b == LEADER:
                continue
            lagging = t.lagging(b, self.now, self.end)
            if self.now - self.reached_end_ms[b] <= LAG_MS:
                assert not lagging
            if self.now - self.fetched_ms[b] > LAG_MS and self.pos[b][0] < self.end:
                assert lagging  # silent for longer than the lag, and behind


IsrModel.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_isr_model = IsrModel.TestCase
