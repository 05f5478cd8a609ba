"""The leader's view of its followers: positions, the high watermark, ISR shrink and expand.

Theory of operation
-------------------
Pure bookkeeping (no I/O, no clock of its own: times come in as arguments), so that it can be
swapped for the controller's ISR rules or driven by a model test.

Each follower's fetch says where its log ends and what of it is durable (:meth:`IsrTracker.
on_fetch`). Its **position** is the durable offset in sync flush mode, the log end in async mode
(what "stored" means in each mode); the leader's own position likewise. The **high watermark**
is the lowest position over the in-sync replicas, and never goes back.

Kafka's rule for being caught up (``lastCaughtUpTimeMs``): a fetch at or past the leader's end
now makes the follower caught up now; a fetch at or past the end the leader had at the
follower's previous fetch makes it caught up as of that previous fetch (it keeps pace with a
leader that appends all the time). A member not caught up for ``lag_ms``, and not at the
leader's end, is proposed for removal; a non-member whose position reached the high watermark
(and the start of the leader's epoch, so that it truncated first) is proposed for return.
The store adds only members whose broker is alive (:func:`ferrymq.cluster.isr.change_isr`): one
it left out (a follower killed while nothing was written looks caught up) stays out, and is not
proposed again before it fetches again, :data:`LEFT_OUT_RETRY_MS` later or more (Kafka's KIP-841
refuses such a member likewise).

A proposal is written by compare-and-swap by the cluster node; until it is committed or
refused, the **maximal ISR** (committed members and proposed ones) is what the high watermark
is computed over (Kafka's KIP-497): a follower being added counts at once, one being removed
still counts until the removal is committed, so the high watermark never covers data a
committed in-sync replica might lack. ``min_insync`` is checked against the committed set.
"""

from __future__ import annotations

from dataclasses import dataclass

UNKNOWN = -1
"""Position of a follower that has not fetched since this broker became leader."""
LEFT_OUT_RETRY_MS = 500
"""A follower the store left out of a proposed ISR (its broker was not alive) is proposed
again only after a fetch this much later or more: a dead one never, a live one whose broker
key is missing for a moment (its lease being renewed) at most twice a second, not at every
fetch."""


@dataclass(slots=True)
class FollowerPosition:
    """What the leader knows of one follower."""

    end: int = UNKNOWN
    durable: int = UNKNOWN
    caught_up_ms: int = 0
    """The last time it was caught up with the leader (see the module docstring)."""
    last_fetch_ms: int = 0
    leader_end_at_last_fetch: int = 0
    left_out_ms: int = -LEFT_OUT_RETRY_MS
    """When the store last left it out of an ISR proposed with it (its broker was not alive):
    it is proposed again only after a fetch :data:`LEFT_OUT_RETRY_MS` later or more."""


class IsrTracker:
    """One queue's followers as its leader sees them."""

    def __init__(self, leader: int, replicas: list[int], isr: list[int], *, sync: bool,
                 lag_ms: int, now_ms: int) -> None:
        self.leader = leader
        self.sync = sync
        self.lag_ms = lag_ms
        self.isr: list[int] = list(isr)
        """The committed in-sync replicas (as the metadata store has them)."""
        self.pending: list[int] | None = None
        """An ISR proposed and not yet committed or refused."""
        self.followers: dict[int, FollowerPosition] = {}
        self.set_replicas(replicas, now_ms)

    def set_replicas(self, replicas: list[int], now_ms: int) -> None:
        """The queue's replicas: a follower new to this leader gets the benefit of the doubt
        (caught up now), as Kafka gives followers when a leader starts."""
        self.followers = {r: self.followers.get(r) or FollowerPosition(caught_up_ms=now_ms)
                          for r in replicas if r != self.leader}

    def position(self, replica: int) -> int:
        """A follower's position (durable offset in sync mode, log end in async mode)."""
        f = self.followers.get(replica)
        if f is None:
            return UNKNOWN
        return f.durable if self.sync else f.end

    def on_fetch(self, replica: int, end: int, durable: int, leader_end: int,
                 now_ms: int) -> None:
        """A fetch from ``replica``: its log end and durable offset; the leader's log end now."""
        f = self.followers.get(replica)
        if f is None:
            return
        if end >= leader_end:
            f.caught_up_ms = now_ms
        elif end >= f.leader_end_at_last_fetch:
            f.caught_up_ms = max(f.caught_up_ms, f.last_fetch_ms)
        f.end = end
        f.durable = min(durable, end)
        f.last_fetch_ms = now_ms
        f.leader_end_at_last_fetch = leader_end

    def maximal(self) -> list[int]:
        """Committed members and proposed ones (what the high watermark is computed over)."""
        if self.pending is None:
            return self.isr
        return self.isr + [r for r in self.pending if r not in self.isr]

    def high_watermark(self, leader_position: int, current: int) -> int:
        """The high watermark: the lowest position over the maximal ISR, the leader's
        included, never below ``current``."""
        hw = leader_position
        for r in self.maximal():
            if r != self.leader:
                hw = min(hw, self.position(r))
        return max(hw, current)

    def proposal(self, now_ms: int, leader_end: int, hw: int,
                 epoch_start: int) -> list[int] | None:
        """The ISR to propose now (a shrink first, then an expansion), or None. Never while a
        proposal is pending; never without the leader."""
        if self.pending is not None:
            return None
        lagging = [r for r in self.isr if r != self.leader and r in self.followers
                   and self.lagging(r, now_ms, leader_end)]
        if lagging:
            return [r for r in self.isr if r not in lagging]
        back = [r for r, f in self.followers.items() if r not in self.isr
                and self.position(r) >= max(hw, 0) and f.end >= epoch_start
                and f.last_fetch_ms >= f.left_out_ms + LEFT_OUT_RETRY_MS]
        if back:
            return [*self.isr, *sorted(back)]
        return None

    def on_result(self, proposed: list[int], committed: list[int] | None,
                  now_ms: int) -> None:
        """The outcome of the proposal ``proposed``: the ISR the store committed for it (a
        member added whose broker was not alive is left out: it stays out, and is proposed
        again only once it fetches again, :data:`LEFT_OUT_RETRY_MS` later or more), or None
        when it was refused (a stale view: the current record comes in its place)."""
        if self.pending == proposed:
            self.pending = None
        if committed is None:
            return
        for r in proposed:
            f = self.followers.get(r)
            if f is not None and r not in committed:
                f.left_out_ms = now_ms
        self.isr = list(committed)

    def lagging(self, replica: int, now_ms: int, leader_end: int) -> bool:
        """Whether ``replica`` has not been caught up for ``lag_ms``. A follower at the
        leader's end is caught up whenever it fetched (Kafka's rule: an idle follower waiting
        in a long poll, or a dead one while nothing is written, holds nothing back)."""
        f = self.followers.get(replica)
        if f is None or f.end == leader_end:
            return False
        return now_ms - f.caught_up_ms > self.lag_ms
