"""Request and flush statistics the broker keeps for ``/metrics``: plain counters, no locks.

Theory of operation
-------------------
Most of what ``/metrics`` shows is read from the broker's state at scrape time
(:mod:`ferrymq.ops.metrics`). What does not exist as state is kept here, as cheaply as it can
be: a :class:`Histogram` is a list of bucket counts, a sum and a count, updated once per
PRODUCE or FETCH request (:class:`RequestStats`, by the connection) and once per flush round
(:class:`FlushStats`, by the flusher thread): one bisect and four additions, no per-message
work, no lock. The flusher thread is the only writer of its histograms and the event loop the
only writer of the request ones; a scrape reading while a writer adds may see one observation
half counted (the count without the sum), which the next scrape corrects, as with any
Prometheus counter read mid-update.
"""

from __future__ import annotations

from bisect import bisect_left

__all__ = ["FLUSH_ROUND_BUCKETS", "LATENCY_BUCKETS_S", "FlushStats", "Histogram", "RequestStats"]

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0)
"""Upper bounds (seconds) of the request and fsync latency histograms."""
FLUSH_ROUND_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Upper bounds of the group-commit size histogram (files fsynced in one flush round)."""


class Histogram:
    """Cumulative-at-read bucket counts of observations (Prometheus' histogram, unlocked)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Count one observation of ``value``."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` per bucket, ending with ``+Inf`` (the exposition form)."""
        out: list[tuple[str, int]] = []
        total = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out


class RequestStats:
    """Requests of one API (PRODUCE or FETCH): count, bytes in and out, latency."""

    __slots__ = ("bytes_in", "bytes_out", "count", "latency")

    def __init__(self) -> None:
        self.count = 0
        self.bytes_in = 0
        """Request frame payload bytes."""
        self.bytes_out = 0
        """Response bytes written (0 for unanswered one-way requests)."""
        self.latency = Histogram(LATENCY_BUCKETS_S)
        """From the frame read to the answer (a FETCH's long-poll wait included)."""

    def record(self, seconds: float, bytes_in: int, bytes_out: int) -> None:
        """Count one answered request."""
        self.count += 1
        self.bytes_in += bytes_in
        self.bytes_out += bytes_out
        self.latency.observe(seconds)


class FlushStats:
    """The flusher's rounds: how long each took and how many files it fsynced together."""

    __slots__ = ("round_seconds", "round_size")

    def __init__(self) -> None:
        self.round_seconds = Histogram(LATENCY_BUCKETS_S)
        """Duration of one flush round (its fsyncs, together or in turn)."""
        self.round_size = Histogram(FLUSH_ROUND_BUCKETS)
        """Files (queues, journals) fsynced in one round: the group commit's width."""

    def record(self, seconds: float, files: int) -> None:
        """Count one flush round (called by the flusher thread)."""
        self.round_seconds.observe(seconds)
        self.round_size.observe(files)
