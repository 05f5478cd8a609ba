"""The delivery groups as the server and the handlers see them (:class:`DeliveryManager`), and
their time-driven work (the tick).

Theory of operation
-------------------
A *delivery group* (RocketMQ 5's POP consumption) shares the messages of its subscribed topics
among its live members message by message, not queue by queue, so more members than queues
works and a slow member holds back only its own leases.

``RECEIVE`` leases messages to a member for an invisible time (:mod:`.receiving`). A leased
message is invisible to the rest of the group until it is acked, nacked or its lease expires
(:mod:`.settling`). Failures are *moves* to the group's retry queue ``%RETRY%<group>`` (its
retry ladder runs on the broker's scheduler) or to ``%DLQ%<group>``, and an orderly group's
failed head is retried in place (:mod:`.moves`); the dead letters are redriven, purged, or
joined on purpose by a skipped message (:mod:`.deadletters`). Groups are created by a member's
first heartbeat, lose members that leave or go silent, and are deleted, by hand or, ephemeral
ones, once empty (:mod:`.lifecycle`). DESCRIBE_DELIVERY and MESSAGE_STATUS read them without
changing anything (:mod:`.inspection`).

A group's state is pure data with its transitions (:mod:`.group`, over the cursors and leases
of :mod:`.state` and :mod:`.orderly`). Every change is journaled (:mod:`.journaling`,
:mod:`.store`) before it is applied in memory, and answered in sync flush mode once durable;
leases are journaled with their wall-clock deadline, so after a restart (:mod:`.recovery`,
replaying :mod:`.replay`) an acked message is never redelivered, a leased one stays invisible
until its lease ends, and a member that comes back with its member id can still ack it.

Running out of file descriptors (EMFILE, ENFILE) or disk space is not fatal, and changes nothing
half-way: a request that meets it is answered BUSY or STORAGE_FULL with a retry-after (a
RECEIVE that already leased messages returns them instead; a multi-step request stops at the
failed step and says which of its entries were not done). Time-driven work (:meth:`tick`:
expired leases, departed members' leases, deferred journal records) that cannot be done stays
where it is and is tried again at every tick, with one warning per episode (:mod:`.shortage`).

The collaborators share one :class:`~ferrymq.broker.delivery.context.DeliveryContext`: the
groups, their stores, the broker parts they use and the lease-id sequence. Everything here runs
on the event-loop thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferrymq._time import Clock
from ferrymq.broker.delivery.context import DeliveryContext
from ferrymq.broker.delivery.deadletters import DeadLetters
from ferrymq.broker.delivery.group import DeliveryGroup, DeliveryMember, MemberLink
from ferrymq.broker.delivery.inspection import Inspection
from ferrymq.broker.delivery.journaling import Journaling
from ferrymq.broker.delivery.lifecycle import Lifecycle
from ferrymq.broker.delivery.moves import Moves
from ferrymq.broker.delivery.orderly import OrderlyCursor
from ferrymq.broker.delivery.queues import GroupQueues
from ferrymq.broker.delivery.receiving import Receiving
from ferrymq.broker.delivery.recovery import Recovery
from ferrymq.broker.delivery.settling import Settling
from ferrymq.broker.delivery.shortage import Shortage
from ferrymq.broker.delivery.store import DeliveryStore
from ferrymq.errors import BrokerError, StorageFailureError
from ferrymq.protocol import messages as m

if TYPE_CHECKING:
    import asyncio

    from ferrymq.broker.config import BrokerConfig
    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.scheduler import Scheduler
    from ferrymq.broker.topics import TopicRegistry


class DeliveryManager:
    """Owns every delivery group of the broker (see the module docstring): the calls the server
    and the handlers make, each handed to the collaborator that owns it."""

    def __init__(
        self, config: BrokerConfig, topics: TopicRegistry, flusher: Flusher, clock: Clock,
        data_dir: Path, scheduler: Scheduler,
    ) -> None:
        ctx = self.ctx = DeliveryContext(config, topics, flusher, clock, data_dir, scheduler)
        self.groups: dict[str, DeliveryGroup] = ctx.groups
        self.stores: dict[str, DeliveryStore] = ctx.stores
        shortage = self.shortage = Shortage(flusher)
        journaling = self.journaling = Journaling(ctx, shortage)
        queues = self.queues = GroupQueues(ctx)
        self.recovery = Recovery(ctx, journaling, shortage, queues)
        moves = self.moves = Moves(ctx, journaling, queues)
        self.receiving = Receiving(ctx, journaling, shortage, queues)
        self.settling = Settling(ctx, journaling, shortage, moves)
        self.lifecycle = Lifecycle(ctx, journaling, shortage, queues, self.recovery, moves)
        self.deadletters = DeadLetters(ctx, journaling, shortage, queues, moves,
                                       on_floor_moved=self.lifecycle.recheck_ephemeral)
        self.inspection = Inspection(ctx, queues, self.deadletters)

    # -- loading and saving --------------------------------------------------------------------

    def load(self) -> None:
        """Load every group from disk (after the topics are open); finish deleting groups a
        crash interrupted."""
        self.lifecycle.load()

    def snapshot(self, g: DeliveryGroup) -> dict[str, Any]:
        """The group's state as a snapshot map."""
        return self.recovery.snapshot(g)

    def compact(self, force: bool = False) -> None:
        """Fold long journals into snapshots (tried again at the next tick when it cannot)."""
        self.recovery.compact(force)

    def close(self) -> None:
        """Snapshot and close every group (clean shutdown)."""
        self.recovery.close()

    @property
    def answers_wait(self) -> bool:
        """Whether answers wait for :meth:`when_durable` (see DeliveryContext.answers_wait)."""
        return self.ctx.answers_wait

    def when_durable(self, group: str, pos: int, cb: Callable[[BaseException | None], None]) -> None:
        """Run ``cb`` once journal position ``pos`` of ``group`` is durable."""
        self.journaling.when_durable(group, pos, cb)

    # -- groups and members (lifecycle.py) -----------------------------------------------------

    def group(self, name: str) -> DeliveryGroup:
        """The delivery group ``name``.

        Raises:
            UnknownGroupError.
        """
        return self.lifecycle.group(name)

    def heartbeat(
        self, name: str, member_id: str, client_id: str, host: str,
        subscriptions: list[tuple[str, str]], session_timeout_ms: int,
        retry_delays_ms: list[int] | None, max_reconsume: int, start_from: int,
        orderly: bool = False, *, exclusive: bool = False, ephemeral: bool = False,
        link: MemberLink | None = None,
    ) -> tuple[DeliveryGroup, DeliveryMember, int]:
        """Register or refresh a member, creating its group on the first heartbeat; returns
        (group, member, journal position or -1). See :meth:`.Lifecycle.heartbeat`."""
        return self.lifecycle.heartbeat(
            name, member_id, client_id, host, subscriptions, session_timeout_ms,
            retry_delays_ms, max_reconsume, start_from, orderly, exclusive=exclusive,
            ephemeral=ephemeral, link=link)

    def member(self, name: str, member_id: str) -> tuple[DeliveryGroup, DeliveryMember]:
        """A registered member, its last heartbeat refreshed.

        Raises:
            UnknownGroupError, UnknownMemberError: heartbeat first.
        """
        return self.lifecycle.member(name, member_id)

    def leave(self, name: str, member_id: str) -> None:
        """A member leaves: its leases go back to the group, without counting."""
        self.lifecycle.leave(name, member_id)

    def check_deletable(self, name: str, delete_dlq: bool) -> int:
        """Raise unless the group ``name`` may be deleted now; its dead letters. See
        :meth:`.Lifecycle.check_deletable`."""
        return self.lifecycle.check_deletable(name, delete_dlq)

    def delete(self, name: str, delete_dlq: bool) -> int | None:
        """Delete a group without members; how many dead letters went with it (None: no such
        group). See :meth:`.Lifecycle.delete`."""
        return self.lifecycle.delete(name, delete_dlq)

    # -- receive (receiving.py) ----------------------------------------------------------------

    def receive(
        self, g: DeliveryGroup, member_id: str, subscriptions: list[tuple[str, str]],
        max_messages: int, max_bytes: int, invisible_ms: int,
    ) -> tuple[list[m.Delivery], int]:
        """Lease what is available now; the deliveries and the journal position to wait for.
        See :meth:`.Receiving.receive`."""
        return self.receiving.receive(g, member_id, subscriptions, max_messages, max_bytes,
                                      invisible_ms)

    def wakeups(
        self, g: DeliveryGroup, subscriptions: Iterable[tuple[str, str]]
    ) -> list[set[asyncio.Future[None]]]:
        """What a long-polling RECEIVE of ``g`` waits on."""
        return self.receiving.wakeups(g, subscriptions)

    # -- ack, nack, change invisible (settling.py) ---------------------------------------------

    def ack(
        self, g: DeliveryGroup, entries: list[m.AckEntry]
    ) -> tuple[list[tuple[str, int, int, int]], int]:
        """Finish leased messages; the refused ones and the journal position to wait for. See
        :meth:`.Settling.ack`."""
        return self.settling.ack(g, entries)

    def nack(self, g: DeliveryGroup, entries: list[m.NackEntry]
             ) -> tuple[list[tuple[int, int]], list[asyncio.Future[None]]]:
        """Give messages back for a later attempt; the results and what to wait for. See
        :meth:`.Settling.nack`."""
        return self.settling.nack(g, entries)

    def change_invisible(
        self, g: DeliveryGroup, member_id: str, entries: list[tuple[str, int, int, int, int]]
    ) -> tuple[list[tuple[int, int]], int]:
        """New leases (new receipts); the results and the journal position to wait for. See
        :meth:`.Settling.change_invisible`."""
        return self.settling.change_invisible(g, member_id, entries)

    def check_invisible(self, invisible_ms: int) -> None:
        """Raise InvalidRequestError unless ``invisible_ms`` is an acceptable lease."""
        self.settling.check_invisible(invisible_ms)

    # -- admin (inspection.py, deadletters.py) -------------------------------------------------

    def describe(self, name: str) -> m.DescribeDeliveryResponse:
        """Members, per-queue progress and lag, retry and DLQ sizes."""
        return self.inspection.describe(self.lifecycle.group(name))

    def message_status(self, msg_id: str) -> m.MessageStatusResponse:
        """The state of one message in every delivery group that knows its topic."""
        return self.inspection.message_status(msg_id)

    def skip(self, name: str, msg_id: str) -> None:
        """Send a pending head of an orderly group to its dead-letter queue on purpose.

        Raises:
            InvalidRequestError: not a message id, or not a pending head of the group.
            UnknownGroupError, UnknownTopicError.
        """
        self.deadletters.skip(self.lifecycle.group(name), msg_id)

    def dlq_admin(
        self, name: str, action: int, max_messages: int, dry_run: bool, offset: int = -1
    ) -> tuple[m.DlqAdminResponse, int]:
        """Redrive or purge dead letters (the oldest, or the one at ``offset`` >= 0); returns
        the answer and a journal position."""
        return self.deadletters.admin(self.lifecycle.group(name), action, max_messages, dry_run,
                                      offset)

    # -- time passes ---------------------------------------------------------------------------

    def tick(self) -> None:
        """Expire leases, evict silent members, hand back departed members' leases, journal
        deferred records, wake receivers of due orderly retries, remove ephemeral groups left
        without members, compact. (Receivers of retry letters are woken by the retry queue:
        see :meth:`wakeups`.) Work that meets no descriptor or space waits for the next tick
        (one warning per episode, see the module docstring)."""
        ctx = self.ctx
        now = ctx.now()
        shortage = self.shortage
        shortage.start_tick()
        for g in list(ctx.groups.values()):
            if not (g.members or g.expiry or g.returning or g.retry.held
                    or ctx.stores[g.name].deferred):
                continue  # idle: nothing can be due
            try:
                self._tick_group(g, now)
            except (OSError, BrokerError) as exc:
                err = exc if isinstance(exc, StorageFailureError) else shortage.classify(
                    exc, f"serve delivery group {g.name}")
                if err is None:
                    raise
                shortage.note(err)
        if self.lifecycle.idle_ephemeral:
            self.lifecycle.remove_idle_ephemeral(now)
        self.lifecycle.finish_deletes()
        self.recovery.compact()
        shortage.end_tick()

    def _tick_group(self, g: DeliveryGroup, now: int) -> None:
        """One group's part of :meth:`tick`.

        Raises:
            BrokerError, OSError: no descriptor or space (or a failed journal) for what was
                due; it stays due.
        """
        if self.ctx.stores[g.name].deferred:
            self.journaling.journal_deferred(g)
        for mid, mem in list(g.members.items()):
            if now - mem.last_heartbeat > mem.session_timeout_ms:
                self.lifecycle.evict(g, mid, f"consumer {mid} evicted: no heartbeat for "
                                             f"{mem.session_timeout_ms} ms")
        if g.returning:
            self.lifecycle.return_leases(g)
        if g.expiry and g.expiry[0][0] <= now:
            with self.journaling.writing(g):
                for lease in g.expired(now):
                    for off in sorted(lease.offsets):
                        self.moves.fail(g, lease.key, off, lease, counts=True, delay_ms=0,
                                        reason="lease expired before an ack")
        held = g.retry.held
        if held:  # letters of an older broker whose due time came
            due = [o for o, until in held.items() if until <= now]
            for off in due:
                del held[off]
            if due:
                g.wake()
        if g.waiters and g.orderly and any(
            (d := c.next_due()) is not None and d <= now
            for c in g.sources.values() if isinstance(c, OrderlyCursor)
        ):
            g.wake()
