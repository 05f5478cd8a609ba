"""One delivery group: its policy, members, cursors and leases, and the transitions between its
states, one method each.

Pure data and transitions: no I/O, no clock (times are passed in as monotonic milliseconds).
The manager's collaborators journal a change, then make it here; the journal's replay
(:mod:`.replay`) rebuilds the same state after a restart.

A message of a group's queue is *waiting* (not reached yet, or held behind its key's head in an
orderly group), *leased* to one member, *failed in place* (an orderly head backing off), or
*finished*: acked, moved to the retry or dead-letter queue, or filtered out. The transitions::

    waiting   --grant / grant_letter (RECEIVE)-->                  leased
    leased    --settle (ACK)-->                                    finished
    leased    --renew (CHANGE_INVISIBLE)-->                        leased (a new lease id)
    leased    --a failure: NACK, expired (see ``expired``), a member gone (``hand_back``)-->
              the outcome of FAILURE_OUTCOMES:
                IN_PLACE  --fail_in_place-->                       failed in place
                RETRY     --finish, once its letter is written-->  finished (its letter waits
                                                                   in the retry queue)
                DEAD      --finish, once its letter is written-->  finished (a dead letter)
    failed in place --backoff over (OrderlyCursor.take_ready)-->   waiting

A lease is current while its deadline has not passed and it holds offsets; a receipt (lease id)
of an earlier lease of a message is refused (:meth:`DeliveryGroup.lease_of`).
"""

from __future__ import annotations

import asyncio
import enum
import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from ferrymq.broker.delivery.orderly import Failure, OrderlyCursor
from ferrymq.broker.delivery.state import Lease, RetryCursor, SourceCursor
from ferrymq.protocol.letters import Letter

DEFAULT_RETRY_DELAYS_MS = [
    s * 1000 for s in (10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800,
                       3600, 7200)
]
"""RocketMQ's retry ladder: 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h."""
DEFAULT_MAX_RECONSUME = 16
MAX_RETRY_DELAY_MS = 24 * 3600 * 1000
MAX_RECONSUME_LIMIT = 1000
MAX_RETRY_LADDER = 64

Cursor = SourceCursor | OrderlyCursor | RetryCursor


class FailureOutcome(enum.Enum):
    """Where a failed delivery goes (see FAILURE_OUTCOMES)."""

    IN_PLACE = "in place"  # an orderly head: stays its key's head, delivered again after a backoff
    RETRY = "retry"  # a letter in %RETRY%<group>, due after the ladder's (or the nack's) delay
    DEAD = "dead"  # a letter in %DLQ%<group>


FAILURE_OUTCOMES: dict[tuple[bool, bool, bool], FailureOutcome] = {
    # (in an orderly queue, dead-lettered on purpose, attempts over max_reconsume): outcome
    (False, False, False): FailureOutcome.RETRY,
    (False, False, True): FailureOutcome.DEAD,
    (False, True, False): FailureOutcome.DEAD,
    (False, True, True): FailureOutcome.DEAD,
    (True, False, False): FailureOutcome.IN_PLACE,
    (True, False, True): FailureOutcome.DEAD,
    (True, True, False): FailureOutcome.DEAD,
    (True, True, True): FailureOutcome.DEAD,
}
"""The failure transition: every combination is listed (a retry letter, even of an orderly
group, is not in an orderly queue: it is retried through the retry queue)."""


def split_receipts(cursor: Cursor, offsets: Iterable[int],
                   lease_id: int) -> tuple[list[int], list[int], Lease | None]:
    """ACK's receipt check: of ``offsets``, those whose current lease is ``lease_id`` (in
    order), the others (refused: never leased, finished, or leased again since), and that
    lease (None when none is current)."""
    leased = cursor.leased
    done: list[int] = []
    refused: list[int] = []
    held: Lease | None = None
    for o in offsets:
        lease = leased.get(o)
        if lease is None or lease.lease_id != lease_id:
            refused.append(o)
            continue
        done.append(o)
        held = lease
    return done, refused, held


