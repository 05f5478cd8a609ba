"""Clocks. Code that needs time takes a :class:`Clock`; tests pass ``ferrymq.testing.FakeClock``.

``wall_ms`` is for timestamps people read (born, stored, seek by time, retention ages);
``monotonic`` for every duration (timeouts, leases, sessions), so a wall-clock jump never
expires or extends them.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Source of time."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""
        ...

    def wall_ms(self) -> int:
        """Milliseconds since the Unix epoch."""
        ...


class SystemClock:
    """The real clocks."""

    __slots__ = ()

    def monotonic(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    def wall_ms(self) -> int:
        """``time.time()`` in whole milliseconds."""
        return time.time_ns() // 1_000_000


SYSTEM_CLOCK = SystemClock()
