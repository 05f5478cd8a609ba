"""Backoff policy: exponential with full jitter, capped (redis-py style small policy object)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Delays for attempt 1, 2, ... : ``uniform(0, min(cap, base * 2**(n-1)))``, at least
    ``floor``.

    Args:
        base_s: delay scale of the first retry.
        cap_s: largest delay.
        floor_s: smallest delay (so a retry never spins).
        rng: injected randomness (tests pass a seeded one).
    """

    base_s: float = 0.05
    cap_s: float = 2.0
    floor_s: float = 0.01
    rng: random.Random = field(default_factory=random.Random)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based)."""
        top = min(self.cap_s, self.base_s * (2 ** max(0, min(attempt - 1, 30))))
        return max(self.floor_s, self.rng.uniform(top / 2, top))
