"""Model test of the leader's ISR bookkeeping (:class:`~ferrymq.cluster.isr.IsrState`), pure.

Rules: the leader appends and flushes, followers fetch (their log end and durable offset only
grow, up to the leader's), time passes, the leader drops the followers ``shrink_candidates``
names and takes back those ``expand_candidates`` names (as it would write them with
``change_isr``). Both flush modes. Invariants after every step:

* the high watermark never goes back and never passes the leader's end or durable offset;
* it is exactly the lowest position over the ISR (durable offsets with ``flush sync``, log ends
  with ``flush async``): taking a follower back at the high watermark never holds it back, so
  every record under it is on every ISR member;
* a follower named for shrinking has not been caught up for longer than ``replica_lag_ms``, one
  whose last fetch reached the leader's end within the lag is never named, and one that has not
  fetched for longer than the lag always is;
* ``acks_all_ok`` is exactly "the ISR has ``min_insync`` members".
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ferrymq.cluster.isr import IsrState
from ferrymq.cluster.model import QueueRecord

LEADER = 1
FOLLOWERS = (2, 3, 4)
LAG_MS = 1_000


class IsrModel(RuleBasedStateMachine):
    @initialize(sync_mode=st.booleans(), start=st.integers(0, 50))
    def elected(self, sync_mode: bool, start: int) -> None:
        self.sync = sync_mode
        self.now = 10_000
        self.end = self.durable = start
        self.record = QueueRecord([LEADER, *FOLLOWERS], LEADER, 3, [LEADER], version=1)
        self.state = IsrState(LEADER, self.record, start, self.now)
        self.pos = {b: (0, 0) for b in FOLLOWERS}  # (log end, durable)
        self.reached_end_ms = {b: self.now for b in FOLLOWERS}
        self.fetched_ms = {b: self.now for b in FOLLOWERS}
        self.hw = self.state.high_watermark(self.end, self.durable, sync_mode=self.sync)

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
        self.state.update_follower(b, new_end, new_durable, self.end, self.now)
        if new_end >= self.end:
            self.reached_end_ms[b] = self.now
        self.fetched_ms[b] = self.now

    @rule(ms=st.integers(1, 800))
    def time_passes(self, ms: int) -> None:
        self.now += ms

    @rule()
    def leader_shrinks(self) -> None:
        out = self.state.shrink_candidates(self.now, LAG_MS)
        for b in out:
            assert self.now - self.reached_end_ms[b] > LAG_MS, (b, self.now, self.reached_end_ms)
        if out:
            self.write([r for r in self.record.isr if r not in out])

    @rule()
    def leader_expands(self) -> None:
        self.hw = self.state.high_watermark(self.end, self.durable, sync_mode=self.sync)
        inn = self.state.expand_candidates(sync_mode=self.sync)
        for b in inn:
            end, durable = self.pos[b]
            assert (durable if self.sync else end) >= max(self.hw, self.state.epoch_start)
        if inn:
            self.write([*self.record.isr, *inn])

    def write(self, isr: list[int]) -> None:
        self.record = replace(self.record, isr=isr, version=self.record.version + 1)
        self.state.apply(self.record)

    @invariant()
    def high_watermark_is_the_lowest_isr_position(self) -> None:
        hw = self.state.high_watermark(self.end, self.durable, sync_mode=self.sync)
        assert hw >= self.hw
        self.hw = hw
        own = self.durable if self.sync else self.end
        lowest = min([own, *(self.pos[b][1] if self.sync else self.pos[b][0]
                             for b in self.record.isr if b != LEADER)])
        assert hw == lowest, (hw, lowest, self.record.isr, self.pos)
        assert hw <= self.end and (not self.sync or hw <= self.durable)

    @invariant()
    def a_follower_caught_up_within_the_lag_stays(self) -> None:
        out = self.state.shrink_candidates(self.now, LAG_MS)
        for b in self.record.isr:
            if b != LEADER and self.now - self.reached_end_ms[b] <= LAG_MS:
                assert b not in out
            if b != LEADER and self.now - self.fetched_ms[b] > LAG_MS:
                assert b in out  # silent for longer than the lag

    @invariant()
    def acks_all_needs_min_insync_members(self) -> None:
        for n in range(1, 5):
            assert self.state.acks_all_ok(n) == (len(self.record.isr) >= n)


IsrModel.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_isr_model = IsrModel.TestCase
