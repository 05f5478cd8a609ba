"""Kafka's classic consumer-group protocol (JoinGroup, SyncGroup, Heartbeat, LeaveGroup) for
Kafka clients on the Kafka port: membership and generations here, assignment by the clients.

Theory of operation
-------------------
Kafka's classic protocol leaves the assignment to the clients: every member sends JoinGroup
with the assignors it supports and its subscription (opaque bytes); the coordinator waits until
every known member has (re)joined, or the longest rebalance timeout has passed (members that did
not rejoin are removed), bumps the generation, picks the first protocol of the leader's list that
every member supports, and answers every join, the leader's with every member's metadata. The
leader computes the assignment and sends it in its SyncGroup; the coordinator answers every
member's SyncGroup with its part. A member that joins or leaves, or whose session expires
(no heartbeat for its ``session_timeout``), starts a new rebalance: the others learn it from
their next heartbeat (REBALANCE_IN_PROGRESS) and rejoin.

States: ``EMPTY`` (no members), ``JOINING`` (a rebalance is collecting joins), ``SYNCING``
(joins answered, waiting for the leader's assignment), ``STABLE``. A first member of an empty
group is answered after ``INITIAL_REBALANCE_DELAY_S`` so consumers started together land in one
generation (Kafka's ``group.initial.rebalance.delay.ms``).

This membership is the Kafka port's own: a FerryMQ consumer group of the same name has its own
members (broker-assigned), but the two share committed offsets (OffsetCommit checks the Kafka
generation here, then stores through FerryMQ's offsets). Groups live in memory: after a broker
restart, Kafka members rejoin (UNKNOWN_MEMBER_ID makes them), their offsets are durable.

Static membership (KIP-345, ``group.instance.id``): a member that names an instance id keeps
it across restarts. When it joins again without a member id (a restarted process), it takes
the place of the member that had that instance id: a new member id, the old one fenced
(FENCED_INSTANCE_ID for anything it still sends, so two processes with one instance id do not
take turns), and in a stable group no rebalance at all: it gets the current generation back
and its old assignment at SyncGroup (unless its protocols no longer include the group's,
which rebalances; while the group syncs, it rebalances too, as the leader may be assigning to
the old id). A static member does not send LeaveGroup when it closes (the client's choice);
it stays in the group until its session times out, and no rebalance happens in between.
LeaveGroup v3+ removes members by instance id.

On a cluster a group's membership lives only on its coordinator (the leader of its queue of
``%GROUPS%offsets``, :mod:`ferrymq.kafka.cluster`): the handlers answer group requests
elsewhere with NOT_COORDINATOR and :meth:`KafkaGroupCoordinator.drop` the group a broker no
longer coordinates; members rejoin at the new coordinator (a new generation there), their
committed offsets being the replicated ones.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from kio.schema.errors import ErrorCode as KafkaError

from ferrymq.protocol.kafka.consumer_protocol import assigned_partitions

log = logging.getLogger("ferrymq.kafka")

INITIAL_REBALANCE_DELAY_S = 0.3
"""How long the first join of an empty group waits for other members (Kafka: 3 s)."""
MAX_REBALANCE_TIMEOUT_S = 60.0
"""The longest a rebalance waits for members to rejoin, whatever they ask for."""


class State(enum.Enum):
    """Where a group is in its rebalance cycle."""

    EMPTY = "Empty"
    JOINING = "PreparingRebalance"
    SYNCING = "CompletingRebalance"
    STABLE = "Stable"


NATIVE_STATES = {State.EMPTY: "KAFKA_EMPTY", State.JOINING: "KAFKA_REBALANCING",
                 State.SYNCING: "KAFKA_REBALANCING", State.STABLE: "KAFKA_STABLE"}
"""How FerryMQ's LIST_GROUPS and DESCRIBE_GROUP name a Kafka group's state."""

NativeMember = tuple[str, str, str, list[tuple[str, int]]]
"""A Kafka member as FerryMQ's DESCRIBE_GROUP shows one: member id, client id, host and the
partitions its assignment names (a ``consumer`` group's; none for other protocol types)."""


@dataclass(frozen=True, slots=True)
class JoinResult:
    """The answer to a JoinGroup."""

    error: KafkaError
    generation: int = -1
    protocol: str = ""
    leader: str = ""
    member_id: str = ""
    members: tuple[tuple[str, bytes], ...] = ()
    instance_ids: dict[str, str] = field(default_factory=dict)
    """The static members' instance ids by member id (the leader's answer names them)."""


@dataclass(eq=False, slots=True)
class Member:
    """One member of a Kafka group."""

    member_id: str
    client_id: str
    client_host: str
    session_timeout_s: float
    rebalance_timeout_s: float
    protocols: list[tuple[str, bytes]]
    last_seen: float
    join: asyncio.Future[JoinResult] | None = None
    sync: asyncio.Future[tuple[KafkaError, bytes]] | None = None
    assignment: bytes = b""
    instance_id: str | None = None
    """``group.instance.id`` of a static member (None: dynamic)."""


@dataclass(eq=False, slots=True)
class KafkaGroup:
    """One Kafka consumer group."""

    name: str
    state: State = State.EMPTY
    generation: int = 0
    protocol_type: str = ""
    protocol: str = ""
    leader: str = ""
    members: dict[str, Member] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None
    static: dict[str, str] = field(default_factory=dict)
    """The member id of each static member's instance id."""


class KafkaGroupCoordinator:
    """Every Kafka group of this broker; ``clock`` is monotonic seconds."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.groups: dict[str, KafkaGroup] = {}
        self._ids = itertools.count(1)

    # -- JoinGroup ----------------------------------------------------------------------------

    def join(self, name: str, member_id: str, client_id: str, protocol_type: str,
             protocols: list[tuple[str, bytes]], session_timeout_s: float,
             rebalance_timeout_s: float, client_host: str = "",
             instance_id: str | None = None) -> asyncio.Future[JoinResult]:
        """Join (or rejoin) ``name``; the answer once the rebalance completes (at once for a
        static member taking its place back in a stable group)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[JoinResult] = loop.create_future()
        g = self.groups.setdefault(name, KafkaGroup(name))
        if not protocols:
            fut.set_result(JoinResult(KafkaError.inconsistent_group_protocol))
            return fut
        if g.members and protocol_type != g.protocol_type:
            fut.set_result(JoinResult(KafkaError.inconsistent_group_protocol))
            return fut
        known = g.static.get(instance_id) if instance_id else None
        if known is not None and member_id and member_id != known:
            fut.set_result(JoinResult(KafkaError.fenced_instance_id, member_id=member_id))
            return fut
        if known is not None and not member_id:
            return self._replace_static(g, known, fut, client_id, client_host, protocols,
                                        session_timeout_s, rebalance_timeout_s)
        if member_id and member_id not in g.members:
            fut.set_result(JoinResult(KafkaError.unknown_member_id, member_id=member_id))
            return fut
        if not member_id:
            member_id = self._new_member_id(client_id)
        m = g.members.get(member_id)
        if m is None:
            m = g.members[member_id] = Member(member_id, client_id, client_host,
                                              session_timeout_s, rebalance_timeout_s,
                                              protocols, self.clock(), instance_id=instance_id)
            if instance_id:
                g.static[instance_id] = member_id
            log.info("Kafka group %s: member %s joined%s", name, member_id,
                     f" (static, instance {instance_id!r})" if instance_id else "",
                     extra={"group": name, "member": member_id})
        else:
            m.protocols, m.last_seen = protocols, self.clock()
            m.session_timeout_s, m.rebalance_timeout_s = session_timeout_s, rebalance_timeout_s
            if m.join is not None and not m.join.done():  # a retried join replaces the first
                m.join.set_result(JoinResult(KafkaError.rebalance_in_progress))
        g.protocol_type = protocol_type
        m.join = fut
        if g.state != State.JOINING:
            self._start_rebalance(g, initial=g.state == State.EMPTY)
        elif all(x.join is not None for x in g.members.values()):
            self._complete_join(g)
        return fut

    def _new_member_id(self, client_id: str) -> str:
        return f"{client_id or 'member'}-{next(self._ids)}-{uuid.uuid4().hex[:12]}"

    def _replace_static(self, g: KafkaGroup, old_id: str, fut: asyncio.Future[JoinResult],
                        client_id: str, client_host: str, protocols: list[tuple[str, bytes]],
                        session_timeout_s: float,
                        rebalance_timeout_s: float) -> asyncio.Future[JoinResult]:
        """A static member joined again without its member id (restarted): it takes the old
        member's place under a new id, the old id fenced; a stable group does not rebalance."""
        m = g.members.pop(old_id)
        if m.join is not None and not m.join.done():  # the old process's pending requests
            m.join.set_result(JoinResult(KafkaError.fenced_instance_id))
        if m.sync is not None and not m.sync.done():
            m.sync.set_result((KafkaError.fenced_instance_id, b""))
        m.join = m.sync = None
        new_id = self._new_member_id(client_id)
        m.member_id, m.client_id, m.client_host = new_id, client_id, client_host
        m.protocols = protocols
        m.session_timeout_s, m.rebalance_timeout_s = session_timeout_s, rebalance_timeout_s
        m.last_seen = self.clock()
        g.members[new_id] = m
        assert m.instance_id is not None
        g.static[m.instance_id] = new_id
        if g.leader == old_id:
            g.leader = new_id
        log.info("Kafka group %s: static member %r rejoined as %s (%s fenced)", g.name,
                 m.instance_id, new_id, old_id, extra={"group": g.name, "member": new_id})
        if g.state == State.STABLE and g.protocol in {n for n, _ in protocols}:
            fut.set_result(JoinResult(
                KafkaError.none, g.generation, g.protocol, g.leader, new_id,
                self._metadata(g) if new_id == g.leader else (),
                self._instances(g) if new_id == g.leader else {}))
            return fut
        m.join = fut
        if g.state != State.JOINING:
            self._start_rebalance(g)
        elif all(x.join is not None for x in g.members.values()):
            self._complete_join(g)
        return fut

    @staticmethod
    def _metadata(g: KafkaGroup) -> tuple[tuple[str, bytes], ...]:
        return tuple((m.member_id, dict(m.protocols).get(g.protocol, b""))
                     for m in g.members.values())

    @staticmethod
    def _instances(g: KafkaGroup) -> dict[str, str]:
        return {mid: iid for iid, mid in g.static.items()}

    def _start_rebalance(self, g: KafkaGroup, *, initial: bool = False) -> None:
        """Collect joins: wait for every member (or the longest rebalance timeout)."""
        g.state = State.JOINING
        for m in g.members.values():
            if m.sync is not None and not m.sync.done():
                m.sync.set_result((KafkaError.rebalance_in_progress, b""))
            m.sync = None
        if g.timer is not None:
            g.timer.cancel()
        wait = (INITIAL_REBALANCE_DELAY_S if initial else
                min(max((m.rebalance_timeout_s for m in g.members.values()), default=0.0),
                    MAX_REBALANCE_TIMEOUT_S))
        g.timer = asyncio.get_running_loop().call_later(wait, self._complete_join, g)

    def _complete_join(self, g: KafkaGroup) -> None:
        """End the join phase: drop members that did not rejoin, bump the generation, answer
        every join."""
        if g.state != State.JOINING:
            return
        if g.timer is not None:
            g.timer.cancel()
            g.timer = None
        for mid in [mid for mid, m in g.members.items() if m.join is None]:
            log.info("Kafka group %s: member %s did not rejoin: removed", g.name, mid,
                     extra={"group": g.name, "member": mid})
            self._forget_instance(g, g.members.pop(mid))
        if not g.members:
            g.state = State.EMPTY
            return
        g.generation += 1
        if g.leader not in g.members:
            g.leader = next(iter(g.members))
        common = set.intersection(*({n for n, _ in m.protocols} for m in g.members.values()))
        g.protocol = next((n for n, _ in g.members[g.leader].protocols if n in common), "")
        if not g.protocol:
            for m in g.members.values():
                if m.join is not None and not m.join.done():
                    m.join.set_result(JoinResult(KafkaError.inconsistent_group_protocol))
            g.members.clear()
            g.static.clear()
            g.state = State.EMPTY
            return
        g.state = State.SYNCING
        metadata = self._metadata(g)
        instances = self._instances(g)
        log.info("Kafka group %s: generation %d, %d members, leader %s, protocol %s", g.name,
                 g.generation, len(g.members), g.leader, g.protocol, extra={"group": g.name})
        for m in g.members.values():
            fut, m.join = m.join, None
            m.last_seen = self.clock()
            if fut is not None and not fut.done():
                leader = m.member_id == g.leader
                fut.set_result(JoinResult(KafkaError.none, g.generation, g.protocol, g.leader,
                                          m.member_id, metadata if leader else (),
                                          instances if leader else {}))

    # -- SyncGroup, Heartbeat, LeaveGroup -------------------------------------------------------

    def sync(self, name: str, member_id: str, generation: int,
             assignments: dict[str, bytes],
             instance_id: str | None = None) -> asyncio.Future[tuple[KafkaError, bytes]]:
        """The member's assignment, once the leader sent it."""
        fut: asyncio.Future[tuple[KafkaError, bytes]] = \
            asyncio.get_running_loop().create_future()
        g, error = self._check(name, member_id, generation, instance_id)
        if error is not None or g is None:
            fut.set_result((error or KafkaError.unknown_member_id, b""))
            return fut
        m = g.members[member_id]
        m.last_seen = self.clock()
        if g.state == State.JOINING:
            fut.set_result((KafkaError.rebalance_in_progress, b""))
            return fut
        if g.state == State.STABLE:
            fut.set_result((KafkaError.none, m.assignment))
            return fut
        m.sync = fut
        if member_id == g.leader:
            for x in g.members.values():
                x.assignment = assignments.get(x.member_id, b"")
            g.state = State.STABLE
            for x in g.members.values():
                if x.sync is not None and not x.sync.done():
                    x.sync.set_result((KafkaError.none, x.assignment))
                x.sync = None
        return fut

    def heartbeat(self, name: str, member_id: str, generation: int,
                  instance_id: str | None = None) -> KafkaError:
        """NONE, or why the member must rejoin (REBALANCE_IN_PROGRESS, UNKNOWN_MEMBER_ID,
        ILLEGAL_GENERATION) or stop (FENCED_INSTANCE_ID: its instance id has a newer member)."""
        g, error = self._check(name, member_id, generation, instance_id)
        if error is not None or g is None:
            return error or KafkaError.unknown_member_id
        g.members[member_id].last_seen = self.clock()
        return KafkaError.rebalance_in_progress if g.state == State.JOINING else KafkaError.none

    def check_commit(self, name: str, member_id: str, generation: int,
                     instance_id: str | None = None) -> KafkaError:
        """Whether a commit at ``generation`` may be stored (-1: outside any generation)."""
        if generation < 0:
            return KafkaError.none
        g, error = self._check(name, member_id, generation, instance_id)
        if error is not None or g is None:
            return error or KafkaError.unknown_member_id
        return KafkaError.rebalance_in_progress if g.state == State.JOINING else KafkaError.none

    def leave(self, name: str, members: list[tuple[str, str | None]]) -> list[KafkaError]:
        """Remove members, each named by member id or instance id (``(member_id,
        instance_id)``; both: they must agree, else FENCED_INSTANCE_ID); the others rebalance.
        One error per member."""
        g = self.groups.get(name)
        out: list[KafkaError] = []
        for mid, iid in members:
            if g is not None and iid:
                known = g.static.get(iid)
                if known is None:
                    out.append(KafkaError.unknown_member_id)
                    continue
                if mid and mid != known:
                    out.append(KafkaError.fenced_instance_id)
                    continue
                mid = known
            if g is None or mid not in g.members:
                out.append(KafkaError.unknown_member_id)
                continue
            self._remove(g, mid, "left")
            out.append(KafkaError.none)
        return out

    def expire(self) -> None:
        """Remove members whose session timed out (housekeeping)."""
        now = self.clock()
        for g in list(self.groups.values()):
            for m in list(g.members.values()):
                if m.join is None and now - m.last_seen > m.session_timeout_s:
                    self._remove(g, m.member_id, "session timed out")
            if g.state == State.EMPTY and not g.members:
                del self.groups[g.name]

    def _remove(self, g: KafkaGroup, member_id: str, why: str) -> None:
        m = g.members.pop(member_id)
        self._forget_instance(g, m)
        log.info("Kafka group %s: member %s %s", g.name, member_id, why,
                 extra={"group": g.name, "member": member_id})
        if m.join is not None and not m.join.done():
            m.join.set_result(JoinResult(KafkaError.unknown_member_id))
        if m.sync is not None and not m.sync.done():
            m.sync.set_result((KafkaError.unknown_member_id, b""))
        if not g.members:
            if g.timer is not None:
                g.timer.cancel()
                g.timer = None
            g.state = State.EMPTY
        elif g.state == State.JOINING:
            if all(x.join is not None for x in g.members.values()):
                self._complete_join(g)
        else:
            self._start_rebalance(g)

    @staticmethod
    def _forget_instance(g: KafkaGroup, m: Member) -> None:
        """``m`` left the group: its instance id (if static) no longer names a member."""
        if m.instance_id is not None and g.static.get(m.instance_id) == m.member_id:
            del g.static[m.instance_id]

    def _check(self, name: str, member_id: str, generation: int,
               instance_id: str | None = None) -> tuple[KafkaGroup | None, KafkaError | None]:
        g = self.groups.get(name)
        if g is not None and instance_id:
            known = g.static.get(instance_id)
            if known is not None and known != member_id:  # a newer process took its place
                return g, KafkaError.fenced_instance_id
        if g is None or member_id not in g.members:
            return None, KafkaError.unknown_member_id
        if generation != g.generation:
            return g, KafkaError.illegal_generation
        return g, None

    def native_listing(self) -> list[tuple[str, str, int]]:
        """``(group, state, members)`` of every Kafka group, for FerryMQ's LIST_GROUPS."""
        return [(g.name, NATIVE_STATES[g.state], len(g.members)) for g in self.groups.values()]

    def native_view(self, name: str) -> tuple[str, int, list[NativeMember]] | None:
        """State, generation and members of Kafka group ``name`` for FerryMQ's DESCRIBE_GROUP;
        None when this broker has no such Kafka group."""
        g = self.groups.get(name)
        if g is None:
            return None
        members: list[NativeMember] = [
            (m.member_id, m.client_id, m.client_host,
             assigned_partitions(m.assignment) if g.protocol_type == "consumer" else [])
            for m in g.members.values()]
        return NATIVE_STATES[g.state], g.generation, members

    def drop(self, name: str, error: KafkaError) -> None:
        """Forget group ``name`` (this broker no longer coordinates it): its pending joins and
        syncs are answered ``error`` (NOT_COORDINATOR: the members find the coordinator again
        and rejoin there)."""
        g = self.groups.pop(name, None)
        if g is None:
            return
        log.info("Kafka group %s: no longer coordinated here (%s): %d members forgotten",
                 name, error.name, len(g.members), extra={"group": name})
        if g.timer is not None:
            g.timer.cancel()
        for m in g.members.values():
            if m.join is not None and not m.join.done():
                m.join.set_result(JoinResult(error))
            if m.sync is not None and not m.sync.done():
                m.sync.set_result((error, b""))

    def close(self) -> None:
        """Stop timers (broker stopping)."""
        for g in self.groups.values():
            if g.timer is not None:
                g.timer.cancel()
