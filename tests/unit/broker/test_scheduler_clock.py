"""The scheduler's clock: advances with the monotonic clock, jumps forward with the wall clock,
never goes back."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from ferrymq.broker.config import BrokerConfig
from ferrymq.broker.scheduler import Scheduler
from ferrymq.testing import FakeClock

HOUR_MS = 3_600_000


def test_clock_follows_monotonic_time_and_forward_wall_jumps_only(tmp_path: Path) -> None:
    clock = FakeClock()
    s = Scheduler(BrokerConfig(), cast(Any, None), cast(Any, None), clock, tmp_path)
    t0 = s.now_ms()
    assert t0 == clock.wall_ms()
    clock.advance(1.5)
    assert s.now_ms() == t0 + 1500
    clock.wall_offset_ms -= HOUR_MS  # the wall clock jumps back an hour: nothing is held
    clock.advance(0.25)
    assert s.now_ms() == t0 + 1750
    clock.wall_offset_ms += 2 * HOUR_MS  # forward an hour past where it was: follow it
    assert s.now_ms() == clock.wall_ms() == t0 + 1750 + HOUR_MS
    clock.advance(0.001)
    assert s.now_ms() == t0 + 1751 + HOUR_MS
    s.store.close()
