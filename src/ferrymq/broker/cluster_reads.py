"""Remote reads: a delivery group's coordinator reads the source queues its broker holds no
replica of from their leaders.

Theory of operation
-------------------
A delivery group is served by one coordinator, the leader of its retry queue
(:mod:`ferrymq.broker.cluster_delivery`). A topic with fewer replicas than the cluster has
brokers leaves some of its queues off the coordinator's broker. For each such queue a group
reads, :class:`RemoteReads` keeps a :class:`~ferrymq.broker.delivery.sources.BufferedQueue`
(bounded by ``delivery_remote_buffer_bytes``) and one task that fills it the way a consumer
reads a queue (Kafka's consumer fetcher, RocketMQ's pull service); all those buffers together
hold at most ``delivery_remote_buffers_total_bytes`` (their ``RemoteBudget``: a reader whose own
buffer has room but finds that total reached waits a second and asks again). Each reader:

1. **List.** LIST_OFFSETS at the queue's leader: its log start, its last stable offset and, for
   a group that starts at a time, the offset of that time: what a new cursor needs
   (:meth:`~ferrymq.broker.delivery.receiving.Receiving._start`).
2. **Fetch.** From the buffer's end, a read_committed FETCH long-polled at the leader
   (``replica_fetch_wait_ms``), asking for at most the room left in the buffer (checked before
   the request is sent: a full buffer waits until the group's cursor floor moves up). The
   batches go into the buffer, which wakes the group's long-polling receivers. RECEIVE, acks,
   nacks, moves to the retry and dead-letter queues and lease expiry then work on them as on
   a local queue (:mod:`ferrymq.broker.delivery.sources`).
3. **Leader moves.** The leader is read from the metadata view before every request;
   NOT_LEADER, FENCED_LEADER_EPOCH, LEADER_NOT_AVAILABLE and a lost connection make the task
   rest briefly and ask again (the view catches up). OFFSET_OUT_OF_RANGE lists the queue again
   (retention at the leader: the group's cursor skips to the new log start, as it does on a
   local queue).

When the coordinator's broker becomes a replica of the queue (a reassignment), the group reads
its own copy again and the remote reader stops; when the broker stops coordinating the group,
its readers stop. Requests go through the delivery groups' :class:`~ferrymq.broker.peers.Peers`
(one connection per broker, the followers' login).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from ferrymq.broker.delivery.sources import BufferedQueue, RemoteBudget
from ferrymq.broker.topics import CLUSTER_TOPIC_ID_BASE
from ferrymq.cluster.model import NO_LEADER
from ferrymq.errors import (
    BrokerError,
    ConnectionClosedError,
    FerryMQTimeoutError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.messages import Isolation

if TYPE_CHECKING:
    from ferrymq.broker.cluster_link import ClusterLink
    from ferrymq.broker.delivery.group import DeliveryGroup
    from ferrymq.broker.delivery.sources import SourceQueue
    from ferrymq.broker.peers import Peers
    from ferrymq.broker.topics import QueueState

log = logging.getLogger("ferrymq.broker")

RETRY_AFTER_METADATA_S = 0.2
"""How long a reader rests after NOT_LEADER and the like, or without a leader (the metadata
catches up)."""
RETRY_AFTER_ERROR_S = 1.0
"""How long a reader rests after another error or a lost connection."""
EMPTY_ANSWER_REST_S = 0.1
"""How long a reader rests after an empty answer that came before its long poll's wait was up."""
_METADATA_CODES = (ErrorCode.NOT_LEADER, ErrorCode.FENCED_LEADER_EPOCH,
                   ErrorCode.LEADER_NOT_AVAILABLE, ErrorCode.UNKNOWN_TOPIC)


class _Reader:
    """One group's remote read of one queue: its buffer and the task filling it."""

    def __init__(self, reads: RemoteReads, g: DeliveryGroup, qs: QueueState) -> None:
        self.group = g
        self.closed = False
        key = (qs.topic, qs.queue)
        self.moved = asyncio.Event()

        def floor() -> int | None:
            cur = g.sources.get(key)
            return None if cur is None else cur.floor

        self.buffer = BufferedQueue(qs.topic, qs.topic_id, qs.queue,
                                    reads.link.server.config.delivery_remote_buffer_bytes,
                                    floor, self.moved.set, reads.budget)
        self.task = asyncio.get_running_loop().create_task(
            reads.run(self), name=f"ferrymq-remote-read-{g.name}-{qs}")

    def close(self) -> None:
        # the flag too: Python 3.11's asyncio.wait_for (under the requests) may swallow a
        # cancellation that arrives with the answer
        self.closed = True
        self.task.cancel()


