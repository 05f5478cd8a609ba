"""The leader's side of the wire: REPLICA_FETCH (long-polled) and OFFSET_FOR_EPOCH.

Theory of operation
-------------------
A REPLICA_FETCH names, per queue, the follower's leader epoch, its log end (the fetch offset)
and its durable offset. Per entry, in order:

1. this broker must lead the queue (else NOT_LEADER) at the follower's epoch (an older or newer
   one: FENCED_LEADER_EPOCH; the follower waits for the metadata to catch up), and the follower
   must be one of its replicas;
2. the fetch offset must lie in the leader's log (past its end: the follower did not truncate,
   OFFSET_OUT_OF_RANGE with the leader's ends in the entry);
3. the positions go to the queue's :class:`~ferrymq.cluster.replication.leader.LeaderQueue`
   (HW, ISR), *when the request arrives*, so a long poll does not delay what it reports;
4. batches from the fetch offset up to the leader's log end (not the HW: followers copy what
   the leader has), as stored, within the entry's and the request's byte budgets, and the
   epoch entries covering them (``Log.epochs.entries_from``).

Nothing to send and a wait asked: one future on each queue's ``fetch_waiters``, woken by the
next append, or by a newer long poll of the same follower (which supersedes this one: a
follower has one long poll at a time, so a queue it starts following is fetched at once); then
it reads once more and answers. The future is in place before the handler returns: an append
made by what the request's positions set off (a waiter of the HW that appends at once, as a
transaction coordinator writes its markers after its decision) wakes it too. A request with
``max_bytes`` 0 is a position report: it reads nothing and never waits (the follower sends one
when its flush made more of its log durable).

OFFSET_FOR_EPOCH: where the asked epoch ends on this leader
(:meth:`~ferrymq.storage.epochs.LeaderEpochCache.end_offset_for`), for a follower at this
leader's epoch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ferrymq.cluster.replication.leader import LeaderQueue
from ferrymq.errors import (
    BrokerError,
    FencedLeaderEpochError,
    NotLeaderError,
    OffsetOutOfRangeError,
)
from ferrymq.protocol import messages as m


class ReplicaServer:
    """Answers followers' REPLICA_FETCH and OFFSET_FOR_EPOCH from the queues led here."""

    def __init__(self, broker_id: int, leaders: dict[tuple[str, int], LeaderQueue],
                 max_fetch_bytes: int, entry_bytes: int, max_wait_ms: int,
                 now_ms: Callable[[], int]) -> None:
        self.broker_id = broker_id
        self.leaders = leaders
        self.max_fetch_bytes = max_fetch_bytes
        self.max_wait_ms = max_wait_ms
        self.entry_bytes = entry_bytes
        self.now_ms = now_ms
        self._polls: dict[int, asyncio.Future[None]] = {}
        """Each follower's current long poll (a newer one supersedes it)."""
        self.closing = False

    def replica_fetch(self, req: m.ReplicaFetchRequest
                      ) -> m.ReplicaFetchResponse | asyncio.Future[m.ReplicaFetchResponse]:
        """The REPLICA_FETCH handler's body (see the module docstring)."""
        resp, total, waitable = self._read(req, report=True)
        if req.max_wait_ms <= 0 or req.max_bytes <= 0:  # a position report
            return resp
        old = self._polls.pop(req.replica_id, None)
        if old is not None and not old.done():
            old.set_result(None)  # superseded: it answers now
        if total or not waitable or self.closing:
            return resp
        # the waiter is in place before this callback ends: what the positions just reported
        # set off (acks waiting for the HW, and an append they make at once) runs before the
        # poll's task would have started, and its wake-up must not be missed
        w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._polls[req.replica_id] = w
        for lq in waitable:
            lq.fetch_waiters.add(w)
        return asyncio.ensure_future(self._long_poll(req, waitable, w))

    async def _long_poll(self, req: m.ReplicaFetchRequest, waitable: list[LeaderQueue],
                         w: asyncio.Future[None]) -> m.ReplicaFetchResponse:
        try:
            await asyncio.wait_for(w, min(req.max_wait_ms, self.max_wait_ms) / 1000)
        except TimeoutError:
            pass
        finally:
            for lq in waitable:
                lq.fetch_waiters.discard(w)
            if self._polls.get(req.replica_id) is w:
                del self._polls[req.replica_id]
        return self._read(req, report=False)[0]

    def close(self) -> None:
        """Answer every long poll now (shutdown)."""
        self.closing = True
        for w in self._polls.values():
            if not w.done():
                w.set_result(None)
        self._polls.clear()

    def _read(self, req: m.ReplicaFetchRequest, *, report: bool
              ) -> tuple[m.ReplicaFetchResponse, int, list[LeaderQueue]]:
        budget = min(req.max_bytes, self.max_fetch_bytes)
        results: list[m.ReplicaFetchResult] = []
        epochs: list[m.EpochEntries] = []
        waitable: list[LeaderQueue] = []
        total = 0
        now_ms = self.now_ms()
        for topic, queue, epoch, offset, durable in req.entries:
            try:
                lq = self._leader(topic, queue, epoch, req.replica_id)
                lg = lq.qs.log
                end = lg.end_offset
                if offset > end or offset < lg.start_offset:
                    results.append((topic, queue, OffsetOutOfRangeError.code,
                                    f"fetch offset {offset} is outside {lg.start_offset}..{end} "
                                    f"of {topic}/{queue} on its leader", lq.hw, end,
                                    lg.start_offset, b""))
                    continue
                if report:
                    lq.on_follower_fetch(req.replica_id, offset, durable, now_ms)
                data: bytes | memoryview = b""
                if offset < end and budget > 0:
                    data = lg.read_view(offset, max(1, min(self.entry_bytes, budget)),
                                        upto_offset=end, stored=True)
                    epochs.append((topic, queue, lg.epochs.entries_from(offset)))
                elif offset >= end:
                    waitable.append(lq)
            except BrokerError as exc:
                results.append((topic, queue, exc.code, str(exc)[:1024], -1, -1, -1, b""))
                continue
            budget -= len(data)
            total += len(data)
            results.append((topic, queue, 0, "", lq.hw, end, lg.start_offset, data))
        return m.ReplicaFetchResponse(results, epochs), total, waitable

    def offset_for_epoch(self, req: m.OffsetForEpochRequest) -> m.OffsetForEpochResponse:
        """Where each asked epoch ends here (see the module docstring)."""
        results: list[m.EpochEndResult] = []
        for topic, queue, current, asked in req.entries:
            try:
                lq = self._leader(topic, queue, current, req.replica_id)
            except BrokerError as exc:
                results.append((topic, queue, exc.code, -1, -1))
                continue
            lg = lq.qs.log
            e, end = lg.epochs.end_offset_for(asked, lg.end_offset)
            results.append((topic, queue, 0, e, end))
        return m.OffsetForEpochResponse(results)

    def _leader(self, topic: str, queue: int, epoch: int, replica: int) -> LeaderQueue:
        lq = self.leaders.get((topic, queue))
        if lq is None:
            raise NotLeaderError(f"broker {self.broker_id} does not lead {topic}/{queue}")
        if epoch != lq.epoch:
            raise FencedLeaderEpochError(
                f"{topic}/{queue}: the follower is at leader epoch {epoch}, broker "
                f"{self.broker_id} leads it at epoch {lq.epoch}")
        if replica not in lq.isr.followers:
            raise NotLeaderError(f"broker {replica} is not a follower of {topic}/{queue} "
                                 f"(replicas: leader {self.broker_id} and "
                                 f"{sorted(lq.isr.followers)})")
        return lq
