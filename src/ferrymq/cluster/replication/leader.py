"""One queue this broker leads: the high watermark, ``acks="all"`` waits, the followers' wake-ups.

Theory of operation
-------------------
:class:`LeaderQueue` is the :class:`~ferrymq.broker.topics.ReplicaRole` of a queue this broker
leads. Its queue's ``visible_end`` is the **high watermark** (HW): the lowest position over the
in-sync replicas, the leader's own included (:mod:`ferrymq.cluster.replication.isr`): the
durable offset in sync flush mode, the log end in async mode. It moves when the leader's log
moves (:meth:`LeaderQueue.on_local_progress`, called by ``QueueState.advance`` after an append
and after a flush round) and when a follower's fetch reports a new position
(:meth:`LeaderQueue.on_follower_fetch`); it never goes back.

Followers long-poll on :attr:`LeaderQueue.fetch_waiters`, woken by every append (not by a timer,
and not by the HW: a follower needs data, and the HW comes with the next answer anyway).

``acks="all"``: a produce is refused before the append when the committed ISR is smaller than
``min_insync`` (:class:`~ferrymq.errors.NotEnoughReplicasError`, Kafka's rule) or the broker is
fenced (its metadata lease may be expiring: :class:`~ferrymq.errors.NotLeaderError`); after the
append it waits (:meth:`LeaderQueue.wait_acks`) until the HW covers its end, then succeeds if the
ISR still has ``min_insync`` members (else NotEnoughReplicasError, Kafka's "after append"). Not
covered within the request's timeout: NotEnoughReplicasError. A fence, a lost leadership or a
shutdown fails every wait at once (retriable: idempotent producers' retries are stored once).

Everything runs on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ferrymq.cluster.replication.isr import IsrTracker
from ferrymq.errors import NotEnoughReplicasError, NotLeaderError
from ferrymq.protocol.messages import Acks

if TYPE_CHECKING:
    from ferrymq.broker.topics import QueueState
    from ferrymq.cluster.model import QueueRecord

AckCallback = Callable[[BaseException | None], None]


class LeaderHost(Protocol):
    """What a :class:`LeaderQueue` needs of the replica manager."""

    broker_id: int
    sync: bool
    fenced: bool
    lag_ms: int

    def now_ms(self) -> int:
        """Monotonic milliseconds."""
        ...

    def propose_isr(self, lq: LeaderQueue, isr: list[int]) -> None:
        """Write a new ISR for ``lq`` (compare-and-swap, in the background); the result comes
        back through :meth:`LeaderQueue.on_isr_result`."""
        ...


class LeaderQueue:
    """This broker leads ``qs`` at ``epoch`` (see the module docstring)."""

    def __init__(self, host: LeaderHost, qs: QueueState, record: QueueRecord,
                 min_insync: int) -> None:
        self.host = host
        self.qs = qs
        self.epoch = record.leader_epoch
        self.min_insync = min_insync
        lg = qs.log
        self.epoch_start = lg.end_offset
        """Where this leader's epoch starts (a follower rejoins the ISR only past it)."""
        self.isr = IsrTracker(host.broker_id, record.replicas,
                              _with(record.isr, host.broker_id), sync=host.sync,
                              lag_ms=host.lag_ms, now_ms=host.now_ms())
        self.hw = min(qs.visible_end, lg.end_offset)
        qs.visible_end = self.hw  # (a follower's visible end is its last known HW)
        self.fetch_waiters: set[asyncio.Future[None]] = set()
        """Followers' long polls, woken by every append."""
        self._woken_at = lg.end_offset
        self._acks: list[tuple[int, int, list[AckCallback | asyncio.TimerHandle | None]]] = []
        self._seq = itertools.count()

    def __str__(self) -> str:
        return f"{self.qs} (leader, epoch {self.epoch})"

    # --- the ReplicaRole of the queue ----------------------------------------------------------

    def on_local_progress(self, qs: QueueState) -> None:
        """The leader's log grew (wake the followers) or became durable (the HW may move)."""
        end = qs.log.end_offset
        if end > self._woken_at:  # (a flush round alone gives followers nothing new)
            self._woken_at = end
            self.wake_fetchers()
        self.update_hw()

    def check_produce(self, acks: int) -> None:
        """Refuse an ``acks="all"`` produce before its append (see the module docstring)."""
        if acks != Acks.ALL:
            return
        if self.host.fenced:
            raise NotLeaderError(self.fenced_message())
        isr = self.isr.isr
        if len(isr) < self.min_insync:
            raise NotEnoughReplicasError(
                f"{self.qs}: {len(isr)} in-sync replica(s) {isr}, fewer than its min_insync "
                f"{self.min_insync}: acks=\"all\" refused (acks=\"leader\" would be accepted)")

    def wait_acks(self, end: int, timeout_ms: int, cb: AckCallback) -> None:
        """Run ``cb`` once the HW covers ``end`` (see the module docstring)."""
        if self.host.fenced:
            cb(NotLeaderError(self.fenced_message()))
            return
        if self.hw >= end:
            cb(self._acks_outcome(end))
            return
        entry: list[AckCallback | asyncio.TimerHandle | None] = [cb, None]
        timeout_ms = timeout_ms if timeout_ms > 0 else self.host.lag_ms
        entry[1] = asyncio.get_running_loop().call_later(
            timeout_ms / 1000, self._expire, entry, end, timeout_ms)
        heapq.heappush(self._acks, (end, next(self._seq), entry))

    # --- followers -------------------------------------------------------------------------------

    def on_follower_fetch(self, replica: int, end: int, durable: int, now_ms: int) -> None:
        """A follower's fetch told its log end and durable offset."""
        self.isr.on_fetch(replica, end, durable, self.qs.log.end_offset, now_ms)
        self.update_hw()
        self.maybe_propose(now_ms)

    def maybe_propose(self, now_ms: int) -> None:
        """Propose an ISR shrink or expansion when one is due (:meth:`IsrTracker.proposal`)."""
        proposal = self.isr.proposal(now_ms, self.qs.log.end_offset, self.hw,
                                     self.epoch_start)
        if proposal is not None:
            self.isr.pending = proposal
            self.host.propose_isr(self, proposal)

    def on_isr_result(self, isr: list[int], committed: list[int] | None) -> None:
        """The outcome of the proposal ``isr``: the ISR the store committed for it (without the
        members it left out: not alive), or None when it was refused (a stale view; the node
        brings the current record through :meth:`update_record`)."""
        self.isr.on_result(isr, None if committed is None
                           else _with(committed, self.host.broker_id), self.host.now_ms())
        self.update_hw()

    def update_record(self, record: QueueRecord, min_insync: int | None = None) -> None:
        """The queue's record changed (same leader and epoch): replicas or ISR."""
        if min_insync is not None:
            self.min_insync = min_insync
        self.isr.isr = _with(record.isr, self.host.broker_id)
        if self.isr.pending == self.isr.isr:
            self.isr.pending = None
        self.isr.set_replicas(record.replicas, self.host.now_ms())
        self.update_hw()

    def wake_fetchers(self) -> None:
        """Wake every follower's long poll on this queue."""
        if self.fetch_waiters:
            for w in self.fetch_waiters:
                if not w.done():
                    w.set_result(None)
            self.fetch_waiters.clear()

    # --- the high watermark and the waits ---------------------------------------------------------

    def update_hw(self) -> None:
        """Recompute the HW; show it to consumers and answer the waits it covers."""
        lg = self.qs.log
        own = lg.durable_offset if self.host.sync else lg.end_offset
        hw = self.isr.high_watermark(own, self.hw)
        if hw > self.hw:
            self.hw = hw
            self.qs.show(hw)
        acks = self._acks
        while acks and acks[0][0] <= self.hw:
            end, _seq, entry = heapq.heappop(acks)
            self._finish(entry, self._acks_outcome(end))

    def fail_waits(self, exc: BaseException) -> None:
        """Fail every ``acks="all"`` wait (fenced, leadership lost, shutdown)."""
        acks = self._acks
        self._acks = []
        for _end, _seq, entry in acks:
            self._finish(entry, exc)

    def close(self, exc: BaseException) -> None:
        """This broker no longer leads the queue: fail the waits, end the long polls."""
        self.fail_waits(exc)
        self.wake_fetchers()

    def _acks_outcome(self, end: int) -> BaseException | None:
        isr = self.isr.isr
        if len(isr) < self.min_insync:
            return NotEnoughReplicasError(
                f"{self.qs}: offsets below {end} are stored, but the in-sync replicas shrank to "
                f"{isr}, fewer than min_insync {self.min_insync}")
        return None

    def _expire(self, entry: list[AckCallback | asyncio.TimerHandle | None], end: int,
                timeout_ms: int) -> None:
        entry[1] = None
        self._finish(entry, NotEnoughReplicasError(
            f"{self.qs}: the in-sync replicas {self.isr.isr} did not all store offsets below "
            f"{end} within {timeout_ms} ms (high watermark {self.hw})"))

    @staticmethod
    def _finish(entry: list[AckCallback | asyncio.TimerHandle | None],
                outcome: BaseException | None) -> None:
        cb, timer = entry
        entry[0] = entry[1] = None
        if isinstance(timer, asyncio.TimerHandle):
            timer.cancel()
        if cb is not None and not isinstance(cb, asyncio.TimerHandle):
            cb(outcome)

    def fenced_message(self) -> str:
        """Why ``acks=\"all\"`` writes are refused while the broker is fenced."""
        return (f"broker {self.host.broker_id} cannot reach the metadata store: its lease may "
                f"expire and {self.qs} move to another broker; acks=\"all\" writes are not "
                "acknowledged here until it is back")


def _with(isr: list[int], leader: int) -> list[int]:
    """``isr`` with the leader in it (a leader is always in sync with itself)."""
    return list(isr) if leader in isr else [leader, *isr]
