"""Loading a delivery group from its files after a start, and folding its journal into a new
snapshot (compaction, clean shutdown).

Loading reads the snapshot and replays the journal (:mod:`.replay`, pure), then reads from the
logs what the state refers to but does not hold: the sharding keys of an orderly group's
pending messages, and the retry letters its cursor had read but not leased or had leased. A
snapshot is written only between moves (no copy waiting to become durable, nothing deferred),
so the journal it replaces holds no record that a move still has to write.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from ferrymq.broker.delivery.context import DeliveryContext
from ferrymq.broker.delivery.group import (
    DEFAULT_MAX_RECONSUME,
    DEFAULT_RETRY_DELAYS_MS,
    DeliveryGroup,
)
from ferrymq.broker.delivery.journaling import Journaling
from ferrymq.broker.delivery.letters import read_letter
from ferrymq.broker.delivery.orderly import OrderlyCursor
from ferrymq.broker.delivery.queues import GroupQueues
from ferrymq.broker.delivery.replay import Replay, snapshot
from ferrymq.broker.delivery.shortage import Shortage
from ferrymq.errors import BrokerError, CorruptRecordError
from ferrymq.protocol.letters import Letter

log = logging.getLogger("ferrymq.broker")


class Recovery:
    """Loads groups and writes their snapshots (see the module docstring)."""

    def __init__(self, ctx: DeliveryContext, journaling: Journaling, shortage: Shortage,
                 queues: GroupQueues) -> None:
        self.ctx = ctx
        self.journaling = journaling
        self.shortage = shortage
        self.queues = queues

    def load_group(self, name: str) -> DeliveryGroup:
        """Load (or create, when it has no store yet) the group ``name`` from its store (see
        :attr:`DeliveryContext.open_store`) and register it.

        Raises:
            CorruptRecordError: its snapshot is damaged.
            OSError: a file cannot be read or created.
            NotCoordinatorError: (cluster) this broker does not coordinate the group.
        """
        ctx = self.ctx
        store, snap, records = ctx.open_store(name)
        g = DeliveryGroup(name, list(DEFAULT_RETRY_DELAYS_MS), DEFAULT_MAX_RECONSUME)
        replay = Replay(ctx.to_mono, ctx.config.delivery_ack_history, ctx.next_lease)
        if snap is not None:
            replay.apply_snapshot(g, snap)
        for rec in records:
            replay.apply(g, rec)
        ctx.next_lease = replay.next_lease
        for cur in g.sources.values():
            if isinstance(cur, OrderlyCursor):
                cur.rebuild(self.queues.pending_keys(g, cur), ctx.now())
            cur.advance_floor()
        self._load_letters(g)
        ctx.groups[g.name] = g
        ctx.stores[g.name] = store
        if records or snap:
            log.info("delivery group %s: %d queues, %d leases, %d retry letters read", g.name,
                     len(g.sources), len(g.leases), len(g.retry.ready) + g.retry.in_flight)
        return g

    def _load_letters(self, g: DeliveryGroup) -> None:
        """After loading: read the letters the cursor had read but not leased (the snapshot's
        ready offsets) and those of restored leases. Nothing else: the cursor reads on from
        ``next``, and pending letters are the scheduler's."""
        rc = g.retry
        qs = self.queues.internal_queue(g.retry_topic, create=False)
        if qs is None:
            rc.restore([], {})
            rc.advance_floor()
            return
        lg = qs.log
        if rc.next < lg.start_offset:  # retention deleted letters nobody got
            rc.skip_to(lg.start_offset)
        want = sorted(rc.reload | set(rc.leased))
        records = self.queues.read_records(lg, want)
        wall = self.ctx.clock.wall_ms()
        ready: list[tuple[int, Letter, int | None]] = []
        leased: dict[int, Letter] = {}
        for o in want:
            r = records.get(o)
            if r is None:  # deleted by retention
                continue
            try:
                letter = read_letter(r)
            except CorruptRecordError as exc:
                log.error("retry queue of %s: %s; skipped", g.name, exc)
                continue
            if o in rc.leased:
                leased[o] = letter
            else:
                ready.append((o, letter, self.queues.held_until(r, letter, wall)))
        rc.restore(ready, leased)
        rc.advance_floor()

    def snapshot(self, g: DeliveryGroup) -> dict[str, Any]:
        """The group's state as a snapshot map (see :func:`.replay.snapshot`)."""
        return snapshot(g, self.ctx.to_wall, self.ctx.next_lease)

    def compact(self, force: bool = False) -> None:
        """Fold long journals into snapshots (only between moves: see the module docstring).
        A journal that cannot be rotated now (no descriptor, no space) stays as it is and is
        tried again at the next tick."""
        ctx = self.ctx
        limit = ctx.config.delivery_journal_bytes
        full = ctx.flusher.full
        for name, store in ctx.stores.items():
            if not force and store.size <= limit:
                continue
            g = ctx.groups[name]
            if g.pending_moves or store.busy() or store.failed is not None or store.deferred \
                    or store.flushable in full:
                continue
            try:
                store.rotate(self.snapshot(g))
            except OSError as exc:
                err = self.shortage.classify(exc, f"compact the delivery journal of {name}")
                if err is None:
                    raise
                self.shortage.note(err)

    def close(self) -> None:
        """Snapshot and close every group (clean shutdown). A group that cannot be snapshotted
        (no descriptor, no space) keeps its journal, which the next start replays."""
        ctx = self.ctx
        for name, store in ctx.stores.items():
            g = ctx.groups[name]
            try:
                if store.deferred:
                    with contextlib.suppress(BrokerError):
                        self.journaling.journal_deferred(g)
                if g.pending_moves == 0 and store.failed is None and not store.deferred \
                        and store.snapshot_on_close:
                    store.rotate(self.snapshot(g))
            except OSError as exc:
                if self.shortage.classify(exc, "") is None:
                    raise
                log.warning("delivery group %s: no snapshot at shutdown (%s); its journal is "
                            "replayed at the next start", name, exc)
            finally:
                store.close()
