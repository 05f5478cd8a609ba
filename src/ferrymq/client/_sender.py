"""The producer's sender: record batches, PRODUCE requests, in-flight limits, retries, epochs.

Theory of operation
-------------------
One task (:meth:`Sender.run`) wakes on the shared ``wake`` event, turns ready buffers of the
accumulator (:mod:`ferrymq.client._accumulator`) into record batches and ships the ready batches
of every queue in PRODUCE requests of at most ``max_request_bytes``, writing each as soon as it
is encoded, so the broker stores one while the next is encoded. A task per request awaits the
answer and settles the messages' futures.

Each batch goes to the leader of its queue (:meth:`ferrymq.client._cluster.Cluster.route`):
one request per leader is filled at a time. Requests reach a leader in the order they were
shipped: while one waits for the leader's connection, later ones queue behind it and the first
task to get the connection writes them all, oldest first (written at once on the open
connection, a later batch of a queue would reach the broker before an earlier one, and the
broker would refuse the earlier one as out of order). A batch whose queue has no live leader known, or
that a broker refused with NOT_LEADER, FENCED_LEADER_EPOCH or LEADER_NOT_AVAILABLE, or whose
leader's connection was lost, asks for a metadata refresh and is retried like any retriable
failure (so after the refresh it goes to the new leader), without waiting out its backoff once
a refresh shows its queue at a new leader epoch (Kafka's KIP-951). A transactional batch refused
with NOT_COORDINATOR (its queue's leader could not reach the transaction coordinator to register
the queue with the transaction) likewise goes again once a refresh shows ``%TXN%state`` at a new
leader epoch: the coordinator failed over. ``acks`` is sent with every
request:
``Acks.ALL`` (answered once every in-sync replica has the batch and the ISR has at least
``min_insync`` members; else the retriable NOT_ENOUGH_REPLICAS) or ``Acks.LEADER``.

Idempotence: the broker gives the producer an id; each batch carries the producer id, epoch and
the queue's next sequence number, fixed when the batch is built. A batch that fails with a
retriable error, a timeout or a dropped connection is sent again byte for byte after a backoff,
so the broker stores it once (it answers a duplicate with the first result). Up to
``max_in_flight_per_queue`` batches of a queue are on the wire at once; a retry goes out only
when nothing else of its queue is, lowest sequence first, and a batch refused as out of order
behind a failed one is retried after it (or, when that one waits for a new epoch, waits with
it), so retries never reorder a queue and messages of one sharding key keep their send order.
Retries stop at ``delivery_timeout_s``; then the messages fail with the last error. The sender
sleeps until a retry is due on a timer that it arms again when it fires early (uvloop rounds
delays to milliseconds): an early wake-up that finds nothing due must not be the last one.

Giving up on a batch leaves its queue's sequence in doubt (the broker may or may not have
stored it), so the queue starts a new epoch (Kafka's KIP-360): once none of its batches is on
the wire, its next batches, and those refused as out of order behind the failed one, go out
under the producer id with the epoch raised by one, from sequence 0. The broker accepts a higher
epoch at sequence 0 and fences the old one, so a late retry of the old epoch cannot land behind
them. Only non-transactional producers do this: a transactional one aborts and re-initialises
(:mod:`ferrymq.client._txn_manager`).

Dedup batches (``ATTR_DEDUP``) carry no producer id or sequence number: the broker may store
only some of their records (the keys make a retry harmless), and ``duplicates`` in the answer
map back to the messages by their index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ferrymq.client._accumulator import Accumulator, QueueBuffer, Unit, settle
from ferrymq.client._cluster import Cluster, means_stale_view
from ferrymq.client._session import Session
from ferrymq.client._transport import Transport
from ferrymq.client.message import DURABILITY_BY_WIRE, Durability, SendResult, SendResults
from ferrymq.errors import (
    BrokerError,
    ConnectionClosedError,
    FerryMQError,
    FerryMQTimeoutError,
    LeaderNotAvailableError,
    NotCoordinatorError,
    OutOfOrderSequenceError,
    UnknownTopicError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.coordinator import TXN_TOPIC
from ferrymq.protocol.records import (
    ATTR_DEDUP,
    ATTR_TRANSACTIONAL,
    LARGE_BODY_BYTES,
    MAX_PRODUCER_EPOCH,
    NO_PRODUCER_EPOCH,
    NO_PRODUCER_ID,
    NO_SEQUENCE,
    BatchBuffers,
    encode_batch,
    encode_batch_buffers,
    restamp_producer,
)

if TYPE_CHECKING:
    from ferrymq.client._txn_manager import TxnManager

log = logging.getLogger("ferrymq.client")


UNKNOWN_TOPIC_RETRIES = 5
"""In a cluster (the client talks to more than one broker), how many times a batch answered
UNKNOWN_TOPIC is sent again after a metadata refresh: a leader learns of a new topic from the
metadata store a moment after the broker that created it (Kafka retries
UNKNOWN_TOPIC_OR_PARTITION the same way); a deleted topic still fails within a second."""

MIN_TIMER_S = 0.001
"""The shortest timer the sender arms (uvloop's resolution: a shorter one fires at once)."""


@dataclass(eq=False)
class Batch:
    """One encoded record batch of a queue, from its first send until it is answered."""

    buf: QueueBuffer
    data: bytearray | BatchBuffers
    units: list[Unit]
    count: int
    deadline: float
    seq: int = NO_SEQUENCE
    attempts: int = 0
    last_error: BaseException | None = None
    not_before: float = 0.0
    sent_epoch: int | None = None
    """The leader epoch its queue had in the client's view when it was last routed."""
    sent_coordinator_epoch: int | None = None
    """A transactional batch's: the leader epoch of ``%TXN%state/0`` (the transaction
    coordinator) in the client's view when it was last routed."""
    stale_on: tuple[str, int] | None = None
    """The queue whose leader it failed for a stale view of (its own queue; ``%TXN%state/0``
    when its leader could not reach the transaction coordinator), None after another
    failure: a refresh that shows that queue at another epoch than :attr:`stale_epoch` ends
    its backoff (:meth:`Sender.on_refresh`)."""
    stale_epoch: int | None = None
    """The leader epoch of :attr:`stale_on` known when the batch was sent."""


@dataclass(eq=False, slots=True)
class _Request:
    """The PRODUCE request the sender is filling."""

    batches: list[Batch] = field(default_factory=list)
    nbytes: int = 0

    def take(self) -> list[Batch]:
        """Its batches; it starts empty again."""
        out, self.batches, self.nbytes = self.batches, [], 0
        return out


@dataclass(eq=False, slots=True)
class _Unwritten:
    """A PRODUCE request waiting for its leader's connection, then how it was written."""

    req: m.ProduceRequest
    sent: tuple[Transport, asyncio.Future[bytes | memoryview]] | None = None


class Sender:
    """Ships the accumulator's ready buffers and retries what failed.

    Args:
        session: the producer's bootstrap session (producer ids).
        cluster: the leaders and their sessions (each batch goes to its queue's leader).
        acc: the accumulator it drains.
        wake: set when there may be work (a buffer ready, a retry due, an answer came).
        request_timeout_s: one request's deadline.
        delivery_timeout_s: give up on a batch after this long (retries included).
        idempotent: stamp producer id and sequence numbers.
        max_in_flight: batches of one queue on the wire at once.
        max_request_bytes: a PRODUCE request's size (a larger batch goes alone).
        acks: ``Acks.ALL`` or ``Acks.LEADER``, sent with every request.
    """

    def __init__(self, session: Session, cluster: Cluster, acc: Accumulator,
                 wake: asyncio.Event, *, request_timeout_s: float, delivery_timeout_s: float,
                 idempotent: bool, max_in_flight: int, max_request_bytes: int,
                 acks: int = m.Acks.ALL) -> None:
        self._session = session
        self._cluster = cluster
        self._acks = acks
        self._acc = acc
        self._wake = wake
        self.backoff = session.backoff
        """The batches' retry backoff (the session's: tests may give the sender its own)."""
        self._request_timeout_s = request_timeout_s
        self._delivery_timeout_s = delivery_timeout_s
        self._idempotent = idempotent
        self._max_in_flight = max_in_flight
        self.max_request_bytes = max_request_bytes
        self.producer_id = NO_PRODUCER_ID
        self.producer_epoch = NO_PRODUCER_EPOCH
        self.txn: TxnManager | None = None  # set by a transactional producer
        self._retry: list[Batch] = []
        self._in_flight_requests = 0
        self._unwritten: dict[Session, deque[_Unwritten]] = {}  # waiting for a connection
        self._idle = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()  # requests in flight (strong references)

    def restart_sequences(self, producer_id: int, producer_epoch: int) -> None:
        """Send as ``producer_id`` at ``producer_epoch`` from now on: every queue starts again
        at sequence 0 (a new epoch)."""
        self.producer_id, self.producer_epoch = producer_id, producer_epoch
        for b in self._acc.buffers.values():
            b.next_seq = 0

    # -- flushing ------------------------------------------------------------------------------

    async def flush(self) -> None:
        """Send everything buffered now, and what is buffered until it is done, and wait until
        all of it is answered."""
        self._acc.flushing += 1
        try:
            self._acc.mark_ready()
            self._wake.set()
            while self._pending_work():
                self._idle.clear()
                self._wake.set()
                await self._idle.wait()
        finally:
            self._acc.flushing -= 1

    def _pending_work(self) -> bool:
        return bool(
            self._in_flight_requests or self._retry or self._acc.unresolved
            or any(b.records or b.outstanding for b in self._acc.buffers.values())
        )

    # -- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        """The sender task: ship what is ready whenever ``wake`` is set."""
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            now = loop.time()
            reqs: dict[Session, _Request] = {}  # one being filled per leader
            for bt in self._due_retries(now):
                self._add_to_request(reqs, bt)
            for b in self._acc.buffers.values():
                if b.ready and b.records and not b.retrying and not b.gap and len(b.outstanding) < (
                        1 if b.units[0].attrs & ATTR_DEDUP else self._max_in_flight):
                    self._add_to_request(reqs, self._close_batch(b, now))
            for session, req in reqs.items():
                if req.batches:
                    self._ship(session, req.take())
            if not self._pending_work():
                self._idle.set()

    def _due_retries(self, now: float) -> list[Batch]:
        """Retries to send now: per queue the one with the lowest sequence, once its wait is
        over and nothing else of its queue is on the wire (so they are stored in order)."""
        out: list[Batch] = []
        if not self._retry:
            return out
        keep: list[Batch] = []
        taken: set[int] = set()
        for rb in sorted(self._retry, key=lambda x: x.seq):
            b = rb.buf
            if (rb.not_before <= now and id(b) not in taken
                    and len(b.outstanding) == b.retrying + len(b.held)):
                taken.add(id(b))
                b.retrying -= 1
                out.append(rb)
            else:
                taken.add(id(b))  # a later retry of this queue waits for this one
                keep.append(rb)
        self._retry = keep
        return out

    def _close_batch(self, b: QueueBuffer, now: float) -> Batch:
        records, units, nbytes, attrs = self._acc.drain(b)
        seq = NO_SEQUENCE
        data: bytearray | BatchBuffers
        if attrs & ATTR_DEDUP:  # the broker may store fewer records: no sequence numbers
            data = encode_batch(records, attributes=attrs)
        else:
            if self._idempotent:
                seq = b.next_seq
                b.next_seq += len(records)
            if self.txn is not None:
                attrs |= ATTR_TRANSACTIONAL
            # large bodies are not copied into the batch: they go to the socket as they are
            encode = (encode_batch_buffers if nbytes >= len(records) * LARGE_BODY_BYTES
                      else encode_batch)
            data = encode(records, producer_id=self.producer_id if b.pid is None else b.pid,
                          producer_epoch=self.producer_epoch if b.epoch is None else b.epoch,
                          base_sequence=seq, attributes=attrs)
        bt = Batch(b, data, units, len(records), now + self._delivery_timeout_s, seq)
        b.outstanding.append(bt)
        return bt

    def _add_to_request(self, reqs: dict[Session, _Request], bt: Batch) -> None:
        """Add ``bt`` to the request being filled for its queue's leader; ship the request
        once it is full (a batch that does not fit ships the request before it). A batch whose
        queue has no live leader known waits for a refresh as a retry."""
        topic = bt.buf.topic.name
        session = self._cluster.route(topic, bt.buf.queue)
        if session is None:
            self._cluster.refresh_soon((topic,))
            self._retry_or_fail(bt, LeaderNotAvailableError(
                f"{topic}/{bt.buf.queue}: no live leader known"))
            return
        bt.sent_epoch = self._cluster.leaders.epoch(topic, bt.buf.queue)
        if self.txn is not None:
            bt.sent_coordinator_epoch = self._cluster.leaders.epoch(TXN_TOPIC, 0)
        req = reqs.get(session)
        if req is None:
            req = reqs[session] = _Request()
        n = len(bt.data)
        if req.batches and req.nbytes + n > self.max_request_bytes:
            self._ship(session, req.take())
        req.batches.append(bt)
        req.nbytes += n
        if req.nbytes >= self.max_request_bytes:
            self._ship(session, req.take())

    # -- requests ------------------------------------------------------------------------------

    def _ship(self, session: Session, batches: list[Batch]) -> None:
        """Write a PRODUCE request of ``batches`` to ``session`` (their leader's) now if its
        connection is open and no earlier request waits for it (so the broker works on it
        while the next is encoded); a task awaits the answer (or connects, see
        :meth:`_write_in_order`)."""
        req = m.ProduceRequest(
            int(self._request_timeout_s * 1000),
            [(bt.buf.topic.name, bt.buf.queue, bt.data) for bt in batches],
            self._acks,
        )
        sent: tuple[Transport, asyncio.Future[bytes | memoryview]] | None = None
        conn = session.open_connection
        if conn is not None and session not in self._unwritten:
            with contextlib.suppress(ConnectionClosedError):  # the task reconnects
                sent = (conn, conn.send(req))
        if sent is None:
            unwritten = _Unwritten(req)
            self._unwritten.setdefault(session, deque()).append(unwritten)
        self._in_flight_requests += 1
        task = asyncio.get_running_loop().create_task(
            self._send_request(session, batches, req, unwritten if sent is None else sent))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write_in_order(
        self, session: Session, mine: _Unwritten,
    ) -> tuple[Transport, asyncio.Future[bytes | memoryview]]:
        """Connect, then write the requests waiting for ``session``'s connection, oldest
        first, up to ``mine``. A request shipped later must not overtake them: the broker
        stores a queue's batches in the order they arrive, and would refuse the earlier ones
        as out of order (a producer it does not know yet may start at any sequence).

        Raises:
            ConnectionClosedError: no connection (``mine`` is not written).
        """
        waiting = self._unwritten[session]
        try:
            while (sent := mine.sent) is None:
                try:
                    conn = await session.connection()
                except FerryMQError:
                    if mine.sent is None:
                        raise
                    continue  # an earlier request's task wrote it
                while waiting and mine.sent is None:  # raises if it closed: mine waits on
                    waiting[0].sent = (conn, conn.send(waiting[0].req))
                    waiting.popleft()
            return sent
        finally:
            if mine.sent is None:
                waiting.remove(mine)
            if not waiting and self._unwritten.get(session) is waiting:
                del self._unwritten[session]

    async def _send_request(
        self, session: Session, batches: list[Batch], req: m.ProduceRequest,
        sent: tuple[Transport, asyncio.Future[bytes | memoryview]] | _Unwritten,
    ) -> None:
        try:
            try:
                if isinstance(sent, _Unwritten):  # not written yet: (re)connect first
                    sent = await self._write_in_order(session, sent)
                conn, fut = sent
                resp = await conn.response(fut, req, m.ProduceResponse, self._request_timeout_s)
            except (ConnectionClosedError, FerryMQTimeoutError, BrokerError) as exc:
                if means_stale_view(exc) or isinstance(exc, FerryMQTimeoutError):
                    # a lost or silent leader: maybe a failover (the refresh says)
                    self._cluster.refresh_soon({bt.buf.topic.name for bt in batches})
                for bt in batches:
                    self._retry_or_fail(bt, exc)
                return
            for bt, res in zip(batches, resp.results, strict=False):
                _t, _q, code, msg, base, _last, _ts, durability, topic_id, dups = res
                if code:
                    err = error_for_code(code, msg)
                    if means_stale_view(err):
                        self._cluster.refresh_soon((bt.buf.topic.name,))
                    self._retry_or_fail(bt, err)
                    continue
                self._complete(bt, base, DURABILITY_BY_WIRE.get(durability, Durability.NONE),
                               topic_id, dups)
        finally:
            self._in_flight_requests -= 1
            self._wake.set()

    def _complete(self, bt: Batch, base: int, durability: Durability, topic_id: int,
                  dups: list[m.Duplicate]) -> None:
        bt.buf.outstanding.remove(bt)
        if bt.buf.gap:
            self._new_epoch_if_settled(bt.buf)
        topic, queue = bt.buf.topic.name, bt.buf.queue
        if dups:
            _complete_with_duplicates(bt, base, durability, topic_id, dups)
            return
        off = base
        for u in bt.units:
            if u.future is not None and not u.future.done():
                if u.many:
                    u.future.set_result(SendResults(topic, queue, off, u.count, durability,
                                                    topic_id))
                else:
                    u.future.set_result(SendResult(topic, queue, off, durability, topic_id))
            off += u.count

    # -- retries and epochs --------------------------------------------------------------------

    def _retry_or_fail(self, bt: Batch, exc: BaseException) -> None:
        loop = asyncio.get_running_loop()
        retriable = isinstance(exc, (ConnectionClosedError, FerryMQTimeoutError)) or (
            isinstance(exc, BrokerError) and exc.retriable
        ) or (isinstance(exc, OutOfOrderSequenceError)  # an earlier one failed and goes
              and any(o.seq < bt.seq and o not in bt.buf.held  # again in this epoch (one
                      for o in bt.buf.outstanding)  # held for the next: this one waits too)
              ) or (isinstance(exc, UnknownTopicError) and bool(self._cluster.sessions)
                    and bt.attempts < UNKNOWN_TOPIC_RETRIES)  # a leader not told of it yet

        if isinstance(exc, UnknownTopicError):
            self._session.topics.pop(bt.buf.topic.name, None)
            self._cluster.refresh_soon((bt.buf.topic.name,))
        bt.attempts += 1
        bt.last_error = exc
        b = bt.buf
        closed = self._acc.closed
        if (isinstance(exc, OutOfOrderSequenceError) and not retriable and self.txn is None
                and bt.seq != NO_SEQUENCE and not closed and loop.time() < bt.deadline):
            # a gap before it (an earlier batch given up, or the broker lost our state): it
            # goes again under the queue's next epoch
            b.gap = True
            b.held.append(bt)
            self._new_epoch_if_settled(b)
            return
        delay = self.backoff.delay_after(exc, bt.attempts)  # >= the broker's retry-after
        if retriable and not closed and loop.time() + delay < bt.deadline:
            bt.not_before = loop.time() + delay
            self._note_stale_view(bt, exc)
            if bt.stale_on is not None and self._end_backoff_if_moved(bt, loop.time()):
                self._wake.set()  # the view moved while it was on the wire: go again now
            bt.buf.retrying += 1
            self._retry.append(bt)
            self._wake_at(bt.not_before)
            return
        b.outstanding.remove(bt)
        if bt.seq != NO_SEQUENCE and self.txn is None:
            b.gap = True  # stored or not, nobody knows: the queue's sequence is in doubt
            self._new_epoch_if_settled(b)
        if retriable:
            what = (f"{exc.code.name}: " if isinstance(exc, BrokerError) else "")
            exc = FerryMQTimeoutError(
                f"not delivered within delivery_timeout_s={self._delivery_timeout_s:g} "
                f"({bt.attempts} attempts); last error: {what}{exc}")
        if self.txn is not None:
            self.txn.send_failed(exc)  # the transaction cannot commit now
        for u in bt.units:
            settle(u, exc=exc)

    def _note_stale_view(self, bt: Batch, exc: BaseException) -> None:
        """Whether ``exc`` says the client's view of a leader is stale, and whose: the batch's
        queue's (NOT_LEADER and the like), or the transaction coordinator's (a transactional
        batch refused with NOT_COORDINATOR: its queue's leader could not reach the coordinator
        to register the queue with the transaction, KIP-890's verification; the coordinator
        failed over, or is failing over). Either way the retry goes as soon as a refresh shows
        that leader moved, not after its whole backoff (KIP-951)."""
        if means_stale_view(exc):
            bt.stale_on, bt.stale_epoch = (bt.buf.topic.name, bt.buf.queue), bt.sent_epoch
        elif isinstance(exc, NotCoordinatorError) and self.txn is not None:
            bt.stale_on, bt.stale_epoch = (TXN_TOPIC, 0), bt.sent_coordinator_epoch
            self._cluster.refresh_soon((TXN_TOPIC,))
        else:
            bt.stale_on = bt.stale_epoch = None

    def _wake_at(self, when: float) -> None:
        """Wake the sender once the loop's clock reaches ``when`` (a retry's ``not_before``).
        A timer may fire early (uvloop rounds its delays to whole milliseconds): the retry
        would not be due yet, and with nothing else to wake the sender it would wait for ever
        (its delivery timeout never checked), so an early one is armed again for the rest."""
        loop = asyncio.get_running_loop()
        left = when - loop.time()
        if left <= 0:
            self._wake.set()
        else:
            loop.call_later(max(left, MIN_TIMER_S), self._wake_at, when)

    def _new_epoch_if_settled(self, b: QueueBuffer) -> None:
        """Start queue ``b`` on a new epoch once none of its batches is on the wire or waits
        for a retry (so no old-epoch batch can follow): the held batches, in their order, get
        sequences from 0 and are retried at once; the buffer's batches follow them."""
        if len(b.outstanding) != len(b.held) or b.pid == NO_PRODUCER_ID:
            return
        epoch = (self.producer_epoch if b.epoch is None else b.epoch) + 1
        if epoch > MAX_PRODUCER_EPOCH:  # 32,767 give-ups on one queue: a new producer id
            b.pid = NO_PRODUCER_ID  # asking (the buffer waits: gap stays set)
            task = asyncio.get_running_loop().create_task(self._new_producer_id(b))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._restart_queue(b, self.producer_id if b.pid is None else b.pid, epoch)

    async def _new_producer_id(self, b: QueueBuffer) -> None:
        attempt = 0
        while not self._acc.closed:
            try:
                resp = await self._session.request(m.InitProducerRequest(None),
                                                   m.InitProducerResponse)
            except FerryMQError as exc:
                attempt += 1
                await asyncio.sleep(self._session.backoff.delay_after(exc, attempt))
                continue
            self._restart_queue(b, resp.producer_id, resp.producer_epoch)
            return

    def _restart_queue(self, b: QueueBuffer, pid: int, epoch: int) -> None:
        held = sorted(b.held, key=lambda x: x.seq)
        log.info("%s/%d: a batch was given up or refused out of order; producer %d goes on "
                 "at epoch %d from sequence 0 (%d batches re-sent)", b.topic.name, b.queue,
                 pid, epoch, len(held))
        b.held.clear()
        b.gap = False
        b.pid = None if pid == self.producer_id else pid
        b.epoch = epoch
        b.next_seq = 0
        now = asyncio.get_running_loop().time()
        for bt in held:
            restamp_producer(bt.data, pid, epoch, b.next_seq)
            bt.seq = b.next_seq
            b.next_seq += bt.count
            bt.not_before = now
            b.retrying += 1
            self._retry.append(bt)
        self._wake.set()

    def on_refresh(self) -> None:
        """The leaders were refreshed: a retry that failed for a stale view goes at once if
        its queue's leader epoch changed (KIP-951: no backoff once the new leader is known),
        else the leaders are asked again; then the sender looks for work."""
        if self._retry:
            now = asyncio.get_running_loop().time()
            waiting: set[str] = set()
            for bt in self._retry:
                if bt.stale_on is None or bt.not_before <= now:
                    continue
                if not self._end_backoff_if_moved(bt, now):
                    waiting.add(bt.stale_on[0])
            if waiting:  # not moved yet: ask again (paced by min_refresh_interval_s, as
                self._cluster.refresh_soon(waiting)  # Kafka polls metadata by retry.backoff.ms)
        self._wake.set()

    def _end_backoff_if_moved(self, bt: Batch, now: float) -> bool:
        """End ``bt``'s backoff if the leader epoch of the queue it failed for a stale view of
        (:attr:`Batch.stale_on`) moved past the one it was sent under and a live leader is
        known; whether it did."""
        leaders = self._cluster.leaders
        if bt.stale_on is None:
            return False
        name, queue = bt.stale_on
        if leaders.epoch(name, queue) == bt.stale_epoch or leaders.leader(name, queue) is None:
            return False
        bt.not_before = now
        bt.stale_on = bt.stale_epoch = None
        return True

    def fail_everything(self, exc: BaseException) -> None:
        """Fail every message not answered yet: buffered, waiting for a retry or held (the
        producer is closed)."""
        self._acc.fail_buffered(exc)
        for bt in self._retry:
            for u in bt.units:
                settle(u, exc=exc)
            if bt in bt.buf.outstanding:
                bt.buf.outstanding.remove(bt)
        self._retry.clear()
        for b in self._acc.buffers.values():
            b.retrying = 0
            for bt in b.held:
                for u in bt.units:
                    settle(u, exc=exc)
                b.outstanding.remove(bt)
            b.held.clear()


def _complete_with_duplicates(bt: Batch, base: int, durability: Durability, topic_id: int,
                              dups: list[m.Duplicate]) -> None:
    """Settle the units of a dedup batch the broker stored only in part: a record listed in
    ``dups`` gets the stored original's place, the others the stored offsets in order."""
    topic, queue = bt.buf.topic.name, bt.buf.queue
    originals = {i: (q, off) for i, q, off in dups}
    stored = base
    i = 0
    for u in bt.units:
        out: list[SendResult] = []
        for _ in range(u.count):
            orig = originals.get(i)
            if orig is None:
                out.append(SendResult(topic, queue, stored, durability, topic_id))
                stored += 1
            else:
                out.append(SendResult(topic, orig[0], orig[1], durability, topic_id,
                                      duplicate=True))
            i += 1
        if u.future is not None and not u.future.done():
            u.future.set_result(out if u.many else out[0])
