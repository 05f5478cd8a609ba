"""The follower's side: one fetcher per leader broker, truncation by epoch, copying batches.

Theory of operation
-------------------
A queue this broker follows carries a :class:`FollowerQueue` (its
:class:`~ferrymq.broker.topics.ReplicaRole`: produce is refused with NOT_LEADER naming the
leader). All the queues followed from one leader broker share one :class:`Fetcher`: one task, one
connection (the clients' transport and handshake, :mod:`ferrymq.client._transport`), one
long-polled REPLICA_FETCH at a time covering every queue.

1. **Truncation first** (KIP-101 / KIP-279). A queue new to the fetcher (a new leader or epoch)
   is fetched only after OFFSET_FOR_EPOCH: the follower asks where its latest epoch ends on the
   leader and cuts its log where :meth:`~ferrymq.storage.epochs.LeaderEpochCache.
   truncation_point` says, asking again while the answer names an epoch it does not know. Never
   to its own high watermark (that lost acknowledged data after double failovers in Kafka).
2. **Fetch.** Each entry carries the queue's leader epoch, the follower's log end (the fetch
   offset) and durable offset; that is how the leader learns positions. Batches come back as the
   leader stored them and go into the log with ``Log.append_replica`` (same offsets, same bytes),
   each after the epoch entry that starts at or before it was ``assign``\\ ed; batches the follower
   has already (an answer overtaken by a newer fetch) are skipped; a gap stops the queue's
   copy until truncation ran again. The queue is marked dirty with the broker's flusher: in sync
   mode the follower fsyncs by group commit, as the leader does.
3. **Positions.** In sync mode the high watermark waits for the followers' fsyncs. An answer
   that brought the follower up to the leader's end (the latency regime: nothing more to fetch)
   is followed by the next long poll only once the flush round of the copy made it durable
   (``QueueState.advance`` from the flusher calls :meth:`FollowerQueue.on_local_progress`,
   which nudges the fetcher; at most ``replica_fetch_wait_ms`` if the flush fails), so the long
   poll itself carries the new durable offset: one request per round. An answer that left more
   on the leader (the throughput regime) is followed by the next long poll at once, so copying
   goes on during the fsync; when that flush makes more of the log durable, the fetcher sends a
   position report (a REPLICA_FETCH with ``max_bytes`` 0, answered at once) beside the long poll
   in flight. In async mode the next long poll, sent right after the append, carries the new
   log end.
4. **Errors.** NOT_LEADER / FENCED_LEADER_EPOCH: the metadata is catching up (the node will
   call :meth:`~ferrymq.cluster.replication.ReplicaManager.become_follower` with the new
   record); the queue rests briefly and is asked again, in a new long poll as soon as its rest
   ends (the one in flight for the other queues is cut short: a follower that learnt of a new
   leader before the leader did would otherwise copy nothing for ``replica_fetch_wait_ms``,
   and ``acks="all"`` writes there would wait as long). OFFSET_OUT_OF_RANGE past the leader's
   end: truncate again; before the leader's start (retention there): empty the log and start
   it at the leader's start (``Log.truncate_fully_and_start_at``). A lost connection:
   reconnect with a capped backoff.

The follower's ``visible_end`` follows the leader's high watermark (capped at its own log end);
consumers do not read it (the node answers NOT_LEADER), but a follower that becomes leader
starts its high watermark there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias

from ferrymq._version import __version__
from ferrymq.client._transport import Transport
from ferrymq.errors import (
    AccessDeniedError,
    AuthenticationFailedError,
    AuthenticationRequiredError,
    BrokerError,
    ConnectionClosedError,
    FerryMQTimeoutError,
    NotLeaderError,
    StorageError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import NONCE_BYTES
from ferrymq.protocol.client import ClientHandshake
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.records import ATTR_SCHEDULED, iter_batches

if TYPE_CHECKING:
    from collections.abc import Callable

    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.topics import QueueState
    from ferrymq.cluster.model import QueueRecord

log = logging.getLogger("ferrymq.cluster")

RETRY_AFTER_METADATA_S = 0.2
"""How long a queue rests after NOT_LEADER / FENCED_LEADER_EPOCH (the metadata catches up)."""
RETRY_AFTER_ERROR_S = 1.0
"""How long a queue rests after another error (a failed write, a leader without its start)."""
REST_SLACK_S = 0.002
"""Added to a rest's end when a long poll waits for it (uvloop's timers fire up to 0.5 ms
early: one firing before the rest ended would find the queue still resting)."""
MAX_BACKOFF_S = 1.0
"""Longest wait between two connection attempts to a leader."""
MAX_TRUNCATION_ROUNDS = 64
"""Most OFFSET_FOR_EPOCH rounds for one queue (each asks about a smaller epoch)."""
ScheduledCopied: TypeAlias = "Callable[[QueueState, bytes | memoryview, int, int], None]"
"""Told of a scheduled batch just copied: ``(queue, batch, base offset, append time ms)``."""
Truncated: TypeAlias = "Callable[[QueueState, int], None]"
"""Told that a queue's log was cut to end at an offset (its scheduler forgets what it read
above it)."""
_METADATA_CODES = (ErrorCode.NOT_LEADER, ErrorCode.FENCED_LEADER_EPOCH,
                   ErrorCode.LEADER_NOT_AVAILABLE, ErrorCode.UNKNOWN_TOPIC)


@dataclass(frozen=True, slots=True)
class PeerLogin:
    """How a follower connects to its leaders: as a client of theirs (``inter_broker_user``,
    the TLS of the brokers' listeners), resolved once from the broker's config."""

    auth: tuple[str, str] | None = None
    """(user, secret) to log in with; None: no login (brokers without ``users_file``)."""
    tls: ssl.SSLContext | None = None
    """The TLS context of the connections; None: plain TCP."""


async def connect_peer(addr: tuple[str, int], login: PeerLogin, client_id: str,
                       timeout_s: float) -> Transport:
    """A connection to another broker of the cluster, logged in as ``login`` says.

    Raises:
        ConnectionClosedError, FerryMQTimeoutError, OSError: not reached.
        BrokerError: the login was refused.
    """
    t = await Transport.connect(addr[0], addr[1], timeout_s, login.tls)
    try:
        hs = ClientHandshake(client_id, __version__, login.auth,
                             login.auth and secrets.token_bytes(NONCE_BYTES))
        while (req := hs.next_request()) is not None:
            hs.receive(await t.request(req, req.RESPONSE, timeout_s))
    except BaseException:
        t.close()
        raise
    return t


class FollowerHost(Protocol):
    """What a :class:`Fetcher` needs of the replica manager."""

    broker_id: int
    incarnation: int
    sync: bool
    flusher: Flusher
    fetch_wait_ms: int
    fetch_bytes: int
    connect_timeout_s: float
    peer_login: PeerLogin
    on_scheduled: ScheduledCopied | None
    on_truncated: Truncated | None

    def address_of(self, broker_id: int) -> tuple[str, int] | None:
        """Where a live broker listens (None: not known now)."""
        ...

    def monotonic(self) -> float:
        """Monotonic seconds."""
        ...

    def wall_ms(self) -> int:
        """Wall-clock milliseconds."""
        ...


class FollowerQueue:
    """This broker follows ``qs`` from ``record.leader`` at ``record.leader_epoch``."""

    def __init__(self, host: FollowerHost, qs: QueueState, record: QueueRecord) -> None:
        self.host = host
        self.qs = qs
        self.leader = record.leader
        self.epoch = record.leader_epoch
        self.truncated = False
        """OFFSET_FOR_EPOCH ran: the log is a prefix of the leader's."""
        self.rest_until = 0.0
        """Left out of fetches until then (monotonic seconds) after an error."""
        self.reported_durable = -1
        self.fetcher: Fetcher | None = None

    def __str__(self) -> str:
        return f"{self.qs} (follower of broker {self.leader}, epoch {self.epoch})"

    @property
    def key(self) -> tuple[str, int]:
        """(topic, queue)."""
        return self.qs.topic, self.qs.queue

    def on_local_progress(self, qs: QueueState) -> None:
        """A flush made more of the copy durable: report it (sync mode: the HW waits for it)."""
        if (self.fetcher is not None and self.host.sync
                and qs.log.durable_offset > self.reported_durable):
            self.fetcher.report()

    def check_produce(self, acks: int) -> None:
        """Producers write to the leader."""
        raise NotLeaderError(self._not_leader())

    def wait_acks(self, end: int, timeout_ms: int,
                  cb: Callable[[BaseException | None], None]) -> None:
        """Never reached (produce is refused first)."""
        cb(NotLeaderError(self._not_leader()))

    def _not_leader(self) -> str:
        return (f"broker {self.host.broker_id} follows {self.qs}: broker {self.leader} leads it "
                f"(epoch {self.epoch})")


class Fetcher:
    """Copies every queue this broker follows from one leader broker (see the module
    docstring)."""

    def __init__(self, host: FollowerHost, leader: int) -> None:
        self.host = host
        self.leader = leader
        self.queues: dict[tuple[str, int], FollowerQueue] = {}
        self._nudge: asyncio.Future[None] | None = None
        self._changed = False
        self._report = False
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._login_refused = False
        """The last login failed (logged as an error once, then quietly until one works)."""
        self.transport: Transport | None = None
        self.rounds = 0
        """REPLICA_FETCH answers applied (for tests and logs)."""

    # --- the manager's side ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the fetch task."""
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"ferrymq-replica-fetcher-{self.leader}")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("replication from broker %d stopped: %r", self.leader, exc,
                      exc_info=exc)

    def add(self, fq: FollowerQueue) -> None:
        """Fetch ``fq`` too (after truncating it)."""
        fq.fetcher = self
        self.queues[fq.key] = fq
        self._changed = True
        self._wake()

    def remove(self, key: tuple[str, int]) -> None:
        """Stop fetching ``key``."""
        fq = self.queues.pop(key, None)
        if fq is not None:
            fq.fetcher = None
            self._changed = True
            self._wake()

    def report(self) -> None:
        """Send the leader this follower's durable offsets now (beside the long poll)."""
        if not self._report:
            self._report = True
            self._wake()

    async def close(self) -> None:
        """Stop the task and the connection."""
        self._closed = True
        task, self._task = self._task, None
        # Python 3.11's asyncio.wait_for swallows a cancellation that arrives as the awaited
        # answer does: cancel until the task has ended (the loops also check _closed)
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)
        if self.transport is not None:
            self.transport.close("the follower stopped")
            self.transport = None

    def _wake(self) -> None:
        if self._nudge is not None and not self._nudge.done():
            self._nudge.set_result(None)

    # --- the task ----------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closed:
            try:
                t = await self._connect()
                if t is None:
                    await asyncio.sleep(backoff)
                    continue
                backoff = 0.05
                self._login_refused = False
                self.transport = t
                try:
                    await self._session(t)
                finally:
                    t.close("the follower reconnects")
                    self.transport = None
            except (AuthenticationFailedError, AuthenticationRequiredError,
                    AccessDeniedError) as exc:  # a setting to fix: say so once, keep trying
                log.log(logging.INFO if self._login_refused else logging.ERROR,
                        "replication from broker %d refused this broker's login (check "
                        "inter_broker_user and inter_broker_password: an admin of the "
                        "brokers' users file): %s", self.leader, exc)
                self._login_refused = True
                await asyncio.sleep(MAX_BACKOFF_S)
            except (ConnectionClosedError, FerryMQTimeoutError, BrokerError) as exc:
                log.info("replication from broker %d: %s; reconnecting", self.leader, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _connect(self) -> Transport | None:
        addr = self.host.address_of(self.leader)
        if addr is None:
            return None
        return await connect_peer(addr, self.host.peer_login,
                                  f"ferrymq-replica-{self.host.broker_id}",
                                  self.host.connect_timeout_s)

    async def _rest(self, seconds: float) -> None:
        """Sleep, or less if the queues change."""
        nudge = self._new_nudge()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(nudge, seconds)

    def _new_nudge(self) -> asyncio.Future[None]:
        self._nudge = asyncio.get_running_loop().create_future()
        if self._changed or self._report:
            self._nudge.set_result(None)
        return self._nudge

    async def _session(self, t: Transport) -> None:
        wait_ms = self.host.fetch_wait_ms
        answer_s = wait_ms / 1000 + self.host.connect_timeout_s
        while not self._closed:
            self._changed = False
            await self._truncate(t)
            ready = self._ready()
            if not ready:
                await self._rest(self._next_rest())
                continue
            req = self._request(ready, wait_ms, self.host.fetch_bytes * len(ready))
            self._report = False  # the long poll carries the durable offsets
            fut = t.send(req)
            fut.add_done_callback(_retrieved)  # it may be left behind (superseded, closed)
            while not fut.done():
                nudge = self._new_nudge()
                rest = self._rest_left(ready)
                done, _ = await asyncio.wait(
                    (fut, nudge), timeout=answer_s if rest is None else min(answer_s, rest),
                    return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    if rest is not None and rest < answer_s:
                        break  # a queue's rest ended: a new long poll with it
                    raise FerryMQTimeoutError(
                        f"REPLICA_FETCH got no answer within {answer_s:.3g} s")
                if fut.done():
                    break
                if self._report:
                    self._report = False
                    ready_now = self._ready()
                    if ready_now:
                        rep = self._request(ready_now, 0, 0)
                        self._apply(await t.response(t.send(rep), rep, m.ReplicaFetchResponse,
                                                     answer_s), ready_now)
                if self._changed:
                    break  # a new long poll (the leader answers the old one at once)
            if fut.done() and self._apply(
                    await t.response(fut, req, m.ReplicaFetchResponse, answer_s), ready):
                await self._until_durable(wait_ms / 1000)

    async def _until_durable(self, seconds: float) -> None:
        """Sync mode, caught up with the leader: the next long poll goes once the copy's flush
        round made it durable (:meth:`report`), or after ``seconds`` (a failed flush), so that it
        carries the new durable offset and no position report is needed (see the module
        docstring)."""
        nudge = self._new_nudge()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(nudge, seconds)

    def _ready(self) -> list[FollowerQueue]:
        now = self.host.monotonic()
        return [fq for fq in self.queues.values() if fq.truncated and fq.rest_until <= now]

    def _rest_left(self, polled: list[FollowerQueue]) -> float | None:
        """Seconds until a queue left out of the long poll ``polled`` because it rests may be
        fetched again (a little more: a timer may fire early), None when none rests: its rest's
        end must cut the long poll short, or the queue would wait for it
        (``replica_fetch_wait_ms``) while its leader waits for it to copy."""
        now = self.host.monotonic()
        keys = {fq.key for fq in polled}
        rests = [fq.rest_until - now for fq in self.queues.values()
                 if fq.key not in keys and fq.rest_until > now]
        return min(rests) + REST_SLACK_S if rests else None

    def _next_rest(self) -> float:
        now = self.host.monotonic()
        rests = [fq.rest_until - now for fq in self.queues.values() if fq.rest_until > now]
        return max(0.01, min(rests, default=self.host.fetch_wait_ms / 1000))

    def _request(self, ready: list[FollowerQueue], wait_ms: int,
                 max_bytes: int) -> m.ReplicaFetchRequest:
        entries: list[m.ReplicaFetchEntry] = []
        for fq in ready:
            lg = fq.qs.log
            durable = lg.durable_offset
            fq.reported_durable = durable
            entries.append((fq.qs.topic, fq.qs.queue, fq.epoch, lg.end_offset, durable))
        return m.ReplicaFetchRequest(self.host.broker_id, self.host.incarnation, wait_ms,
                                     max_bytes, entries)

    # --- truncation --------------------------------------------------------------------------

    async def _truncate(self, t: Transport) -> None:
        now = self.host.monotonic()
        asking = {fq.key: fq for fq in self.queues.values()
                  if not fq.truncated and fq.rest_until <= now}
        for _round in range(MAX_TRUNCATION_ROUNDS):
            if not asking:
                return
            req = m.OffsetForEpochRequest(self.host.broker_id, [
                (fq.qs.topic, fq.qs.queue, fq.epoch, fq.qs.log.epochs.latest_epoch())
                for fq in asking.values()])
            resp = await t.request(req, m.OffsetForEpochResponse, self.host.connect_timeout_s)
            again: dict[tuple[str, int], FollowerQueue] = {}
            for topic, queue, code, epoch, end in resp.results:
                fq = asking.get((topic, queue))
                if fq is None or self.queues.get(fq.key) is not fq:
                    continue  # not asked, or replaced meanwhile
                if code:
                    self._on_error(fq, code, f"OFFSET_FOR_EPOCH answered {ErrorCode(code).name}")
                    continue
                lg = fq.qs.log
                offset, final = lg.epochs.truncation_point((epoch, end), lg.start_offset,
                                                           lg.end_offset)
                if offset < lg.end_offset:
                    self._truncate_to(fq, offset, (epoch, end))
                if final:
                    fq.truncated = True
                else:
                    again[fq.key] = fq
            asking = again
        for fq in asking.values():  # pragma: no cover - epochs only shrink, so this ends
            self._on_error(fq, ErrorCode.INTERNAL_ERROR, "truncation did not converge")

    def _truncate_to(self, fq: FollowerQueue, offset: int, answer: tuple[int, int]) -> None:
        qs = fq.qs
        log.warning("%s: log end %d diverged from the leader's (its epoch %d ends at %d): "
                    "truncating to %d", fq, qs.log.end_offset, answer[0], answer[1], offset)
        qs.log.truncate_to(offset)
        if self.host.on_truncated is not None:
            self.host.on_truncated(qs, offset)
        if qs.visible_end > offset:  # a follower's visible end is not read by consumers
            qs.visible_end = offset

    # --- applying answers --------------------------------------------------------------------

    def _apply(self, resp: m.ReplicaFetchResponse, sent: list[FollowerQueue]) -> bool:
        """Copy an answer's batches; whether the next long poll should wait for their flush
        (sync mode, something copied, and every queue of the answer caught up with the
        leader's end: nothing is waiting there to be fetched meanwhile)."""
        self.rounds += 1
        asked = {fq.key: fq for fq in sent}
        epochs = {(topic, queue): entries for topic, queue, entries in resp.epochs}
        copied: list[FollowerQueue] = []
        caught_up = True
        for topic, queue, code, msg, hw, end, start, data in resp.results:
            fq = asked.get((topic, queue))
            if fq is None or self.queues.get(fq.key) is not fq:
                continue  # no longer followed (or at another epoch): drop the answer
            if code:
                self._on_error(fq, code, msg, end, start)
                caught_up = False
                continue
            if data and self._copy(fq, data, epochs.get((topic, queue), [])):
                copied.append(fq)
            if start > fq.qs.log.start_offset:
                self._follow_start(fq, start)
            caught_up = caught_up and fq.qs.log.end_offset >= end
            # the leader's HW, even below what this replica showed before (its recovered log
            # end after a restart): a follower is not read, and a leader starts from it
            fq.qs.visible_end = min(hw, fq.qs.log.end_offset)
        if copied:  # sync mode: one group commit round fsyncs them; the report follows
            self.host.flusher.mark_all_dirty(fq.qs for fq in copied)
        return self.host.sync and caught_up and bool(copied)

    def _copy(self, fq: FollowerQueue, data: bytes | memoryview,
              entries: list[tuple[int, int]]) -> bool:
        """Append the batches of ``data`` the log does not have yet; whether any was."""
        lg = fq.qs.log
        todo = [e for e in entries if e[0] > lg.epochs.latest_epoch()]
        copied = False
        try:
            self.host.flusher.check_writable(fq.qs)  # its last fsync failed: copy nothing
            for pos, h in iter_batches(data):
                have = lg.end_offset
                if h.last_offset < have:
                    continue  # an overtaken answer: copied already
                if h.base_offset != have:
                    log.warning("%s: the leader sent offset %d, the log ends at %d: "
                                "truncating again", fq, h.base_offset, have)
                    fq.truncated = False
                    break
                while todo and todo[0][1] <= h.base_offset:
                    epoch, start = todo.pop(0)
                    if start < have and lg.epochs.latest() is None and lg.start_offset == have:
                        start = have  # an empty log started at the leader's start
                    elif start < have:  # an epoch starting inside what we have: diverged
                        log.warning("%s: leader epoch %d starts at %d, below the log end %d: "
                                    "truncating again", fq, epoch, start, have)
                        fq.truncated = False
                        return copied
                    lg.epochs.assign(epoch, start)
                batch = data[pos:pos + h.size]
                lg.append_replica(batch)
                copied = True
                if h.attributes & ATTR_SCHEDULED and self.host.on_scheduled is not None:
                    self.host.on_scheduled(fq.qs, batch, h.base_offset, h.append_time_ms)
        except (StorageError, OSError, BrokerError) as exc:
            log.error("%s: copying from the leader failed: %s", fq, exc)
            fq.truncated = False
            fq.rest_until = self.host.monotonic() + RETRY_AFTER_ERROR_S
        return copied

    def _follow_start(self, fq: FollowerQueue, leader_start: int) -> None:
        """The leader's log starts later than this copy (its retention, a compacted internal
        log): delete the segments below it here too, as Kafka's followers do."""
        try:
            fq.qs.log.delete_before(leader_start, now_ms=self.host.wall_ms())
        except (StorageError, OSError) as exc:
            log.error("%s: cannot delete the segments below the leader's start %d: %s", fq,
                      leader_start, exc)

    def _on_error(self, fq: FollowerQueue, code: int, msg: str, leader_end: int = -1,
                  leader_start: int = -1) -> None:
        now = self.host.monotonic()
        if code in _METADATA_CODES:
            log.debug("%s: %s (waiting for the metadata)", fq, msg)
            fq.rest_until = now + RETRY_AFTER_METADATA_S
            return
        lg = fq.qs.log
        if code == ErrorCode.OFFSET_OUT_OF_RANGE and lg.end_offset > leader_end >= 0:
            fq.truncated = False
            return
        if code == ErrorCode.OFFSET_OUT_OF_RANGE and 0 <= lg.end_offset < leader_start:
            log.warning("%s: the log ends at %d, before the leader's start %d (retention "
                        "there): starting again at %d", fq, lg.end_offset, leader_start,
                        leader_start)
            try:
                lg.truncate_fully_and_start_at(leader_start)
            except OSError as exc:
                log.error("%s: cannot empty the log: %s", fq, exc)
                fq.rest_until = now + RETRY_AFTER_ERROR_S
                return
            if self.host.on_truncated is not None:
                self.host.on_truncated(fq.qs, leader_start)
            fq.qs.visible_end = leader_start
            return
        log.error("%s: %s", fq, msg)
        fq.rest_until = now + RETRY_AFTER_ERROR_S


def _retrieved(fut: asyncio.Future[bytes | memoryview]) -> None:
    """Mark the outcome of a request that may be left behind as seen (no "never retrieved"
    warning when the connection closes under it)."""
    if not fut.cancelled():
        fut.exception()
