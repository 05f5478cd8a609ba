"""Transactions in a cluster: the coordinator fails over, and transactions span brokers.

Theory of operation
-------------------
CLUSTER.md's pattern for stateful services (Kafka's ``__transaction_state``):

* **Who coordinates.** ``%TXN%state`` (:data:`~ferrymq.protocol.coordinator.TXN_TOPIC`) is a
  cluster topic of one queue, replicated like any other (the cluster's default replicas and
  ``min_insync``), created through the metadata store the first time a broker is asked about a
  transaction. The leader of that queue is the coordinator of every transactional id (one
  queue, not one per hash of the id: a Spark sink's COMMIT_STAGED decides several ids in one
  record, so they must share a coordinator; docs/design.md). Other brokers answer the
  coordinator's requests with NOT_COORDINATOR and clients follow it
  (:mod:`ferrymq.client._coordinator`).
* **State.** Every change is appended to that queue and answered once the queue's high
  watermark covers it (``acks="all"``), so the next leader has it. When a broker starts
  leading the queue (:meth:`TxnCluster.on_role`) it replays the whole queue into an empty
  :class:`~ferrymq.broker.txn.state.TxnBook` (no snapshot on a cluster: each broker's
  snapshot file covers only its own writes), then drives every decided transaction
  (PrepareCommit / PrepareAbort) to completion; open ones carry on (the producer may still
  commit) or time out there. When it stops leading, it forgets the book.
* **Queues on other brokers (KIP-890's verification).** A queue's leader appends a
  transactional batch of a producer whose transaction is not open on that queue only after
  the coordinator registered the queue with the producer's open transaction at that epoch
  (TXN_ADD_QUEUE, answered once the registration is replicated; :meth:`verify`): a zombie is
  refused there (PRODUCER_FENCED), and no queue holds a transaction its coordinator does not
  know. A batch whose transaction ended (a marker reached the queue) while the verification
  was on its way is refused too (:attr:`Completer.marked`), so a late batch never opens a
  "hanging" transaction.
* **Markers.** The coordinator writes the markers of the queues it leads itself and sends
  TXN_MARKERS to the leader of every other queue (:meth:`send_markers`, retried while the
  queue changes leader); that leader appends the marker where the producer's transaction is
  still open, waits until it is replicated, then releases the queue's last stable offset.
* **Offsets** sent with a transaction go, once it commits, to the group's coordinator: the
  replicated ``%GROUPS%offsets`` (:mod:`ferrymq.broker.cluster_groups`), written here when
  this broker coordinates the group, else through COMMIT_OFFSETS to the broker that does.
* **Zombie fencing** holds on every broker: a new epoch (INIT_TXN, a timeout, and the end of
  each transaction: END_TXN answers the next epoch) refuses the old one at the coordinator,
  its markers carry the new epoch into every touched queue's producer state (so their leaders
  refuse the old epoch), and untouched queues ask the coordinator first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, TypeVar, cast

from ferrymq.broker.cluster_groups import COMPACT_CHECK_S
from ferrymq.broker.internal_owner import InternalTopicOwner
from ferrymq.broker.peers import Peers
from ferrymq.broker.topics import replicated
from ferrymq.broker.txn.statelog import StateReplay
from ferrymq.cluster.model import NO_LEADER
from ferrymq.errors import (
    BrokerError,
    ConnectionClosedError,
    FerryMQTimeoutError,
    InvalidRequestError,
    NotCoordinatorError,
    NotLeaderError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, TXN_TOPIC, coordinator_queue
from ferrymq.protocol.messages import Acks
from ferrymq.protocol.records import ATTR_TRANSACTIONAL, decode_header

if TYPE_CHECKING:
    from ferrymq.broker.cluster_link import ClusterLink
    from ferrymq.broker.topics import QueueState
    from ferrymq.broker.txn.coordinator import TxnCoordinator
    from ferrymq.broker.txn.state import TxnMeta

log = logging.getLogger("ferrymq.broker")

RETRY_S = 0.2
"""Pause before sending markers or offsets again after their broker moved or failed."""
REMOTE_TIMEOUT_S = 30.0
"""How long markers and offsets are retried before the completion stalls (the housekeeping
tick resumes it)."""

B = TypeVar("B", bound=m.Body)
Verified = dict[tuple[str, int, int], tuple[int, int]]
"""(topic, queue, producer id) -> (epoch verified, marker sequence when asked)."""


class TxnCluster(InternalTopicOwner):
    """The transaction coordinator's part in a cluster (see the module docstring)."""

    topic = TXN_TOPIC
    service = "transactions"
    owner_noun = "coordinator"
    owner_verb = "coordinate"

    def __init__(self, link: ClusterLink) -> None:
        super().__init__(link)
        srv = link.server
        self.txn: TxnCoordinator = srv.txn
        node = link.node
        from ferrymq.broker.cluster_link import peer_login  # a cycle at import time
        self.peers = Peers(node.broker_id, lambda bid: node.view.address_of(bid),
                           peer_login(srv.config),
                           max(1.0, min(10.0, srv.config.replica_lag_ms / 1000)))
        self._replay: StateReplay | None = None
        """The led log's records up to its high watermark (compaction's view; built at the
        first check after this broker starts leading)."""
        self._compacted_at = 0
        """The log's size in bytes after its last compaction here (0 before the first)."""
        self._compactor: asyncio.Task[None] | None = None
        self.txn.attach(self)

    def start(self) -> None:
        """Start compacting ``%TXN%state`` while this broker leads it."""
        self._compactor = asyncio.get_running_loop().create_task(self._compact_forever())

    # --- leadership of the state log ---------------------------------------------------------

    def on_role(self, leads: bool, new_epoch: bool) -> None:
        """This broker now leads ``%TXN%state`` (``new_epoch``: not at this epoch before:
        rebuild from the log and finish decided transactions) or not (forget them)."""
        if leads and (new_epoch or not self.leads):
            n = self.txn.rebuild()
            self.leads = True
            log.info("coordinating transactions from %s: %d transactional ids", TXN_TOPIC, n)
            self.txn.resume_decided(force=True)
        if leads and new_epoch:
            self._replay = None  # built again from this epoch's log
        elif not leads and self.leads:
            self.leads = False
            self._replay = None
            self.txn.book.clear()
            self.txn.book.pending_offsets.clear()
            self.txn.book.unanswered.clear()
            log.info("no longer coordinating transactions (%s moved)", TXN_TOPIC)


    # --- a queue's leader: transactional batches -------------------------------------------------

    def unverified(self, req: m.ProduceRequest) -> list[tuple[QueueState, int, int]]:
        """The transactional batches of ``req`` whose producer has no transaction open on their
        queue here: (queue, producer id, epoch), each once. Entries that cannot be looked at
        are left to the produce itself to refuse."""
        topics = self.link.server.topics
        out: dict[tuple[str, int, int], tuple[QueueState, int, int]] = {}
        entries = cast("list[tuple[str, int, bytes | bytearray | memoryview]]", req.entries)
        for topic, queue, batch in entries:  # (decoded: never BatchBuffers)
            try:
                h = decode_header(batch)
                if not h.attributes & ATTR_TRANSACTIONAL:
                    continue
                qs = topics.queue(topic, queue)
            except BrokerError:
                continue
            if h.producer_id not in qs.open_txns:
                out[(topic, queue, h.producer_id)] = (qs, h.producer_id, h.producer_epoch)
        return list(out.values())

    async def verify(self, need: list[tuple[QueueState, int, int]]
                     ) -> tuple[Verified, dict[tuple[str, int], BrokerError]]:
        """Ask the coordinator to register each queue with its producer's open transaction
        (all at once); what was verified, and the refusals per queue."""
        completer = self.txn.completer
        ok: Verified = {}
        refused: dict[tuple[str, int], BrokerError] = {}

        async def one(qs: QueueState, pid: int, epoch: int) -> None:
            seq = completer.mark_seq
            try:
                if qs.topic.startswith("%"):
                    raise InvalidRequestError("transactions cannot write to internal topics")
                if qs.replica is not None:
                    qs.replica.check_produce(Acks.LEADER)
                if self.leads:
                    await self.txn.add_queue(pid, epoch, qs.topic, qs.queue)
                else:
                    await self.ask_coordinator(
                        m.TxnAddQueueRequest(pid, epoch, qs.topic, qs.queue),
                        m.TxnAddQueueResponse)
            except BrokerError as exc:
                refused[(qs.topic, qs.queue)] = exc
                return
            ok[(qs.topic, qs.queue, pid)] = (epoch, seq)

        await asyncio.gather(*(one(*n) for n in need))
        return ok, refused

    async def ask_coordinator(self, req: m.Request, resp_type: type[B]) -> B:
        """Send ``req`` to the transaction coordinator (another broker) and return its answer.

        Raises:
            NotCoordinatorError: there is none now, or it did not answer.
            BrokerError: its refusal.
        """
        leader = self.owner()
        if leader == NO_LEADER:
            self.check_owner("the transaction")  # raises NOT_COORDINATOR
        try:
            return await self.peers.request(leader, req, resp_type)
        except (ConnectionClosedError, FerryMQTimeoutError) as exc:
            raise NotCoordinatorError(f"the transaction coordinator (broker {leader}) did not "
                                      f"answer: {exc}") from None

    # --- the coordinator: markers and offsets on other brokers -----------------------------------

    def is_local(self, topic: str, queue: int) -> bool:
        """Whether this broker leads ``topic``/``queue`` (writes its markers itself)."""
        rec = self.link.node.view.queues.get((topic, queue))
        return rec is not None and rec.leader == self.link.node.broker_id

    async def send_markers(self, meta: TxnMeta, commit: bool, coord: int,
                           queues: list[tuple[str, int]]) -> None:
        """Have the leader of each queue write the marker (TXN_MARKERS), retried while queues
        change leaders, until every one is replicated.

        Raises:
            NotCoordinatorError: this broker stopped coordinating.
            BrokerError: a queue's leader kept refusing for ``REMOTE_TIMEOUT_S``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REMOTE_TIMEOUT_S
        left = list(queues)
        while left:
            if not self.leads:
                raise NotCoordinatorError("this broker stopped coordinating transactions while "
                                          "writing markers")
            by_leader: dict[int, list[tuple[str, int]]] = {}
            for t, q in left:
                if self.is_local(t, q):  # moved here meanwhile
                    await self.txn.write_markers_here(meta.pid, meta.epoch, commit, meta.tid,
                                                      coord, [(t, q)])
                    continue
                rec = self.link.node.view.queues.get((t, q))
                if rec is None:  # the topic was deleted
                    continue
                by_leader.setdefault(rec.leader, []).append((t, q))
            left = []
            last: BaseException | None = None
            for leader, qs in by_leader.items():
                if leader == NO_LEADER:
                    left.extend(qs)
                    continue
                req = m.TxnMarkersRequest(meta.pid, meta.epoch, commit, meta.tid, coord, qs)
                try:
                    resp = await self.peers.request(leader, req, m.TxnMarkersResponse)
                except (BrokerError, ConnectionClosedError, FerryMQTimeoutError) as exc:
                    left.extend(qs)
                    last = exc
                    continue
                for t, q, code, msg in resp.results:
                    if code:
                        left.append((t, q))
                        last = error_for_code(code, msg)
            if left:
                if loop.time() >= deadline:
                    raise (last if isinstance(last, BrokerError) else NotLeaderError(
                        f"markers of {meta.tid!r} not written to {left}: {last}"))
                await asyncio.sleep(RETRY_S)

    async def apply_offsets(self, group: str, offsets: dict[tuple[str, int], int]) -> None:
        """Commit a committed transaction's offsets of ``group`` at its coordinator (here or
        through COMMIT_OFFSETS), retried while the group's coordinator moves.

        Raises:
            BrokerError: not stored within ``REMOTE_TIMEOUT_S``.
        """
        link = self.link
        entries = sorted((t, q, o) for (t, q), o in offsets.items())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REMOTE_TIMEOUT_S
        while True:
            try:
                t = link.server.topics.topics.get(OFFSETS_TOPIC)
                if t is None:
                    link.groups.check_coordinator(group)  # creates it; raises
                    raise AssertionError("unreachable")
                rec = link.node.view.queues.get(
                    (OFFSETS_TOPIC, coordinator_queue(group, len(t.queues))))
                leader = rec.leader if rec is not None else NO_LEADER
                if leader == link.node.broker_id:
                    await link.groups.commit(group, "", -1, entries)
                    return
                if leader == NO_LEADER:
                    raise NotCoordinatorError(f"group {group!r} has no coordinator now")
                try:
                    resp = await self.peers.request(
                        leader, m.CommitOffsetsRequest(group, "", -1, entries),
                        m.CommitOffsetsResponse)
                except (ConnectionClosedError, FerryMQTimeoutError) as exc:
                    raise NotCoordinatorError(str(exc)) from None
                for tp, qn, code in resp.results:
                    if code:
                        raise error_for_code(code, f"offset of {tp}/{qn} for group {group!r}")
                return
            except BrokerError as exc:
                if not exc.retriable or loop.time() >= deadline:
                    raise
                await asyncio.sleep(RETRY_S)

    # --- compaction of the state log (statelog's module docstring) -----------------------------

    async def _compact_forever(self) -> None:
        while True:
            await asyncio.sleep(COMPACT_CHECK_S)
            try:
                await self.compact()
            except (BrokerError, OSError) as exc:  # tried again at the next check
                log.warning("compacting %s failed: %s", TXN_TOPIC, exc)

    async def compact(self, *, force: bool = False) -> bool:
        """Read the new replicated records of ``%TXN%state`` (led here); when it grew by
        ``txn_state_segment_bytes`` since its last compaction (or ``force``), write a snapshot
        of every transactional id's state and delete the segments it replaced. Whether it
        compacted."""
        srv = self.link.server
        statelog = self.txn.statelog
        if not self.leads or not statelog.exists:
            return False
        qs = statelog.queue
        if qs.replica is None:
            return False
        r = self._replay
        if r is None:  # a new leader compacts a log already grown past the limit at once
            r = self._replay = StateReplay(position=qs.log.start_offset)
            self._compacted_at = 0
        r.advance(qs, qs.visible_end)  # a leader's visible end is its high watermark
        if not force and qs.log.size_bytes - self._compacted_at < srv.config.txn_state_segment_bytes:
            return False
        upto = r.position
        now = srv.clock.wall_ms()
        end = upto
        for rec in r.snapshot_records(now, srv.config.txn_id_expiration_ms):
            end = statelog.write(rec, "")
        await replicated(qs.replica, end)
        if self._replay is not r:
            return False  # lost the log meanwhile: its next leader compacts
        deleted = qs.log.delete_before(upto, now_ms=srv.clock.wall_ms())
        self._compacted_at = qs.log.size_bytes
        log.info("compacted %s: a snapshot of %d transactional ids as of offset %d, %d segments "
                 "deleted, the log starts at %d", TXN_TOPIC, len(r.book.txns), upto, deleted,
                 qs.log.start_offset)
        return True

    async def stop(self) -> None:
        """Stop compacting."""
        if self._compactor is not None:
            self._compactor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._compactor

    def close(self) -> None:
        """Close the connections to other brokers."""
        self.peers.close()


def check_txn_request(link: ClusterLink | None, what: str) -> None:
    """Raise NOT_COORDINATOR unless this broker coordinates transactions (a single broker
    always does)."""
    if link is not None:
        link.txn.check_owner(what)

