"""The scheduler's clock: monotonic time from an anchor, deaf to wall-clock jumps while the
broker runs; the anchor is resumed across restarts (time while down counts as elapsed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from ferrymq.broker.config import BrokerConfig
from ferrymq.broker.scheduler import Scheduler
from ferrymq.testing import FakeClock

HOUR_MS = 3_600_000


def make(clock: FakeClock, path: Path) -> Scheduler:
    return Scheduler(BrokerConfig(), cast(Any, None), cast(Any, None), clock, path)


def test_clock_counts_monotonic_time_and_ignores_wall_jumps(tmp_path: Path) -> None:
    clock = FakeClock()
    s = make(clock, tmp_path)
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
    s.store.close()


def test_skew_of_a_new_entry_is_clock_minus_append_time_and_small_ones_snap(tmp_path: Path) -> None:
    clock = FakeClock()
    s = make(clock, tmp_path)
    assert s._skew(clock.wall_ms()) == 0
    assert s._skew(clock.wall_ms() + 2) == 0  # rounding between the clocks
    assert s._skew(clock.wall_ms() - 40) == 0  # stored 40 ms ago: the delay counts from then
    clock.wall_offset_ms += HOUR_MS
    assert s._skew(clock.wall_ms()) == -HOUR_MS  # its delay counts from now on this clock
    clock.wall_offset_ms -= 2 * HOUR_MS
    append_time = clock.wall_ms() + 2 * HOUR_MS  # a queue's append time does not go back
    assert s._skew(append_time) == -HOUR_MS
    assert (s._skew_lo, s._skew_hi) == (-HOUR_MS, 0)
    s.store.close()


def test_a_restart_resumes_the_clock_and_counts_downtime(tmp_path: Path) -> None:
    clock = FakeClock()
    s = make(clock, tmp_path)
    clock.wall_offset_ms -= HOUR_MS  # a backward jump while running
    clock.advance(2.0)
    s.store.write_watermarks({}, s._clock_meta())
    t_stop = s.now_ms()
    s.store.close()
    clock.advance(10.0)  # down for 10 s
    again = make(clock, tmp_path)
    again._resume_clock()
    assert again.now_ms() == t_stop + 10_000  # not held back by the hour
    assert again.offset_ms() == HOUR_MS
    again.store.close()
    clock.wall_offset_ms -= HOUR_MS  # the wall clock went back while the broker was down
    third = make(clock, tmp_path)
    third._resume_clock()
    assert third.now_ms() == t_stop  # time while down counts as none
    third.store.close()
