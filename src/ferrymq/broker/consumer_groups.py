"""Consumer groups: membership, queue assignment, committed offsets.

Theory of operation
-------------------
A member joins with the topics it subscribes to and gets a member id, the group's generation and
its share of the queues. The broker assigns (RocketMQ's "averagely" strategy: members sorted by
id, each topic's queues split into contiguous ranges), so clients need no leader election.

Every change of membership or subscription bumps the generation. Members learn of it from their
next heartbeat (``REBALANCE_IN_PROGRESS``) and rejoin to get their new share. A member may
subscribe to a topic that does not exist yet (a consumer started before its producers): it gets
no queues of it until the topic is created. The broker's housekeeping hands the current queue
counts to :meth:`ConsumerGroupCoordinator.sync_queue_counts` twice a second; when a topic subscribed to
is created, deleted or changes its queue count, the groups reading it rebalance (Kafka's
consumers notice new partitions by refreshing metadata; here the broker assigns, so the broker
notices). A commit that carries
an older generation is refused (``ILLEGAL_GENERATION``): a member that lost a queue cannot move its
offset back. Commits with generation -1 come from consumers that ``assign`` queues themselves and
from admin tools; they are not fenced. Members that stop heartbeating are removed after their
session timeout.

State table (a group is EMPTY with no members, STABLE otherwise; the generation is the only
other state)::

    event            EMPTY            STABLE
    join (new)       STABLE, gen+1    STABLE, gen+1
    join (known,     -                STABLE, gen+1 if its topics changed
      same topics)
    leave / expire   -                EMPTY if last, else STABLE; gen+1
    queue counts of  -                STABLE, gen+1 if a member subscribes to one
      topics change

A new group beyond ``max_consumer_groups`` (a join, a commit or an offset reset that names an
unknown group) is refused with POLICY_VIOLATION before it exists (:meth:`ConsumerGroupCoordinator.check_new`).

Committed offsets survive restarts: each group's offsets are one checkpoint file
(``groups/<group>``), rewritten atomically (write, fsync, rename) on every commit. Deleting a
group (``ferrymq group delete``, only while it has no member) removes that file: a member that
joins later under the same name starts afresh, from ``auto_offset_reset``.

In a cluster (``files=False``) this class holds only the groups this broker coordinates, in
memory: their offsets are made durable first by :mod:`ferrymq.broker.cluster_groups` (records in
the replicated ``%GROUPS%offsets``), which then calls the same methods; it loads them with
:meth:`ConsumerGroupCoordinator.adopt` and drops them with :meth:`ConsumerGroupCoordinator.drop`.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgpack

from ferrymq import _faults
from ferrymq.errors import (
    BrokerError,
    IllegalGenerationError,
    InvalidOffsetError,
    InvalidRequestError,
    NonEmptyGroupError,
    PolicyViolationError,
    RebalanceInProgressError,
    UnknownGroupError,
    UnknownMemberError,
)
from ferrymq.storage import read_checkpoint, write_checkpoint
from ferrymq.storage.files import fsync_directory

if TYPE_CHECKING:
    from ferrymq.broker.topics import TopicRegistry

log = logging.getLogger("ferrymq.broker")

GROUP_NAME = re.compile(r"^[A-Za-z0-9._%-]{1,249}$")


def check_group_name(name: str) -> None:
    """Raise InvalidRequestError unless ``name`` is a valid group name."""
    if name in (".", "..") or not GROUP_NAME.fullmatch(name):
        raise InvalidRequestError(f"invalid group name {name[:64]!r}")


def check_offsets(
    topics: TopicRegistry, entries: list[tuple[str, int, int]],
    also: Callable[[str, int], None] | None = None, *, local_end: bool = True,
) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    """Check offsets to commit one by one: the queue exists, the offset is in 0..end (not above
    the local log's end only when ``local_end``: a cluster's coordinator may hold no replica of
    the queue), and ``also(topic, queue)`` does not raise. Returns (the valid entries, (topic,
    queue, code) per entry in request order)."""
    valid: list[tuple[str, int, int]] = []
    out: list[tuple[str, int, int]] = []
    for topic, queue, offset in entries:
        try:
            qs = topics.queue(topic, queue)
            if offset < 0 or (local_end and offset > qs.log.end_offset):
                raise InvalidOffsetError(f"offset {offset} is outside 0..{qs.log.end_offset} "
                                         f"of {topic}/{queue}")
            if also is not None:
                also(topic, queue)
        except BrokerError as exc:
            out.append((topic, queue, exc.code))
            continue
        valid.append((topic, queue, offset))
        out.append((topic, queue, 0))
    return valid, out


@dataclass
class Member:
    """A live member of a group."""

    member_id: str
    client_id: str
    host: str
    topics: tuple[str, ...]
    session_timeout_ms: int
    last_seen_ms: int
    assignment: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class ConsumerGroup:
    """One consumer group."""

    name: str
    generation: int = 0
    members: dict[str, Member] = field(default_factory=dict)
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)

    @property
    def state(self) -> str:
        """EMPTY or STABLE."""
        return "STABLE" if self.members else "EMPTY"


def assign_averagely(
    members: list[Member], queue_counts: dict[str, int]
) -> dict[str, list[tuple[str, int]]]:
    """Split each topic's queues into contiguous ranges over its sorted subscribers."""
    out: dict[str, list[tuple[str, int]]] = {m.member_id: [] for m in members}
    for topic in sorted(queue_counts):
        subs = sorted(m.member_id for m in members if topic in m.topics)
        if not subs:
            continue
        n = queue_counts[topic]
        per, extra = divmod(n, len(subs))
        start = 0
        for i, mid in enumerate(subs):
            size = per + (1 if i < extra else 0)
            out[mid].extend((topic, q) for q in range(start, start + size))
            start += size
    return out


