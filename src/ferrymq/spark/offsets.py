"""Offsets as Spark stores them, and the arithmetic of micro-batches (pure: no I/O).

Layout of an offset (the JSON Spark writes into ``<checkpoint>/offsets/<batch>``)::

    {"orders": {"0": 120, "1": 118}, "@from": {"orders": {"0": 100, "1": 100}}}

* ``topic -> queue -> next offset to read`` (an exclusive end), as Spark's Kafka source does;
  topics sorted, queues in numeric order, so equal offsets are equal strings (Spark compares
  them as strings).
* ``@from`` (not a valid topic name) holds where the micro-batch that ends here *started*.
  Spark does not persist a Python source's initial offset (Kafka's source writes
  ``sources/0``): when a query restarts before batch 0 commits, Spark calls ``initialOffset()``
  again and replays batch 0 with a possibly different start. ``partitions()`` therefore reads
  from ``@from`` of the end offset, which is in the write-ahead log, so a replayed batch reads
  exactly the range it was planned with, whatever ``latest`` or ``committed`` resolve to now.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from ferrymq.spark.options import QueueOffsets

FROM_KEY = "@from"


def to_json_dict(offsets: QueueOffsets, start: QueueOffsets | None = None) -> dict[str, Any]:
    """Offsets (and the batch's start) as the deterministic JSON-safe dict Spark stores."""
    out: dict[str, Any] = {}
    for topic, queue in sorted(offsets):
        out.setdefault(topic, {})[str(queue)] = int(offsets[(topic, queue)])
    if start is not None:
        out[FROM_KEY] = to_json_dict(start)
    return out


def from_json_dict(value: Mapping[str, Any]) -> QueueOffsets:
    """The ``topic -> queue -> offset`` part of a stored offset."""
    out: QueueOffsets = {}
    for topic, queues in value.items():
        if topic == FROM_KEY:
            continue
        for q, off in queues.items():
            out[(topic, int(q))] = int(off)
    return out


def batch_start(end: Mapping[str, Any]) -> QueueOffsets | None:
    """Where the micro-batch ending at ``end`` started (None: not recorded)."""
    start = end.get(FROM_KEY)
    return from_json_dict(start) if isinstance(start, Mapping) else None


def cap_offsets(start: QueueOffsets, latest: QueueOffsets, max_rows: int) -> QueueOffsets:
    """At most ``max_rows`` records past ``start`` (exactly that many when the backlog is
    larger), shared in proportion to each queue's backlog; a queue with a backlog always
    advances by at least one (never starved, as in Spark's Kafka source, which may exceed the
    limit by a few records when many queues have tiny backlogs)."""
    backlog = {tq: max(0, latest[tq] - start.get(tq, latest[tq])) for tq in latest}
    total = sum(backlog.values())
    if total <= max_rows:
        return dict(latest)
    take: dict[tuple[str, int], int] = {}
    remainders: list[tuple[float, tuple[str, int]]] = []
    for tq, n in backlog.items():
        share = n * max_rows / total
        take[tq] = min(n, math.floor(share) if share >= 1 else math.ceil(share))
        remainders.append((share - math.floor(share), tq))
    left = max_rows - sum(take.values())
    for _, tq in sorted(remainders, key=lambda r: (-r[0], r[1])):
        if left <= 0:
            break
        if take[tq] < backlog[tq]:
            take[tq] += 1
            left -= 1
    return {tq: start.get(tq, latest[tq]) + take[tq] for tq in latest}


def split_range(start: int, end: int, pieces: int, max_records: int | None) -> list[tuple[int, int]]:
    """``[start, end)`` split into about ``pieces`` equal parts, none above ``max_records``."""
    n = end - start
    if n <= 0:
        return []
    parts = max(1, pieces)
    if max_records:
        parts = max(parts, math.ceil(n / max_records))
    parts = min(parts, n)
    step = n / parts
    bounds = [start + round(i * step) for i in range(parts)] + [end]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
