"""Connection limits and produce quotas: small policy objects the connection layer consults.

Theory of operation
-------------------
:class:`ConnectionLimits` admits or refuses a new connection by the total count
(``max_connections``) and the count from its IP address (``max_connections_per_ip``); a
refused connection is answered with one BUSY error frame and closed, never silently dropped.

:class:`ByteRateQuota` is a token bucket per user (``produce_bytes_per_s`` in the users file):
a produce request spends its frame size; when the bucket is in debt the connection stops
reading for as long as it takes the debt to refill (Kafka's throttling: the request is served,
the *next* one waits), so a producer over its quota slows down instead of failing, and the
broker never buffers for it. Quotas are per user, shared by all of the user's connections.

Clocks are injected (monotonic seconds) so the arithmetic is testable without sleeping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MAX_THROTTLE_S = 30.0
"""Longest pause one produce request can earn (a huge request on a tiny quota)."""


class ConnectionLimits:
    """Counts open connections, in total and per IP address."""

    __slots__ = ("max_per_ip", "max_total", "per_ip", "total")

    def __init__(self, max_total: int, max_per_ip: int) -> None:
        self.max_total = max_total
        self.max_per_ip = max_per_ip
        self.total = 0
        self.per_ip: dict[str, int] = {}

    def admit(self, ip: str) -> str | None:
        """Count a new connection from ``ip``; the reason it is refused, or None if admitted."""
        if self.total >= self.max_total:
            return f"too many connections (max_connections={self.max_total})"
        n = self.per_ip.get(ip, 0)
        if n >= self.max_per_ip:
            return f"too many connections from {ip} (max_connections_per_ip={self.max_per_ip})"
        self.per_ip[ip] = n + 1
        self.total += 1
        return None

    def release(self, ip: str) -> None:
        """Forget a connection admitted from ``ip``."""
        n = self.per_ip.get(ip, 0)
        if n <= 1:
            self.per_ip.pop(ip, None)
        else:
            self.per_ip[ip] = n - 1
        self.total = max(0, self.total - 1)


@dataclass(slots=True)
class _Bucket:
    rate: float
    tokens: float
    stamp: float


class ByteRateQuota:
    """Token buckets of bytes per second, one per key (user name)."""

    __slots__ = ("_buckets", "_clock", "burst_s")

    def __init__(self, clock: Callable[[], float], burst_s: float = 1.0) -> None:
        self._clock = clock
        self.burst_s = burst_s
        self._buckets: dict[str, _Bucket] = {}

    def spend(self, key: str, rate: int, nbytes: int) -> float:
        """Spend ``nbytes`` of ``key``'s quota of ``rate`` bytes/s (0: unlimited).

        Returns:
            How long (seconds) the caller should stop reading from this client: 0 while the
            bucket holds tokens, else the time its debt takes to refill (at most
            :data:`MAX_THROTTLE_S`).
        """
        if rate <= 0:
            self._buckets.pop(key, None)
            return 0.0
        now = self._clock()
        b = self._buckets.get(key)
        burst = rate * self.burst_s
        if b is None or b.rate != rate:
            b = self._buckets[key] = _Bucket(float(rate), burst, now)
        b.tokens = min(burst, b.tokens + (now - b.stamp) * b.rate)
        b.stamp = now
        b.tokens -= nbytes
        if b.tokens >= 0:
            return 0.0
        return min(MAX_THROTTLE_S, -b.tokens / b.rate)
