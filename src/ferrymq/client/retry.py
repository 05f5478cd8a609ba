"""Backoff policy: exponential with full jitter, capped (redis-py style small policy object),
and the broker's retry-after advice on top of it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ferrymq.errors import BrokerError


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

    def delay_after(self, exc: BaseException, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` after ``exc``: the backoff, but
        never less than the retry-after the broker asked for (BUSY, STORAGE_FULL), plus up to
        10 % jitter so that producers refused together do not come back together."""
        delay = self.delay(attempt)
        after = retry_after_s(exc)
        if after > delay:
            delay = after * self.rng.uniform(1.0, 1.1)
        return delay


def retry_after_s(exc: BaseException) -> float:
    """The broker's retry-after advice carried by ``exc`` in seconds (0: none)."""
    return exc.retry_after_ms / 1000 if isinstance(exc, BrokerError) else 0.0


def refused_before_effect(exc: BaseException) -> bool:
    """Whether the broker refused the request before it had any effect and asked for a retry
    (a watermark or a full disk): safe to send again even when the request is not idempotent."""
    return isinstance(exc, BrokerError) and exc.retriable and exc.retry_after_ms > 0
