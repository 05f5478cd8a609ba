"""The replica manager: this broker's role for each replicated queue, and the data path's entry.

Theory of operation
-------------------
The cluster node (:mod:`ferrymq.cluster.node`) owns one :class:`ReplicaManager` and tells it,
from the queue records of the metadata store, what this broker is for each queue:

- :meth:`ReplicaManager.become_leader`: the leader epoch is recorded at the log end in the
  queue's epoch cache (``Log.epochs.assign``) and a
  :class:`~ferrymq.cluster.replication.leader.LeaderQueue` is hung on the queue's
  ``QueueState.replica``: it keeps the high watermark (what consumers see), the followers'
  positions, the ISR and the ``acks="all"`` waits;
- :meth:`ReplicaManager.become_follower`: a
  :class:`~ferrymq.cluster.replication.follower.FollowerQueue` joins the
  :class:`~ferrymq.cluster.replication.follower.Fetcher` of its leader broker (one per leader
  broker), which truncates it by epoch and then copies the leader's batches;
- :meth:`ReplicaManager.update_record`: same leader and epoch, new ISR or replicas;
- :meth:`ReplicaManager.stop_replica`: no role (the queue refuses produce with NOT_LEADER).

The node's REPLICA_FETCH and OFFSET_FOR_EPOCH handlers call :meth:`ReplicaManager.replica_fetch`
and :meth:`ReplicaManager.offset_for_epoch` (:mod:`ferrymq.cluster.replication.serving`).

ISR changes are proposed by the leader (:mod:`ferrymq.cluster.replication.isr`: a follower
lagging for ``replica_lag_ms`` goes, one caught up with the high watermark comes back) and
written by the node through ``on_isr_change`` (a compare-and-swap on the queue's record: it
answers the ISR committed, which leaves out a member added whose broker is not alive; None
means this broker's view was stale, and the node brings the current record). Until the outcome
is known the proposal stays pending, so a member being added counts in the high watermark: a
write whose answer was lost may have been applied, and the controller may elect that member. A periodic check
(a quarter of ``replica_lag_ms``, at most a second) notices followers that stopped fetching.

:meth:`ReplicaManager.fence`: the node could not renew its metadata lease for a while, so the
controller may soon give its queues to other brokers: every ``acks="all"`` wait fails at once
and no new one is accepted (NOT_LEADER, retriable) until :meth:`ReplicaManager.unfence`.

Everything runs on the broker's event-loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ferrymq.cluster.model import NO_LEADER
from ferrymq.cluster.replication.follower import (
    Fetcher,
    FollowerQueue,
    PeerLogin,
    ScheduledCopied,
    Truncated,
)
from ferrymq.cluster.replication.leader import LeaderQueue
from ferrymq.cluster.replication.serving import ReplicaServer
from ferrymq.errors import MetadataError, NotLeaderError
from ferrymq.protocol import messages as m
from ferrymq.protocol.messages import Acks

if TYPE_CHECKING:
    from ferrymq._time import Clock
    from ferrymq.broker.config import BrokerConfig
    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.topics import QueueState, TopicRegistry
    from ferrymq.cluster.model import QueueRecord

log = logging.getLogger("ferrymq.cluster")

IsrChange = Callable[[str, int, list[int]], Awaitable[list[int] | None]]
"""``(topic, queue, new ISR)`` -> the ISR the compare-and-swap committed (the new one, less
any member added whose broker is not alive), None when it was refused; raises when the outcome
is unknown (the store unreachable after a lost answer)."""
ISR_OUTCOME_RETRY_S = 0.5
"""How long a leader waits before asking again about an ISR write of unknown outcome."""


class OfflineQueue:
    """The role of a replicated queue this broker neither leads nor follows now."""

    def __init__(self, broker_id: int, qs: QueueState) -> None:
        self.broker_id = broker_id
        self.qs = qs

    def on_local_progress(self, qs: QueueState) -> None:
        """Nothing to do."""

    def check_produce(self, acks: int) -> None:
        """Refused: not the leader."""
        raise NotLeaderError(f"broker {self.broker_id} does not lead {self.qs}")

    def wait_acks(self, end: int, timeout_ms: int,
                  cb: Callable[[BaseException | None], None]) -> None:
        """Never reached (produce is refused first)."""
        cb(NotLeaderError(f"broker {self.broker_id} does not lead {self.qs}"))


class ReplicaManager:
    """This broker's replicas (see the module docstring)."""

    def __init__(self, broker_id: int, incarnation: int, topics: TopicRegistry,
                 config: BrokerConfig, clock: Clock, flusher: Flusher,
                 address_of: Callable[[int], tuple[str, int] | None],
                 on_isr_change: IsrChange, peer_login: PeerLogin | None = None) -> None:
        """Args:
            broker_id: this broker's id.
            incarnation: this start's incarnation (sent with every REPLICA_FETCH).
            topics: the broker's queues.
            config: ``flush`` (sync: positions are durable offsets), ``replica_lag_ms``,
                ``replica_fetch_wait_ms``, ``replica_fetch_bytes``, ``max_fetch_bytes``,
                ``max_fetch_wait_ms`` (the longest follower long poll served).
            clock: its ``monotonic`` times the ISR rules.
            flusher: the broker's group commit (followers' copies are flushed by it).
            address_of: a live broker's (host, port), or None.
            on_isr_change: writes a new ISR by compare-and-swap (the node's).
            peer_login: how followers connect to leaders (login, TLS); default: plain TCP, no
                login.
        """
        self.broker_id = broker_id
        self.incarnation = incarnation
        self.topics = topics
        self.sync = config.flush == "sync"
        self.flusher = flusher
        self.lag_ms = config.replica_lag_ms
        self.fetch_wait_ms = config.replica_fetch_wait_ms
        self.fetch_bytes = config.replica_fetch_bytes
        self.connect_timeout_s = max(1.0, min(10.0, config.replica_lag_ms / 2000))
        self.fenced = False
        self.peer_login = peer_login or PeerLogin()
        self.on_scheduled: ScheduledCopied | None = None
        """Told of every scheduled batch a follower copied (the broker's scheduler indexes
        it: ``Scheduler.on_replica_append``)."""
        self.on_truncated: Truncated | None = None
        """Told that a follower cut a queue's log (``Scheduler.on_replica_truncated``)."""
        self._clock = clock
        self._address_of = address_of
        self._on_isr_change = on_isr_change
        self.leaders: dict[tuple[str, int], LeaderQueue] = {}
        self.followers: dict[tuple[str, int], FollowerQueue] = {}
        self.fetchers: dict[int, Fetcher] = {}
        self._server = ReplicaServer(broker_id, self.leaders, config.max_fetch_bytes,
                                     config.replica_fetch_bytes, config.max_fetch_wait_ms,
                                     self.now_ms)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ticker: asyncio.Task[None] | None = None

    # --- hosts' needs ------------------------------------------------------------------------

    def now_ms(self) -> int:
        """Monotonic milliseconds."""
        return int(self._clock.monotonic() * 1000)

    def monotonic(self) -> float:
        """Monotonic seconds."""
        return self._clock.monotonic()

    def wall_ms(self) -> int:
        """Wall-clock milliseconds."""
        return self._clock.wall_ms()

    def address_of(self, broker_id: int) -> tuple[str, int] | None:
        """Where a live broker listens (from the node's metadata)."""
        return self._address_of(broker_id)

    # --- roles -------------------------------------------------------------------------------

    def become_leader(self, topic: str, queue: int, record: QueueRecord,
                      min_insync: int) -> None:
        """Lead the queue at ``record.leader_epoch`` (see the module docstring).

        Raises:
            UnknownTopicError, UnknownQueueError: the queue is not here.
            LeaderEpochOrderError: the epoch is older than one this replica has seen.
            OSError: the epoch cache could not be written.
        """
        key = (topic, queue)
        lq = self.leaders.get(key)
        if lq is not None and lq.epoch == record.leader_epoch:
            lq.update_record(record, min_insync)
            return
        qs = self.topics.queue(topic, queue)
        qs.log.epochs.assign(record.leader_epoch, qs.log.end_offset)
        self._drop(key, f"broker {self.broker_id} leads {topic}/{queue} at a new epoch "
                        f"{record.leader_epoch}")
        lq = LeaderQueue(self, qs, record, min_insync)
        self.leaders[key] = lq
        qs.replica = lq
        lq.update_hw()
        self._start_ticker()
        log.info("%s: leading (replicas %s, ISR %s, min_insync %d, log end %d, high "
                 "watermark %d)", lq, record.replicas, lq.isr.isr, min_insync,
                 qs.log.end_offset, lq.hw)

    def become_follower(self, topic: str, queue: int, record: QueueRecord) -> None:
        """Follow the queue from ``record.leader``: truncate by epoch, then copy.

        Raises:
            UnknownTopicError, UnknownQueueError: the queue is not here.
            ValueError: the record names this broker (or nobody) as leader.
        """
        if record.leader in (self.broker_id, NO_LEADER):
            raise ValueError(f"{topic}/{queue}: broker {record.leader} cannot be followed by "
                             f"broker {self.broker_id}")
        key = (topic, queue)
        fq = self.followers.get(key)
        if fq is not None and (fq.leader, fq.epoch) == (record.leader, record.leader_epoch):
            return
        qs = self.topics.queue(topic, queue)
        self._drop(key, f"broker {record.leader} leads {topic}/{queue} now (epoch "
                        f"{record.leader_epoch})")
        fq = FollowerQueue(self, qs, record)
        self.followers[key] = fq
        qs.replica = fq
        fetcher = self.fetchers.get(record.leader)
        if fetcher is None:
            fetcher = self.fetchers[record.leader] = Fetcher(self, record.leader)
            fetcher.start()
        fetcher.add(fq)
        log.info("%s: following (log end %d)", fq, qs.log.end_offset)

    def update_record(self, topic: str, queue: int, record: QueueRecord,
                      min_insync: int | None = None) -> None:
        """The queue's persisted record changed: same leader and epoch: the new ISR and
        replicas; otherwise the role it now gives this broker."""
        key = (topic, queue)
        lq = self.leaders.get(key)
        if record.leader == self.broker_id:
            if lq is not None and lq.epoch == record.leader_epoch:
                lq.update_record(record, min_insync)
            else:
                self.become_leader(topic, queue, record,
                                   min_insync if min_insync is not None else 1)
        elif record.leader != NO_LEADER and self.broker_id in record.replicas:
            self.become_follower(topic, queue, record)
        else:
            self.stop_replica(topic, queue)

    def stop_replica(self, topic: str, queue: int) -> None:
        """Neither lead nor follow the queue (its produce is refused with NOT_LEADER)."""
        key = (topic, queue)
        self._drop(key, f"broker {self.broker_id} no longer leads {topic}/{queue}")
        t = self.topics.topics.get(topic)
        if t is not None and 0 <= queue < len(t.queues):
            qs = t.queues[queue]
            qs.replica = OfflineQueue(self.broker_id, qs)

    def _drop(self, key: tuple[str, int], why: str) -> None:
        lq = self.leaders.pop(key, None)
        if lq is not None:
            lq.close(NotLeaderError(why))
        fq = self.followers.pop(key, None)
        if fq is not None and fq.fetcher is not None:
            fetcher = fq.fetcher
            fetcher.remove(key)
            if not fetcher.queues:
                if self.fetchers.get(fetcher.leader) is fetcher:
                    del self.fetchers[fetcher.leader]
                self._spawn(fetcher.close())

    def leader_epoch(self, topic: str, queue: int) -> int | None:
        """The epoch this broker leads the queue at; None when it does not lead it."""
        lq = self.leaders.get((topic, queue))
        return None if lq is None else lq.epoch

    def high_watermark(self, topic: str, queue: int) -> int | None:
        """The queue's high watermark here (None when this broker does not lead it)."""
        lq = self.leaders.get((topic, queue))
        return None if lq is None else lq.hw

    # --- the data path -----------------------------------------------------------------------

    def replica_fetch(self, conn: object, req: m.ReplicaFetchRequest
                      ) -> m.ReplicaFetchResponse | asyncio.Future[m.ReplicaFetchResponse]:
        """The REPLICA_FETCH handler's body (:mod:`ferrymq.cluster.replication.serving`)."""
        return self._server.replica_fetch(req)

    def offset_for_epoch(self, req: m.OffsetForEpochRequest) -> m.OffsetForEpochResponse:
        """The OFFSET_FOR_EPOCH handler's body."""
        return self._server.offset_for_epoch(req)

    def check_acks_all(self, topic: str, queue: int) -> None:
        """Raise unless an ``acks="all"`` produce may be appended now.

        Raises:
            NotLeaderError: not the leader here, or fenced.
            NotEnoughReplicasError: fewer in-sync replicas than ``min_insync``.
        """
        lq = self.leaders.get((topic, queue))
        if lq is None:
            raise NotLeaderError(f"broker {self.broker_id} does not lead {topic}/{queue}")
        lq.check_produce(Acks.ALL)

    def wait_acks_all(self, topic: str, queue: int, end_offset: int, timeout_ms: int,
                      cb: Callable[[BaseException | None], None]) -> None:
        """Run ``cb(None)`` once the high watermark covers ``end_offset`` with ``min_insync``
        in-sync replicas, ``cb(exc)`` otherwise (timeout, fence, leadership lost)."""
        lq = self.leaders.get((topic, queue))
        if lq is None:
            cb(NotLeaderError(f"broker {self.broker_id} does not lead {topic}/{queue}"))
            return
        lq.wait_acks(end_offset, timeout_ms, cb)

    # --- ISR changes -------------------------------------------------------------------------

    def propose_isr(self, lq: LeaderQueue, isr: list[int]) -> None:
        """Write ``isr`` for ``lq``'s queue through the node (in the background)."""
        log.info("%s: proposing ISR %s (was %s)", lq, isr, lq.isr.isr)
        self._spawn(self._write_isr(lq, isr))

    async def _write_isr(self, lq: LeaderQueue, isr: list[int]) -> None:
        qs = lq.qs
        key = (qs.topic, qs.queue)
        while True:
            try:
                committed = await self._on_isr_change(qs.topic, qs.queue, isr)
                break
            except (MetadataError, OSError, TimeoutError) as exc:
                # the write may have been applied: the proposal stays pending (its added
                # members count in the high watermark) until the outcome is known
                log.warning("%s: the outcome of writing ISR %s is unknown (%s); asking again",
                            lq, isr, exc)
                await asyncio.sleep(ISR_OUTCOME_RETRY_S)
                if self.leaders.get(key) is not lq:
                    return
        if self.leaders.get(key) is lq:
            left_out = [] if committed is None else [r for r in isr if r not in committed]
            if left_out:
                log.info("%s: ISR %s committed without %s (not alive)", lq, committed, left_out)
            lq.on_isr_result(isr, committed)

    def _start_ticker(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(
                self._tick(), name="ferrymq-isr-check")

    async def _tick(self) -> None:
        period = max(0.02, min(1.0, self.lag_ms / 4000))
        while True:
            await asyncio.sleep(period)
            now = self.now_ms()
            for lq in list(self.leaders.values()):
                lq.maybe_propose(now)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- fencing and closing -----------------------------------------------------------------

    def fence(self) -> None:
        """Acknowledge no ``acks="all"`` write until :meth:`unfence` (see the module
        docstring)."""
        if self.fenced:
            return
        self.fenced = True
        for lq in self.leaders.values():
            lq.fail_waits(NotLeaderError(lq.fenced_message()))

    def unfence(self) -> None:
        """The metadata lease is safe again."""
        self.fenced = False

    async def close(self) -> None:
        """Stop every fetcher and long poll; fail the waits (the broker is stopping)."""
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
        self._server.close()
        fetchers = list(self.fetchers.values())
        self.fetchers.clear()
        for fetcher in fetchers:
            await fetcher.close()
        for key in list(self.leaders) + list(self.followers):
            self.stop_replica(*key)
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
