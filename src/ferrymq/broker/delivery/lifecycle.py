"""Which delivery groups and members exist: groups created by a first heartbeat (within
``max_delivery_groups``), members joining, leaving and evicted, groups deleted, and ephemeral
groups removed once they have no members.

A member's leases go back to its group when it leaves (not counted as an attempt) or is evicted
(counted): at once, or at the next ticks while no descriptor or space lets them move (they stay
leased meanwhile, so nobody else gets them).

An *ephemeral* group (a broadcasting consumer without an instance name asks for one in its
heartbeat) is removed like ``group delete`` removes a group (state, journal, retry queue) once
it has no members: at the next tick after its member left or was evicted, or
``max_session_timeout_ms`` after a broker start that found it (members are not kept across a
restart; a member that comes back in time keeps it). One holding dead letters is kept until
they are redriven or purged. A heartbeat that does not ask for it makes the group durable.

A deleted group's directory is renamed ``<group>~deleted`` first (fsynced): from then on the
group is gone, and what a crash or a shortage left of it is removed by the next start or tick.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import uuid
from pathlib import Path

from ferrymq._hints import DELETE_DLQ
from ferrymq.broker.consumer_groups import has_live_members
from ferrymq.broker.delivery.context import DeliveryContext
from ferrymq.broker.delivery.group import (
    MAX_RECONSUME_LIMIT,
    MAX_RETRY_DELAY_MS,
    MAX_RETRY_LADDER,
    DeliveryGroup,
    DeliveryMember,
    MemberLink,
)
from ferrymq.broker.delivery.journaling import Journaling
from ferrymq.broker.delivery.moves import Moves
from ferrymq.broker.delivery.queues import GroupQueues
from ferrymq.broker.delivery.recovery import Recovery
from ferrymq.broker.delivery.shortage import Shortage
from ferrymq.broker.topics import check_topic_name
from ferrymq.errors import (
    BrokerError,
    BusyError,
    InvalidRequestError,
    MemberConflictError,
    NonEmptyGroupError,
    PolicyViolationError,
    UnknownGroupError,
    UnknownMemberError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.letters import (
    DELIVERY_GROUP_NAME,
    delivery_group_name_problem,
)
from ferrymq.protocol.tags import parse_tag_expression
from ferrymq.storage.files import fsync_directory

log = logging.getLogger("ferrymq.broker")

DELETED_SUFFIX = "~deleted"
"""A deleted group's directory is renamed ``<group>~deleted`` (a name no group can have) before
its topics and files are removed; :meth:`Lifecycle.load` finishes what a crash left."""
DLQ_RECHECK_MS = 60_000
"""An ephemeral group without members kept for its dead letters is looked at again this often
(and at once after a DLQ purge or redrive)."""


def check_delivery_group_name(name: str) -> None:
    """Raise InvalidRequestError unless ``name`` can name a delivery group."""
    problem = delivery_group_name_problem(name)
    if problem is not None:
        raise InvalidRequestError(problem)


class Lifecycle:
    """Groups and members of the broker (see the module docstring)."""

    def __init__(self, ctx: DeliveryContext, journaling: Journaling, shortage: Shortage,
                 queues: GroupQueues, recovery: Recovery, moves: Moves) -> None:
        self.ctx = ctx
        self.groups = ctx.groups
        self.journaling = journaling
        self.shortage = shortage
        self.queues = queues
        self.recovery = recovery
        self.moves = moves
        self.idle_ephemeral: dict[str, int] = {}
        """Ephemeral groups without members -> monotonic ms when they are removed."""
        self._kept_for_dlq: set[str] = set()  # of those, kept for their dead letters (warned)
        self._unfinished_deletes: set[Path] = set()  # deleted groups' files left to remove

    def load(self) -> None:
        """Load every group from disk (after the topics are open); finish deleting groups a
        crash interrupted."""
        d0 = self.ctx.dir
        d0.mkdir(parents=True, exist_ok=True)
        deleted: list[Path] = []
        for d in sorted(d0.iterdir()):
            if d.is_dir() and DELIVERY_GROUP_NAME.fullmatch(d.name):
                if self.ctx.load_local:
                    self.recovery.load_group(d.name)
            elif d.is_dir() and d.name.endswith(DELETED_SUFFIX):
                deleted.append(d)
        for d in deleted:
            log.warning("delivery group %s: finishing its deletion", d.name[:-len(DELETED_SUFFIX)])
            self._remove_deleted(d)
        # members are not kept across a restart: an ephemeral group's come back within their
        # session, or it is removed as if they had left
        grace = self.ctx.now() + self.ctx.config.max_session_timeout_ms
        self.idle_ephemeral.update((g.name, grace) for g in self.groups.values() if g.ephemeral)

    # -- groups and members --------------------------------------------------------------------

    def group(self, name: str) -> DeliveryGroup:
        """The delivery group ``name``.

        Raises:
            UnknownGroupError.
        """
        g = self.groups.get(name)
        if g is None:
            raise UnknownGroupError(f"unknown delivery group {name[:200]!r}")
        return g

    def _create(self, name: str) -> DeliveryGroup:
        """A new group's state and files, within ``max_delivery_groups`` (checked first).

        Raises:
            InvalidRequestError: not a valid group name.
            PolicyViolationError: the broker has ``max_delivery_groups`` groups.
            OSError: its files cannot be created (nothing is left).
        """
        check_delivery_group_name(name)
        limit = self.ctx.config.max_delivery_groups
        if len(self.groups) >= limit:
            raise PolicyViolationError(
                f"delivery group {name!r} not created: the broker has {len(self.groups)} "
                f"delivery groups, max_delivery_groups={limit} (delete unused ones: ferrymq "
                "group delete)")
        d = self.ctx.dir / name
        try:
            g = self.recovery.load_group(name)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise
        log.info("created delivery group %s", name)
        return g

    def _drop_new(self, g: DeliveryGroup) -> None:
        """Undo :meth:`_create` of a group nothing was journaled for."""
        del self.groups[g.name]
        with contextlib.suppress(OSError):
            self.ctx.stores.pop(g.name).close()
        shutil.rmtree(self.ctx.dir / g.name, ignore_errors=True)

    def heartbeat(
        self, name: str, member_id: str, client_id: str, host: str,
        subscriptions: list[tuple[str, str]], session_timeout_ms: int,
        retry_delays_ms: list[int] | None, max_reconsume: int, start_from: int,
        orderly: bool = False, *, exclusive: bool = False, ephemeral: bool = False,
        link: MemberLink | None = None,
    ) -> tuple[DeliveryGroup, DeliveryMember, int]:
        """Register or refresh a member; returns (group, member, journal position or -1).

        A subscription may name a topic that does not exist yet: it is recorded with the
        member, RECEIVE skips it until it exists, and the group then starts it at its
        beginning (``awaited``). Everything is checked before the group is created, so a
        refused first heartbeat leaves no group behind.

        ``ephemeral`` asks for a group the broker removes once it has no members (see the
        module docstring); it is taken when the group is created, and a group becomes durable
        for good when a member heartbeats without it.

        Raises:
            PolicyViolationError: a new group beyond ``max_delivery_groups``.
            InvalidRequestError: a bad policy, or ``orderly`` differs from the group's (fixed
                when the group was created).
            InvalidTopicNameError: a subscription names an impossible topic.
            MemberConflictError: a new member of a group with an exclusive live member, or a
                new exclusive member of a group with another live member.
        """
        missing: list[str] = []
        for topic, expr in subscriptions:
            if topic not in self.ctx.topics.topics:
                check_topic_name(topic, internal_ok=True)
                missing.append(topic)
            parse_tag_expression(expr)
        if retry_delays_ms is not None and (
            not 1 <= len(retry_delays_ms) <= MAX_RETRY_LADDER
            or not all(0 <= d <= MAX_RETRY_DELAY_MS for d in retry_delays_ms)
        ):
            raise InvalidRequestError(
                f"retry_delays must be 1..{MAX_RETRY_LADDER} delays of 0..{MAX_RETRY_DELAY_MS} ms"
            )
        if not -1 <= max_reconsume <= MAX_RECONSUME_LIMIT:
            raise InvalidRequestError(f"max_reconsume must be 0..{MAX_RECONSUME_LIMIT}")
        if start_from < m.OffsetSpec.EARLIEST:
            raise InvalidRequestError(f"start_from must be -1, -2 or a timestamp, not {start_from}")
        g0 = self.groups.get(name)
        if g0 is not None and g0.orderly != orderly:
            kind = "orderly" if g0.orderly else "concurrent (not orderly)"
            raise InvalidRequestError(
                f"delivery group {name!r} is {kind}: that is fixed when a group is created; "
                f"use {'orderly=True' if g0.orderly else 'another group name'}")
        now = self.ctx.now()
        if g0 is not None and member_id not in g0.members:
            self._admit(g0, client_id, host, exclusive, now)
        g = g0 if g0 is not None else self._create(name)
        pos = -1
        new_delays = retry_delays_ms if retry_delays_ms is not None else g.retry_delays_ms
        new_max = max_reconsume if max_reconsume >= 0 else g.max_reconsume
        new_start = start_from if g0 is None else g.start_from
        new_ephemeral = ephemeral if g0 is None else g.ephemeral and ephemeral
        if (g0 is None or new_delays != g.retry_delays_ms or new_max != g.max_reconsume
                or new_start != g.start_from or new_ephemeral != g.ephemeral):
            try:
                pos = self.journaling.journal(g, ["P", list(new_delays), new_max, new_start,
                                                  orderly, new_ephemeral])
            except BaseException:
                if g0 is None:
                    self._drop_new(g)
                raise
            if g.ephemeral and not new_ephemeral:
                log.info("delivery group %s: durable now (a member joined without asking for "
                         "an ephemeral group)", name)
            g.set_policy(new_delays, new_max, new_start, orderly, new_ephemeral)
        g.awaited.update(t for t in missing if not any(k[0] == t for k in g.sources))
        if not member_id:
            member_id = f"{client_id or 'consumer'}-{uuid.uuid4().hex[:12]}"
        mem = g.members.get(member_id)
        if mem is None:
            mem = g.members[member_id] = DeliveryMember(
                member_id, client_id, host, now, session_timeout_ms, list(subscriptions),
                exclusive, link,
            )
            self.idle_ephemeral.pop(name, None)
            self._kept_for_dlq.discard(name)
            log.info("delivery group %s: member %s joined from %s%s", name, member_id, host,
                     " (ephemeral group)" if g.ephemeral else "")
        else:
            mem.last_heartbeat = now
            mem.session_timeout_ms = session_timeout_ms
            mem.subscriptions = list(subscriptions)
            mem.host = host
            mem.exclusive = exclusive
            mem.link = link
        return g, mem, pos

    def _admit(self, g: DeliveryGroup, client_id: str, host: str, exclusive: bool,
               now: int) -> None:
        """Let a new member into ``g`` or refuse it: a group with an exclusive member (or a new
        exclusive member) allows one live member. Members that are gone (session expired, or
        their connection closed) are evicted first, as the next tick would.

        Raises:
            MemberConflictError: the other member is live.
        """
        if not exclusive and not any(mem.exclusive for mem in g.members.values()):
            return
        for mid, mem in list(g.members.items()):
            if mem.is_live(now):
                raise MemberConflictError(
                    f"delivery group {g.name!r} already has a live member ({mem.member_id}, "
                    f"{mem.client_id} from {mem.host}, last heartbeat "
                    f"{(now - mem.last_heartbeat) / 1000:.1f} s ago); refused {client_id} from "
                    f"{host}: a broadcasting consumer's instance_name must be unique among "
                    f"live consumers of its group (stop the other one, or use another "
                    f"instance_name)")
            self.evict(g, mid, f"consumer {mid} replaced: its connection closed")

    def evict(self, g: DeliveryGroup, member_id: str, reason: str) -> None:
        """Drop a member that vanished without leaving; its leases count as failed attempts."""
        del g.members[member_id]
        log.info("delivery group %s: member %s evicted (%s)", g.name, member_id, reason)
        self._release_member(g, member_id, counts=True, reason=reason)

    def member(self, name: str, member_id: str) -> tuple[DeliveryGroup, DeliveryMember]:
        """A registered member (its last heartbeat refreshed: any request proves it alive).

        Raises:
            UnknownGroupError, UnknownMemberError: heartbeat first.
        """
        g = self.group(name)
        mem = g.members.get(member_id)
        if mem is None:
            raise UnknownMemberError(f"member {member_id[:100]!r} is not in group {name!r}")
        mem.last_heartbeat = self.ctx.now()
        return g, mem

    def leave(self, name: str, member_id: str) -> None:
        """A member leaves: its leases go back to the group at once, without counting (or at
        the next ticks, when no descriptor or space lets them move now)."""
        g = self.group(name)
        if g.members.pop(member_id, None) is None:
            raise UnknownMemberError(f"member {member_id[:100]!r} is not in group {name!r}")
        log.info("delivery group %s: member %s left", name, member_id)
        self._release_member(g, member_id, counts=False, reason="consumer left")

    def _release_member(self, g: DeliveryGroup, member_id: str, *, counts: bool,
                        reason: str) -> None:
        """Hand the leases of a member that is gone back to the group: now, or at the next
        ticks when no descriptor or space lets them move (they stay leased meanwhile, so
        nobody else gets them). An ephemeral group left without members is removed soon."""
        g.hand_back(member_id, counts=counts, reason=reason)
        if g.ephemeral and not g.members:
            self.idle_ephemeral[g.name] = self.ctx.now()
        try:
            self.return_leases(g)
        except (OSError, BrokerError) as exc:
            err = self.shortage.classify(exc, f"hand back the leases of {member_id}")
            if err is None:
                raise
            self.shortage.note(err)

    def return_leases(self, g: DeliveryGroup) -> None:
        """Move the messages of ``g.returning`` on (retry queue, DLQ, or in place), oldest
        first; what cannot move now stays there.

        Raises:
            BrokerError, OSError: no descriptor or space (or a failed journal) for the next.
        """
        ret = g.returning
        if not ret:
            return
        with self.journaling.writing(g):
            while ret:
                lease, counts, reason = ret[0]
                for off in sorted(lease.offsets):
                    self.moves.fail(g, lease.key, off, lease, counts=counts, delay_ms=0,
                                    reason=reason)
                ret.popleft()

    # -- deleting ------------------------------------------------------------------------------

    def check_deletable(self, name: str, delete_dlq: bool) -> int:
        """Raise unless the group ``name`` may be deleted now; its dead letters (0 for a group
        not known).

        Raises:
            NonEmptyGroupError: it has live members, or dead letters and not ``delete_dlq``.
            BusyError: messages are being moved to its retry or dead-letter queue (retriable:
                for a moment after a member left).
        """
        g = self.groups.get(name)
        if g is None:
            return 0
        if g.members:
            raise has_live_members("delivery", name, list(g.members.values()))
        if g.pending_moves or g.returning or self.ctx.stores[name].deferred:
            raise BusyError(f"delivery group {name!r} is still handing back or moving "
                            "messages to its retry or dead-letter queue",
                            retry_after_ms=self.ctx.config.busy_retry_after_ms)
        dead = self.queues.dlq_size(g)
        if dead and not delete_dlq:
            raise NonEmptyGroupError(
                f"delivery group {name!r} has {dead} dead letters in {g.dlq_topic}: redrive or "
                f"purge them first, or delete them with the group ({DELETE_DLQ})")
        return dead

    def delete(self, name: str, delete_dlq: bool) -> int | None:
        """Delete a group without members: its state (cursors, leases, retry policy, ack
        history), its retry queue and its dead-letter queue; returns how many dead letters went
        with it (None: no such group). A member that comes later under this name starts a new
        group (``start_from``).

        The directory is renamed first (``<group>~deleted``, fsynced): from then on the group is
        gone, and a crash before the rest is done is finished by :meth:`load`; what cannot be
        removed now for lack of descriptors or space is removed by a later tick.

        Raises:
            NonEmptyGroupError, BusyError: see :meth:`check_deletable`.
            OSError: the rename failed; nothing changed.
        """
        dead = self.check_deletable(name, delete_dlq)
        g = self.groups.get(name)
        if g is None:
            return None
        d0 = self.ctx.dir
        gone = d0 / f"{name}{DELETED_SUFFIX}"
        (d0 / name).rename(gone)
        try:
            fsync_directory(d0)
        except OSError as exc:  # the rename is done; a crash before it is durable undoes it
            if self.shortage.classify(exc, "") is None:
                raise
        del self.groups[name]
        self.idle_ephemeral.pop(name, None)
        self._kept_for_dlq.discard(name)
        with contextlib.suppress(OSError):  # renamed away: its last fsync is moot
            self.ctx.stores.pop(name).close()
        g.wake()
        self._finish_delete(gone)
        log.info("delivery group %s: deleted (%d dead letters with it)", name, dead)
        return dead

    def _finish_delete(self, d: Path) -> None:
        """:meth:`_remove_deleted`, or at a later tick when descriptors or space are short."""
        try:
            self._remove_deleted(d)
        except OSError as exc:
            err = self.shortage.classify(
                exc, f"remove the files of the deleted delivery group {d.name}")
            if err is None:
                raise
            self.shortage.note(err)
            self._unfinished_deletes.add(d)

    def finish_deletes(self) -> None:
        """Remove what earlier deletions left for lack of descriptors or space (tick)."""
        for d in list(self._unfinished_deletes):
            self._unfinished_deletes.discard(d)
            self._finish_delete(d)

    def _remove_deleted(self, d: Path) -> None:
        """Remove a deleted group's retry and dead-letter topics, then its directory (unless a
        group of that name exists again: its topics are its own)."""
        name = d.name[:-len(DELETED_SUFFIX)]
        if name not in self.groups:
            self.ctx.remove_topics(name)
        shutil.rmtree(d, ignore_errors=True)
        fsync_directory(self.ctx.dir)

    # -- ephemeral groups ------------------------------------------------------------------------

    def remove_idle_ephemeral(self, now: int) -> None:
        """Remove the ephemeral groups whose last member left or was evicted (or that got no
        member within ``max_session_timeout_ms`` of a broker start), as :meth:`delete` does,
        once nothing of theirs is moving. One with dead letters is kept (they are not dropped
        silently: see docs/delivery.md) and looked at again every DLQ_RECHECK_MS."""
        for name, when in list(self.idle_ephemeral.items()):
            if when > now:
                continue
            g = self.groups.get(name)
            if g is None or g.members or not g.ephemeral:
                del self.idle_ephemeral[name]
                continue
            try:
                dead = self.check_deletable(name, delete_dlq=False)
                self.delete(name, delete_dlq=False)
            except BusyError:
                continue  # still moving messages: next tick
            except NonEmptyGroupError:
                if name not in self._kept_for_dlq:
                    self._kept_for_dlq.add(name)
                    log.warning("ephemeral delivery group %s has no members but %d dead letters "
                                "in %s: kept until they are redriven or purged (ferrymq dlq), or "
                                "deleted with it (ferrymq group delete %s --delete-dlq)", name,
                                self.queues.dlq_size(g), g.dlq_topic, name)
                self.idle_ephemeral[name] = now + DLQ_RECHECK_MS
                continue
            except OSError as exc:
                err = self.shortage.classify(exc, f"remove the ephemeral delivery group {name}")
                if err is None:
                    raise
                self.shortage.note(err)
                continue
            log.info("delivery group %s: removed (ephemeral, no members left)%s", name,
                     f"; {dead} dead letters with it" if dead else "")

    def recheck_ephemeral(self, g: DeliveryGroup) -> None:
        """An ephemeral group without members kept for its dead letters: look again now."""
        if g.name in self.idle_ephemeral:
            self.idle_ephemeral[g.name] = self.ctx.now()
