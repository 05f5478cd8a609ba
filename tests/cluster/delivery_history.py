"""The history checker of the delivery-group failover tests: what producers had acknowledged,
what push consumers' handlers did with each message, and the promises of docs/delivery.md ("In a
cluster") checked against it.

A *holding* is one handler run of one message by one consumer, from its start to its end; a
handler runs only while its consumer holds a lease on the message, so two holdings of one
message that overlap in time are two live members holding it at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Holding:
    consumer: str
    reconsume: int
    start: float
    end: float = float("inf")
    ok: bool = False
    where: str = ""
    """Which copy: ``topic/queue@offset`` and the lease (two offsets: stored twice)."""


@dataclass
class DeliveryHistory:
    """Everything the test saw, with monotonic times."""

    sent: set[bytes] = field(default_factory=set)
    """Bodies a producer had acknowledged (``acks="all"``)."""
    attempted: set[bytes] = field(default_factory=set)
    """Bodies a producer tried to send (acknowledged or not)."""
    holdings: dict[bytes, list[Holding]] = field(default_factory=dict)
    kills: list[tuple[float, float]] = field(default_factory=list)
    """Per kill: when, and when the first handler run after it succeeded (its recovery)."""

    def begin(self, body: bytes, consumer: str, reconsume: int, where: str = "") -> Holding:
        h = Holding(consumer, reconsume, time.monotonic(), where=where)
        self.holdings.setdefault(body, []).append(h)
        return h

    def done(self) -> set[bytes]:
        """Bodies some handler finished with success."""
        return {b for b, hs in self.holdings.items() if any(h.ok for h in hs)}


@dataclass
class Verdict:
    lost: list[bytes]
    """Acknowledged by the broker to a producer, never handled with success."""
    phantom: list[bytes]
    """Handled, never sent."""
    overlapping: list[bytes]
    """Held by two handler runs at once."""
    redone: list[bytes]
    """Handled with success more than once."""
    redone_outside_bound: list[bytes]
    """Of ``redone``: whose first success was not within ``bound_s`` before a kill's recovery
    (docs/delivery.md: an ack that the coordinator had not replicated when it was killed, or
    that was in flight during the failover, may be lost: the message comes again, once)."""


def check(hist: DeliveryHistory, bound_s: float) -> Verdict:
    """Check ``hist`` (see :class:`Verdict`)."""
    done = hist.done()
    overlapping: list[bytes] = []
    redone: list[bytes] = []
    outside: list[bytes] = []
    for body, hs in hist.holdings.items():
        runs = sorted(hs, key=lambda h: h.start)
        latest = float("-inf")  # the latest end of the runs started so far
        for h in runs:
            if h.start < latest:
                overlapping.append(body)
                break
            latest = max(latest, h.end)
        oks = [h for h in runs if h.ok]
        if len(oks) > 1:
            redone.append(body)
            first = oks[0].end
            if not any(kill - bound_s <= first <= recovered for kill, recovered in hist.kills):
                outside.append(body)
    return Verdict(sorted(hist.sent - done), sorted(set(hist.holdings) - hist.attempted),
                   sorted(overlapping), sorted(redone), sorted(outside))


def explain(hist: DeliveryHistory, bodies: list[bytes], limit: int = 3) -> str:
    """The holdings of ``bodies`` and the faults, relative to the first fault (a failure's
    message)."""
    t0 = hist.kills[0][0] if hist.kills else 0.0
    lines = [f"faults (start, recovered) s: {[(round(k - t0, 3), round(r - t0, 3)) for k, r in hist.kills]}"]
    for b in bodies[:limit]:
        lines.append(f"{b!r}: " + "; ".join(
            f"{h.consumer} rc={h.reconsume} {h.where} {h.start - t0:.3f}..{h.end - t0:.3f} ok={h.ok}"
            for h in sorted(hist.holdings.get(b, []), key=lambda h: h.start)))
    return "\n".join(lines)