class MemberLink(Protocol):
    """The connection a member last heartbeated on (the broker's connection object)."""

    @property
    def closed(self) -> bool:
        """True once the connection is gone."""


@dataclass(eq=False)
class DeliveryMember:
    """A live member of a delivery group (a push or simple consumer).

    ``exclusive``: the member must be its group's only live member (a broadcasting consumer).
    ``link``: the connection of its last heartbeat (None: not known), used to tell whether an
    exclusive member is still there when another one asks to join (see
    :meth:`is_live`)."""

    member_id: str
    client_id: str
    host: str
    last_heartbeat: int
    session_timeout_ms: int
    subscriptions: list[tuple[str, str]]
    exclusive: bool = False
    link: MemberLink | None = None

    def is_live(self, now: int) -> bool:
        """Heartbeated within its session timeout, on a connection that is still open (a
        member whose process died closed its connection: the kernel closes it even after
        kill -9, so a restarted consumer need not wait for the session to expire)."""
        if now - self.last_heartbeat > self.session_timeout_ms:
            return False
        return self.link is None or not self.link.closed


@dataclass(slots=True)
class TagFilter:
    """The tag expression a group's receives last used on one topic, and from where it is sure
    to have applied: per queue, the group's ``next`` when it came into use (a queue without an
    entry was first read under it). ``message status`` says a message whose tag it does not
    match, at or past that position, was filtered out (never delivered)."""

    expression: str
    tags: frozenset[str] | None  # parsed; None: every message
    since: dict[int, int]  # queue -> first offset judged by this expression


class AckRun(NamedTuple):
    """Offsets ``first .. first+length-1`` of ``topic``/``queue`` were acknowledged at
    ``wall_ms`` (for retry letters: the original message's position)."""

    topic: str
    queue: int
    first: int
    length: int
    wall_ms: int


