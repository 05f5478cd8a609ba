"""Clocks. Code that needs time takes a :class:`Clock`; tests pass ``ferrymq.testing.FakeClock``.

``wall_ms`` is for timestamps people read (born, stored, seek by time, retention ages);
``monotonic`` for every duration (timeouts, leases, sessions), so a wall-clock jump never
expires or extends them.
"""

from __future__ import annotations

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


class OffsetFileClock:
    """The system clocks, with the wall clock shifted by the ms count in a file (re-read at
    most every 50 ms; a missing or unreadable file means 0): the clock seam of a broker
    subprocess in tests (``Faults.clock_file``, :mod:`ferrymq._faults`)."""

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
