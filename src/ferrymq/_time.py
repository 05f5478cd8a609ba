"""Clocks. Code that needs time takes a :class:`Clock`; tests pass ``ferrymq.testing.FakeClock``.

``wall_ms`` is for timestamps people read (born, stored, seek by time, retention ages);
``monotonic`` for every duration (timeouts, leases, sessions), so a wall-clock jump never
expires or extends them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
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


CLOCK_FILE_ENV = "FERRYMQ_TEST_CLOCK_FILE"
"""The clock seam of a broker process: when this environment variable names a file, the
broker's wall clock is the system's plus the integer number of ms in that file (tests write it
to make the wall clock jump; the monotonic clock is untouched)."""


class OffsetFileClock:
    """The system clocks, with the wall clock shifted by the ms count in a file (re-read at
    most every 50 ms; a missing or unreadable file means 0)."""

    __slots__ = ("_next_read", "_offset", "path")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._next_read = 0.0

    def monotonic(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    def wall_ms(self) -> int:
        """The system's wall clock plus the file's offset."""
        now = time.monotonic()
        if now >= self._next_read:
            self._next_read = now + 0.05
            try:
                self._offset = int(self.path.read_text().strip() or 0)
            except (OSError, ValueError):
                self._offset = 0
        return time.time_ns() // 1_000_000 + self._offset


def clock_from_env() -> Clock:
    """:class:`OffsetFileClock` when :data:`CLOCK_FILE_ENV` is set, else the system clock."""
    path = os.environ.get(CLOCK_FILE_ENV)
    return OffsetFileClock(path) if path else SYSTEM_CLOCK
