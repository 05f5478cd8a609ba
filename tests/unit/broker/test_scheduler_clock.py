"""The scheduler's clock: monotonic time from an anchor, deaf to wall-clock jumps while the
broker runs; the anchor is resumed across restarts (time while down counts as elapsed)."""

from __future__ import annotations

from pathlib import Path

from ferrymq.broker.scheduler.clock import CLOCK_SAVE_MS, SchedulerClock
from ferrymq.storage.schedule import ScheduleStore
from ferrymq.testing import FakeClock

HOUR_MS = 3_600_000


def test_clock_counts_monotonic_time_and_ignores_wall_jumps() -> None:
    clock = FakeClock()
    s = SchedulerClock(clock)
    t0 = s.now_ms()
    assert t0 == clock.wall_ms() and s.offset_ms() == 0
    clock.advance(1.5)
    assert s.now_ms() == t0 + 1500
    clock.wall_offset_ms -= HOUR_MS  # back an hour: nothing is held
    clock.advance(0.25)
    assert s.now_ms() == t0 + 1750
    assert s.offset_ms() == HOUR_MS
    clock.wall_offset_ms += 2 * HOUR_MS  # forward an hour past where it was: nothing fires early
    assert s.now_ms() == t0 + 1750
    assert s.offset_ms() == -HOUR_MS
    assert s.to_wall(int(t0) + 2750) == clock.wall_ms() + 1000  # due in 1 s by the wall clock


def test_skew_of_a_new_entry_is_clock_minus_append_time_and_small_ones_snap() -> None:
    clock = FakeClock()
    s = SchedulerClock(clock)
    assert s.skew(clock.wall_ms()) == 0
    assert s.skew(clock.wall_ms() + 2) == 0  # rounding between the clocks
    assert s.skew(clock.wall_ms() - 40) == 0  # stored 40 ms ago: the delay counts from then
    clock.wall_offset_ms += HOUR_MS
    assert s.skew(clock.wall_ms()) == -HOUR_MS  # its delay counts from now on this clock
    clock.wall_offset_ms -= 2 * HOUR_MS
    append_time = clock.wall_ms() + 2 * HOUR_MS  # a queue's append time does not go back
    assert s.skew(append_time) == -HOUR_MS
    assert (s.skew_lo, s.skew_hi) == (-HOUR_MS, 0)


def test_a_restart_resumes_the_clock_and_counts_downtime(tmp_path: Path) -> None:
    clock = FakeClock()
    s = SchedulerClock(clock)
    store = ScheduleStore(tmp_path)
    clock.wall_offset_ms -= HOUR_MS  # a backward jump while running
    clock.advance(2.0)
    store.write_watermarks({}, s.meta())
    t_stop = s.now_ms()
    clock.advance(10.0)  # down for 10 s
    again = SchedulerClock(clock)
    again.resume(store.read_clock())
    assert again.now_ms() == t_stop + 10_000  # not held back by the hour
    assert again.offset_ms() == HOUR_MS
    clock.wall_offset_ms -= HOUR_MS  # the wall clock went back while the broker was down
    third = SchedulerClock(clock)
    third.resume(store.read_clock())
    assert third.now_ms() == t_stop  # time while down counts as none
    store.close()


def test_a_moved_clock_is_checkpointed_once() -> None:
    clock = FakeClock()
    s = SchedulerClock(clock)
    assert not s.moved(s.meta())
    clock.wall_offset_ms += CLOCK_SAVE_MS // 2  # rounding noise: not worth a checkpoint
    assert not s.moved(s.meta())
    clock.wall_offset_ms += HOUR_MS  # a jump: checkpointed, then counts as saved
    assert s.moved(s.meta())
    assert not s.moved(s.meta())
    s.skew(clock.wall_ms())  # a new skew widens the range: checkpointed too
    assert s.moved(s.meta())
    assert not s.moved(s.meta())


def test_a_restart_without_a_jump_resumes_on_the_wall_clock_never_ahead() -> None:
    """The checkpoint reads S (rounded) and the wall clock (truncated) one after the other, so
    they differ by a millisecond or two without any jump; resumed as it was, S ran ahead of the
    wall clock and entries fired that much early (test_delayed_kill9 saw a copy stored 1 ms
    before its due time)."""
    clock = FakeClock()
    s = SchedulerClock(clock)
    s_ms, wall_ms, lo, hi = s.meta()
    clock.advance(5.0)  # down for 5 s
    again = SchedulerClock(clock)
    again.resume((s_ms + 2, wall_ms, lo, hi))  # the rounding between the two readings
    assert again.now_ms() == clock.wall_ms()
    assert again.offset_ms() == 0
    late = SchedulerClock(clock)  # behind by rounding: also on the wall clock (not late)
    late.resume((s_ms - 1, wall_ms, lo, hi))
    assert late.now_ms() == clock.wall_ms()