class RemoteReads:
    """The remote reads of the delivery groups this broker coordinates (see the module
    docstring)."""

    def __init__(self, link: ClusterLink, peers: Peers) -> None:
        self.link = link
        srv = link.server
        self.peers = peers
        self.budget = RemoteBudget(srv.config.delivery_remote_buffers_total_bytes)
        """What every reader's buffer holds together (``/metrics``)."""
        self._readers: dict[tuple[str, str, int], _Reader] = {}
        srv.delivery.ctx.remote_source = self.source
        srv.delivery.ctx.holds = self.holds

    @staticmethod
    def holds(qs: QueueState) -> bool:
        """Whether this broker holds ``qs``: a replica of it, or a local topic."""
        return qs.replica is not None or qs.topic_id < CLUSTER_TOPIC_ID_BASE

    def source(self, g: DeliveryGroup, qs: QueueState) -> SourceQueue | None:
        """What ``g`` reads of ``qs`` (the delivery context's ``remote_source``): ``qs`` when
        this broker holds a replica of it (or it is a local topic), else its buffer, once the
        leader's offsets are known (None before)."""
        key = (g.name, qs.topic, qs.queue)
        if self.holds(qs):
            r = self._readers.pop(key, None) if self._readers else None
            if r is not None:
                r.close()
            return qs
        r = self._readers.get(key)
        if r is None or r.group is not g or r.buffer.topic_id != qs.topic_id:
            if r is not None:
                r.close()
            r = self._readers[key] = _Reader(self, g, qs)
        return r.buffer if r.buffer.listed else None

    def forget(self, group: str) -> None:
        """Stop the readers of ``group`` (no longer coordinated here, or reloaded)."""
        for key in [k for k in self._readers if k[0] == group]:
            self._readers.pop(key).close()

    def close(self) -> None:
        """Stop every reader and connection."""
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    async def run(self, r: _Reader) -> None:
        """Fill ``r``'s buffer from the queue's leader until it is closed."""
        buf = r.buffer
        topics = self.link.server.topics.topics
        try:
            while not r.closed:
                t = topics.get(buf.topic)
                if t is None or t.topic_id != buf.topic_id:  # the topic was deleted
                    key = (r.group.name, buf.topic, buf.queue)
                    if self._readers.get(key) is r:
                        del self._readers[key]
                    return
                rest = await self._step(r, buf)
                if rest:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(rest):
                            await r.moved.wait()
        except asyncio.CancelledError:
            pass
        finally:  # stopped (closed, or its topic deleted): its bytes go back to the budget
            buf.release()

    async def _step(self, r: _Reader, buf: BufferedQueue) -> float:
        """One request to the leader; how long to rest after it (0: go on)."""
        link = self.link
        r.moved.clear()  # (a rest after this step waits for what happens from now on)
        rec = link.node.view.queues.get((buf.topic, buf.queue))
        leader = rec.leader if rec is not None else NO_LEADER
        if leader in (NO_LEADER, link.node.broker_id):
            return RETRY_AFTER_METADATA_S
        try:
            if not buf.listed:
                await self._list(r, buf, leader)
                return 0.0
            room = buf.room
            if room <= 0:  # full, the broker's buffers together full, or no cursor yet:
                return RETRY_AFTER_ERROR_S  # wait until the floor moves (or a second)
            return await self._fetch(buf, leader, room)
        except (ConnectionClosedError, FerryMQTimeoutError) as exc:
            log.info("%s for delivery group %s: broker %d: %s", buf, r.group.name, leader, exc)
            return RETRY_AFTER_ERROR_S
        except BrokerError as exc:
            return self._on_error(r, buf, exc.code, str(exc))

    async def _list(self, r: _Reader, buf: BufferedQueue, leader: int) -> None:
        spec = r.group.start_from
        entries: list[tuple[str, int, int]] = [(buf.topic, buf.queue, m.OffsetSpec.EARLIEST),
                                               (buf.topic, buf.queue, m.OffsetSpec.LATEST)]
        if spec >= 0:
            entries.append((buf.topic, buf.queue, spec))
        resp = await self.peers.request(
            leader, m.ListOffsetsRequest(entries, Isolation.READ_COMMITTED),
            m.ListOffsetsResponse)
        for _t, _q, code, _o in resp.results:
            if code:
                raise error_for_code(code, f"LIST_OFFSETS of {buf} at broker {leader}")
        offsets = [o for _t, _q, _c, o in resp.results]
        if spec >= 0:
            buf.listed_times[spec] = offsets[2]
        buf.listed_end = offsets[1]
        buf.leader_start = offsets[0]
        r.group.wake()  # a receiver waiting for the group can start a cursor now

    async def _fetch(self, buf: BufferedQueue, leader: int, room: int) -> float:
        wait_ms = self.link.server.config.replica_fetch_wait_ms
        gen, at = buf.generation, buf.end
        req = m.FetchRequest(wait_ms, 1, room, [(buf.topic, buf.queue, at, room, "")],
                             Isolation.READ_COMMITTED)
        loop = asyncio.get_running_loop()
        sent = loop.time()
        resp = await self.peers.request(leader, req, m.FetchResponse,
                                        wait_ms / 1000 + self.peers.timeout_s)
        if buf.generation != gen or buf.end != at:
            return 0.0  # started again elsewhere meanwhile: this answer is not for it
        got = 0
        for _t, _q, code, msg, _hw, start, _tid, data in resp.results:
            if code:
                raise error_for_code(code, msg)
            aborted = [a for t, q, _lso, ab in resp.txn if (t, q) == (buf.topic, buf.queue)
                       for a in ab]
            buf.add(data, start, aborted)
            got += len(data)
        if not got and loop.time() - sent < wait_ms / 2000:
            # an empty answer before its wait was up (the leader is shutting down, or its
            # visible end lags behind this offset): do not ask again at once
            return EMPTY_ANSWER_REST_S
        return 0.0

    def _on_error(self, r: _Reader, buf: BufferedQueue, code: int, msg: str) -> float:
        if code in _METADATA_CODES:
            return RETRY_AFTER_METADATA_S
        if code == ErrorCode.OFFSET_OUT_OF_RANGE:  # retention at the leader: list again
            log.info("%s for delivery group %s: %s; listing its offsets again", buf,
                     r.group.name, msg)
            buf.leader_start = -1
            return RETRY_AFTER_METADATA_S
        log.warning("%s for delivery group %s: %s", buf, r.group.name, msg)
        return RETRY_AFTER_ERROR_S
