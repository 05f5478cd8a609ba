"""Connection limits, produce quotas and the topic auto-creation rate: small policy objects.

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

*:class:`CreationRate`* bounds how fast one client auto-creates topics
(``auto_create_topics_per_minute``): a token bucket of that many topics, refilled continuously,
per user when authentication is on and per connection when it is off (a connection's bucket
goes with it). A client past it is refused with POLICY_VIOLATION and a retry-after; explicit
creation (CREATE_TOPIC, an administrative request) is bounded by ``max_topics`` and
``max_total_queues`` only.

Clocks are injected (monotonic seconds) so the arithmetic is testable without sleeping.
"""

from __future__ import annotations

import weakref
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


class CreationRate:
    """Token buckets of ``per_minute`` creations, one per user name or per connection object.

    Attributes:
        per_minute: creations allowed per minute (and at once, after a quiet minute).
    """

    __slots__ = ("_clock", "_connections", "_users", "per_minute")

    def __init__(self, per_minute: int, clock: Callable[[], float]) -> None:
        """Buckets of ``per_minute`` (>= 1) tokens; ``clock``: monotonic seconds."""
        self.per_minute = per_minute
        self._clock = clock
        self._users: dict[str, _Bucket] = {}
        self._connections: weakref.WeakKeyDictionary[object, _Bucket] = (
            weakref.WeakKeyDictionary())

    def take(self, who: str | object) -> float:
        """Take one creation from ``who``'s bucket (a user name, or a connection object).

        Returns:
            0 when taken; else the seconds until one is available (nothing taken).
        """
        now = self._clock()
        rate = self.per_minute / 60.0
        b = self._users.get(who) if isinstance(who, str) else self._connections.get(who)
        if b is None:
            b = _Bucket(rate, float(self.per_minute), now)
            if isinstance(who, str):
                self._users[who] = b
            else:
                self._connections[who] = b
        b.tokens = min(float(self.per_minute), b.tokens + (now - b.stamp) * rate)
        b.stamp = now
        if b.tokens >= 1:
            b.tokens -= 1
            return 0.0
        return (1 - b.tokens) / rate