@dataclass(eq=False)
class DeliveryGroup:
    """Everything the broker keeps for one delivery group (see the module docstring)."""

    name: str
    retry_delays_ms: list[int]
    max_reconsume: int
    start_from: int = -2  # OffsetSpec.EARLIEST: where new cursors start
    retry: RetryCursor = field(default_factory=lambda: RetryCursor(0))
    dlq_floor: int = 0
    dlq_done: set[int] = field(default_factory=set)  # letters above the floor redriven/purged
    members: dict[str, DeliveryMember] = field(default_factory=dict)
    orderly: bool = False  # fixed when the group is created
    ephemeral: bool = False  # removed by the broker once it has no members (see lifecycle.py)
    sources: dict[tuple[str, int], SourceCursor | OrderlyCursor] = field(default_factory=dict)
    leases: dict[int, Lease] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)  # member -> leased messages
    expiry: list[tuple[int, int]] = field(default_factory=list)  # (deadline, lease id)
    waiters: set[asyncio.Future[None]] = field(default_factory=set)
    rr: int = 0
    pending_moves: int = 0
    moving: dict[str, tuple[str, Letter]] = field(default_factory=dict)  # msg id -> (state, letter)
    acked: deque[AckRun] = field(default_factory=deque)  # newest last; bounded by the manager
    tag_filters: dict[str, TagFilter] = field(default_factory=dict)  # topic -> last expression
    # topics a member subscribed to before they existed: their cursors start at the topic's
    # beginning whatever ``start_from`` says (everything in them is newer than the subscription)
    awaited: set[str] = field(default_factory=set)
    # leases of members that left or were evicted, handed back to the group by the tick (at
    # once, unless no descriptor or space lets it move them): (lease, counts as an attempt,
    # reason)
    returning: deque[tuple[Lease, bool, str]] = field(default_factory=deque)

    # -- names, policy, queries ------------------------------------------------------------------

    @property
    def retry_topic(self) -> str:
        """Name of this group's retry queue topic."""
        return f"%RETRY%{self.name}"

    @property
    def dlq_topic(self) -> str:
        """Name of this group's dead-letter topic."""
        return f"%DLQ%{self.name}"

    def set_policy(self, retry_delays_ms: list[int], max_reconsume: int, start_from: int,
                   orderly: bool | None = None, ephemeral: bool | None = None) -> None:
        """The group's retry ladder, attempt limit and start; its kind and lifetime when
        given (None: unchanged)."""
        self.retry_delays_ms = list(retry_delays_ms)
        self.max_reconsume = max_reconsume
        self.start_from = start_from
        if orderly is not None:
            self.orderly = orderly
        if ephemeral is not None:
            self.ephemeral = ephemeral

    def retry_delay_ms(self, reconsume: int) -> int:
        """The ladder's delay before attempt ``reconsume`` + 1 (past its end: its last)."""
        ladder = self.retry_delays_ms
        return ladder[min(max(reconsume - 1, 0), len(ladder) - 1)]

    def failure_outcome(self, key: tuple[str, int], reconsume: int, *,
                        dead: bool) -> FailureOutcome:
        """Where a failed delivery of queue ``key`` goes at attempt count ``reconsume`` (``dead``:
        dead-lettered on purpose). See FAILURE_OUTCOMES."""
        orderly = isinstance(self.sources.get(key), OrderlyCursor)
        return FAILURE_OUTCOMES[(orderly, dead, reconsume > self.max_reconsume)]

    def cursor(self, key: tuple[str, int]) -> Cursor | None:
        """The cursor of the group's queue ``key`` (its retry queue's too), or None."""
        return self.retry if key[0] == self.retry_topic else self.sources.get(key)

    def cursor_of(self, key: tuple[str, int]) -> Cursor:
        """The cursor of the group's queue ``key``, which it reads (else KeyError)."""
        return self.retry if key[0] == self.retry_topic else self.sources[key]

    def lease_of(self, key: tuple[str, int], offset: int, lease_id: int) -> Lease | None:
        """The lease of the message at ``offset`` of queue ``key`` if ``lease_id`` is its
        current one (a receipt still good), else None."""
        cur = self.cursor(key)
        lease = cur.leased.get(offset) if cur is not None else None
        if lease is None or lease.lease_id != lease_id:
            return None
        return lease

    def new_cursor(self, topic: str, queue: int, start: int) -> SourceCursor | OrderlyCursor:
        """A cursor for a queue this group starts reading (orderly or not, as the group)."""
        if self.orderly:
            return OrderlyCursor(topic, queue, start)
        return SourceCursor(topic, queue, start)

    def record_acks(self, topic: str, queue: int, runs: list[list[int]], wall_ms: int,
                    limit: int) -> None:
        """Remember when these offsets of ``topic``/``queue`` were acknowledged (``message
        status`` shows it); the oldest runs are forgotten past ``limit``."""
        acked = self.acked
        for first, count in runs:
            acked.append(AckRun(topic, queue, first, count, wall_ms))
        while len(acked) > limit:
            acked.popleft()

    def acked_at(self, topic: str, queue: int, offset: int) -> int:
        """Wall ms when ``offset`` was acknowledged, or -1 if no longer remembered."""
        for run in reversed(self.acked):
            if run.queue == queue and run.first <= offset < run.first + run.length \
                    and run.topic == topic:
                return run.wall_ms
        return -1

    # -- leases -----------------------------------------------------------------------------------

    def add_lease(self, lease: Lease, count: int) -> None:
        """Index a new lease of ``count`` messages."""
        self.leases[lease.lease_id] = lease
        self.in_flight[lease.member] = self.in_flight.get(lease.member, 0) + count
        heapq.heappush(self.expiry, (lease.deadline, lease.lease_id))

    def drop_from_lease(self, lease: Lease, count: int = 1) -> None:
        """``count`` messages left ``lease`` (already removed from its offsets)."""
        n = self.in_flight.get(lease.member, 0) - count
        if n > 0:
            self.in_flight[lease.member] = n
        else:
            self.in_flight.pop(lease.member, None)
        if not lease.offsets:
            self.leases.pop(lease.lease_id, None)

    # -- transitions (see the module docstring) ---------------------------------------------------

    def grant(self, cursor: SourceCursor | OrderlyCursor, offsets: list[int], lease: Lease) -> None:
        """RECEIVE: hand ``offsets`` of a source queue (waiting, rising) to the new ``lease``."""
        cursor.lease(offsets, lease)
        self.add_lease(lease, len(offsets))

    def grant_letter(self, offset: int, lease: Lease) -> Letter:
        """RECEIVE: hand the ready retry letter at ``offset`` to the new ``lease``."""
        letter = self.retry.lease(offset, lease)
        self.add_lease(lease, 1)
        return letter

    def settle(self, cursor: Cursor, offsets: list[int], lease: Lease) -> None:
        """ACK: ``offsets`` of ``cursor``, leased now by ``lease``, are finished (in an orderly
        queue their keys' next messages become deliverable)."""
        for o in offsets:
            cursor.finish(o)
        self.drop_from_lease(lease, len(offsets))
        if isinstance(cursor, OrderlyCursor) and cursor.ready:
            self.wake()  # next messages of these keys can go
        cursor.advance_floor()

    def renew(self, key: tuple[str, int], moved: Iterable[tuple[Lease, int]],
              lease: Lease) -> None:
        """CHANGE_INVISIBLE: the messages ``moved`` ((old lease, offset) of queue ``key``)
        leave their leases for the new ``lease``; the old receipts are no longer good."""
        self.add_lease(lease, 0)
        cursor = self.cursor_of(key)
        member = lease.member
        for old, offset in moved:
            old.offsets.discard(offset)
            self.drop_from_lease(old)
            lease.offsets.add(offset)
            self.in_flight[member] = self.in_flight.get(member, 0) + 1
            cursor.leased[offset] = lease

    def expired(self, now: int) -> Iterator[Lease]:
        """The leases whose deadline passed by ``now``, soonest first. Each one's entry leaves
        the expiry heap only once the caller is done with it (asked for the next one): when the
        caller stops half-way (an exception), the lease is expired again the next time."""
        exp = self.expiry
        while exp and exp[0][0] <= now:
            deadline, lease_id = exp[0]
            lease = self.leases.get(lease_id)
            if lease is not None and lease.deadline == deadline:
                yield lease
            heapq.heappop(exp)

    def hand_back(self, member_id: str, *, counts: bool, reason: str) -> None:
        """A member left (``counts``: evicted): its leases are to be handed back to the group
        (``returning``, moved on oldest first, each by the failure transition)."""
        self.returning.extend((ls, counts, reason) for ls in self.leases.values()
                              if ls.member == member_id)

    def fail_in_place(self, cur: OrderlyCursor, offset: int, failure: Failure, now: int) -> None:
        """An orderly head failed (FailureOutcome.IN_PLACE): it stays its key's head and is
        delivered again at ``failure.until`` (at once: receivers are woken)."""
        lease = cur.fail(offset, failure, now)
        if lease is not None:
            self.drop_from_lease(lease)
        if failure.until <= now:
            self.wake()

    def finish(self, key: tuple[str, int], offset: int) -> None:
        """The message at ``offset`` of queue ``key`` is finished (its letter is written, or it
        is gone); in an orderly queue its key's next message becomes deliverable."""
        cursor = self.cursor_of(key)
        lease = cursor.finish(offset)
        if lease is not None:
            self.drop_from_lease(lease)
        if isinstance(cursor, OrderlyCursor) and cursor.ready:
            self.wake()  # the key's next message can go

    def advance_floor(self, key: tuple[str, int]) -> None:
        """Move the floor of queue ``key``'s cursor past finished offsets."""
        self.cursor_of(key).advance_floor()

    def wake(self) -> None:
        """Wake long-polling receivers (something became available)."""
        for w in self.waiters:
            if not w.done():
                w.set_result(None)
        self.waiters.clear()