class ConsumerGroupCoordinator:
    """All groups of this broker."""

    def __init__(self, data_dir: Path, *, max_groups: int = 0, files: bool = True) -> None:
        self._dir = data_dir / "groups"
        self.files = files
        """Whether offsets are kept in checkpoint files (a single broker) or only in memory (a
        cluster: the replicated log keeps them)."""
        self.groups: dict[str, ConsumerGroup] = {}
        self._queue_counts: dict[str, int] = {}  # as of the last sync_queue_counts()
        self.max_groups = max_groups
        """Most groups (``max_consumer_groups``; 0: no limit): see :meth:`check_new`."""
        self.on_generation: Callable[[ConsumerGroup], None] | None = None
        """Called with a group whose generation moved (a cluster logs its membership)."""

    def load(self) -> None:
        """Read every group's committed offsets (a cluster's come from its log instead)."""
        if not self.files:
            return
        self._dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(self._dir.iterdir()):
            if path.name.endswith(".tmp") or not path.is_file():
                continue
            raw = read_checkpoint(path)
            if raw is None:
                continue
            data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            g = ConsumerGroup(data["name"])
            g.offsets = {(t, q): o for t, q, o in data["offsets"]}
            self.groups[g.name] = g

    def _save(self, g: ConsumerGroup, offsets: dict[tuple[str, int], int]) -> None:
        """Write ``offsets`` durably, then make them ``g``'s: when the write fails (OSError,
        e.g. a full disk) the group keeps the offsets it had, on disk and in memory."""
        if not self.files:
            g.offsets = offsets
            return
        if _faults.ENOSPC_FAULTS:
            _faults.enospc_point("write", f"%groups/{g.name}")
        data = {"name": g.name, "offsets": [[t, q, o] for (t, q), o in offsets.items()]}
        # group names are checked against GROUP_NAME, so they are safe file names
        write_checkpoint(self._dir / g.name, msgpack.packb(data, use_bin_type=True))
        g.offsets = offsets

    def group(self, name: str) -> ConsumerGroup:
        """A known group.

        Raises:
            UnknownGroupError.
        """
        g = self.groups.get(name)
        if g is None:
            raise UnknownGroupError(f"unknown group {name!r}")
        return g

    def check_new(self, name: str) -> None:
        """Refuse to create the group ``name`` (unless it exists) when the broker has
        ``max_groups`` groups.

        Raises:
            PolicyViolationError: naming ``max_consumer_groups``.
        """
        n = len(self.groups)
        if self.max_groups and n >= self.max_groups and name not in self.groups:
            raise PolicyViolationError(
                f"consumer group {name[:249]!r} not created: the broker has {n} consumer "
                f"groups, max_consumer_groups={self.max_groups} (delete unused ones: ferrymq "
                "group delete)")

    def _get_or_create(self, name: str, *, limited: bool = True) -> ConsumerGroup:
        """The group ``name``, created if new (within ``max_groups`` when ``limited``).

        Raises:
            InvalidRequestError: not a valid group name.
            PolicyViolationError: see :meth:`check_new`.
        """
        check_group_name(name)
        g = self.groups.get(name)
        if g is None:
            if limited:
                self.check_new(name)
            g = self.groups[name] = ConsumerGroup(name)
        return g

    # -- membership --------------------------------------------------------------------------

    def join(
        self, name: str, member_id: str, client_id: str, host: str, topics: list[str],
        session_timeout_ms: int, now_ms: int, queue_counts: dict[str, int],
    ) -> tuple[ConsumerGroup, Member]:
        """Add or refresh a member and rebalance if anything changed."""
        g = self._get_or_create(name)
        m = g.members.get(member_id) if member_id else None
        changed = False
        if m is None:
            member_id = f"{client_id[:64] or 'consumer'}-{uuid.uuid4().hex[:12]}"
            m = Member(member_id, client_id, host, tuple(sorted(set(topics))),
                       session_timeout_ms, now_ms)
            g.members[member_id] = m
            changed = True
            log.info("group %s: %s joined", name, member_id, extra={"group": name, "member": member_id})
        else:
            m.last_seen_ms = now_ms
            m.session_timeout_ms = session_timeout_ms
            new_topics = tuple(sorted(set(topics)))
            if new_topics != m.topics:
                m.topics = new_topics
                changed = True
        if changed or self._plan_changed(g, queue_counts):  # (queue counts may have changed)
            self._rebalance(g, queue_counts)
        return g, m

    @staticmethod
    def _plan_changed(g: ConsumerGroup, queue_counts: dict[str, int]) -> bool:
        fresh = assign_averagely(list(g.members.values()), queue_counts)
        return any(fresh[mid] != mm.assignment for mid, mm in g.members.items())

    def _rebalance(self, g: ConsumerGroup, queue_counts: dict[str, int]) -> None:
        g.generation += 1
        plan = assign_averagely(list(g.members.values()), queue_counts)
        for mid, m in g.members.items():
            m.assignment = plan[mid]
        if self.on_generation is not None:
            self.on_generation(g)

    def sync_queue_counts(self, queue_counts: dict[str, int]) -> list[str]:
        """Rebalance the groups whose assignment changes because a topic a member subscribes
        to was created, deleted or resized since the last call; return their names. Cheap when
        nothing changed (one dict comparison)."""
        if queue_counts == self._queue_counts:
            return []
        old, self._queue_counts = self._queue_counts, dict(queue_counts)
        changed = {t for t in old.keys() | queue_counts.keys() if old.get(t) != queue_counts.get(t)}
        out: list[str] = []
        for g in self.groups.values():
            read = changed.intersection(t for m in g.members.values() for t in m.topics)
            if read and self._plan_changed(g, queue_counts):  # members who joined since have it
                self._rebalance(g, queue_counts)
                log.info("group %s: generation %d: topics created, deleted or resized: %s",
                         g.name, g.generation, ", ".join(sorted(read)[:10]))
                out.append(g.name)
        return out

    def heartbeat(self, name: str, member_id: str, generation: int, now_ms: int) -> None:
        """Keep a member alive.

        Raises:
            UnknownMemberError: the session expired (or never existed): rejoin.
            RebalanceInProgressError: the generation moved on: rejoin.
        """
        g = self.groups.get(name)
        m = g.members.get(member_id) if g else None
        if g is None or m is None:
            raise UnknownMemberError(f"group {name!r} has no member {member_id!r}")
        m.last_seen_ms = now_ms
        if generation != g.generation:
            raise RebalanceInProgressError(f"group {name!r} is at generation {g.generation}")

    def leave(self, name: str, member_id: str, queue_counts: dict[str, int]) -> None:
        """Remove a member at once."""
        g = self.groups.get(name)
        if g is None or member_id not in g.members:
            return
        del g.members[member_id]
        log.info("group %s: %s left", name, member_id, extra={"group": name, "member": member_id})
        self._rebalance(g, queue_counts)

    def expire(self, now_ms: int, queue_counts: dict[str, int]) -> list[tuple[str, str]]:
        """Remove members whose session timed out; return (group, member) pairs removed."""
        gone: list[tuple[str, str]] = []
        for g in self.groups.values():
            dead = [
                mid for mid, m in g.members.items()
                if now_ms - m.last_seen_ms > m.session_timeout_ms
            ]
            for mid in dead:
                del g.members[mid]
                gone.append((g.name, mid))
                log.info("group %s: %s expired", g.name, mid, extra={"group": g.name, "member": mid})
            if dead:
                self._rebalance(g, queue_counts)
        return gone

    # -- offsets -----------------------------------------------------------------------------

    def commit(
        self, name: str, member_id: str, generation: int, entries: list[tuple[str, int, int]]
    ) -> None:
        """Store committed offsets (durably, before returning).

        Raises:
            IllegalGenerationError / UnknownMemberError: a fenced member.
            OSError: the write failed; the group's offsets are unchanged.
        """
        g = self.check_commit(name, member_id, generation)
        offsets = dict(g.offsets)
        for topic, queue, offset in entries:
            offsets[(topic, queue)] = offset
        self._save(g, offsets)

    def check_commit(self, name: str, member_id: str, generation: int) -> ConsumerGroup:
        """The group ``name`` (created if new) if a commit from ``member_id`` at ``generation``
        may be stored (generation -1: not fenced).

        Raises:
            IllegalGenerationError / UnknownMemberError: a fenced member.
            InvalidRequestError, PolicyViolationError: see :meth:`_get_or_create`.
        """
        g = self._get_or_create(name)
        if generation >= 0:
            if member_id not in g.members:
                raise UnknownMemberError(f"group {name!r} has no member {member_id!r}")
            if generation != g.generation:
                raise IllegalGenerationError(
                    f"commit for generation {generation}, group {name!r} is at {g.generation}"
                )
        return g

    def apply_txn_offsets(self, name: str, offsets: dict[tuple[str, int], int]) -> None:
        """Store offsets a committed transaction carried (durably, before returning).
        Idempotent: recovery may apply the same offsets again. Not limited by ``max_groups``
        (checked when the offsets joined the transaction: a commit is never half-applied)."""
        g = self._get_or_create(name, limited=False)
        self._save(g, {**g.offsets, **offsets})

    def committed(self, name: str) -> dict[tuple[str, int], int]:
        """A group's committed offsets (empty if unknown)."""
        g = self.groups.get(name)
        return dict(g.offsets) if g else {}

    def set_offsets(self, name: str, offsets: dict[tuple[str, int], int]) -> None:
        """Overwrite some committed offsets (reset-offset) and bump the generation so live
        members rejoin and pick the new offsets up."""
        g = self._get_or_create(name)
        self._save(g, {**g.offsets, **offsets})
        if g.members:
            g.generation += 1
            if self.on_generation is not None:
                self.on_generation(g)

    def check_deletable(self, name: str) -> None:
        """Raise unless the group ``name`` may be deleted now (a group not known may be).

        Raises:
            NonEmptyGroupError: it has live members.
        """
        g = self.groups.get(name)
        if g is not None and g.members:
            raise has_live_members("consumer", name, list(g.members.values()))

    def delete(self, name: str) -> bool:
        """Forget a group without members and remove its committed offsets from disk
        (durably); False when there is no such group.

        Raises:
            NonEmptyGroupError: it has live members.
            OSError: the file could not be removed; the group is kept.
        """
        self.check_deletable(name)
        if name not in self.groups:
            return False
        if self.files:
            (self._dir / name).unlink(missing_ok=True)
            fsync_directory(self._dir)
        del self.groups[name]
        log.info("group %s: deleted with its committed offsets", name)
        return True

    def adopt(self, offsets: dict[str, dict[tuple[str, int], int]],
              memberships: dict[str, tuple[int, list[Member]]] | None = None) -> None:
        """Take over groups with their committed offsets and, when known, their generation
        and members (a cluster broker that became their coordinator: the members go on
        heartbeating at their generation; their sessions start again now)."""
        memberships = memberships or {}
        for name in offsets.keys() | memberships.keys():
            g = ConsumerGroup(name, offsets=offsets.get(name, {}))
            if name in memberships:
                g.generation, members = memberships[name]
                g.members = {mm.member_id: mm for mm in members}
            self.groups[name] = g

    def drop(self, names: Iterable[str]) -> None:
        """Forget groups (in memory only: a cluster broker that no longer coordinates them)."""
        for name in names:
            if self.groups.pop(name, None) is not None:
                log.info("group %s: no longer coordinated here", name)

    def forget_topic(self, topic: str) -> None:
        """Drop committed offsets of a deleted topic."""
        for g in self.groups.values():
            if any(k[0] == topic for k in g.offsets):
                self._save(g, {k: o for k, o in g.offsets.items() if k[0] != topic})


MAX_NAMED_MEMBERS = 3
"""Members a NON_EMPTY_GROUP message names (then "and N more")."""


class _MemberLike(Protocol):
    member_id: str
    host: str


def has_live_members(kind: str, name: str, members: Sequence[_MemberLike]) -> NonEmptyGroupError:
    """The refusal to delete a ``kind`` ("consumer" or "delivery") group that has members,
    naming a few of them."""
    named = ", ".join(f"{m.member_id} from {m.host}" for m in members[:MAX_NAMED_MEMBERS])
    if len(members) > MAX_NAMED_MEMBERS:
        named += f" and {len(members) - MAX_NAMED_MEMBERS} more"
    n = len(members)
    return NonEmptyGroupError(
        f"{kind} group {name!r} has {n} live member{'' if n == 1 else 's'} ({named}): stop its "
        "consumers first (a member leaves when its consumer closes, or when its session times "
        "out)")
