"""Per-message delivery: leases, acks, retries with backoff, dead letters, member liveness.

Theory of operation
-------------------
A *delivery group* (RocketMQ 5's POP consumption) shares the messages of its subscribed topics
among its live members message by message, not queue by queue, so more members than queues
works and a slow member holds back only its own leases.

``RECEIVE`` leases messages to a member for an invisible time. First deliveries come from the
topic's queues in FIFO order per queue (:class:`~ferrymq.broker.delivery.state.SourceCursor`),
after any retries that are due. A leased message is invisible to the rest of the group until it
is acked, nacked or its lease expires.

Failures are *moves*: the message is copied, with letter properties (see
:mod:`~ferrymq.broker.delivery.letters`), to the group's retry queue ``%RETRY%<group>`` with a
due time from the retry ladder, or to ``%DLQ%<group>`` once it failed more than
``max_reconsume`` times. The original position is marked finished only after the copy is
durable, so a crash in between delivers the message twice, never zero times. An expired lease
or an evicted member's lease is a failure that is due at once (the lease was the wait).

The retry ladder runs on the broker's scheduler (:mod:`ferrymq.broker.scheduler`): a letter
with a delay is appended as a scheduled record and indexed there (on disk; only the near future
in memory), and the scheduler appends its visible copy to the retry queue when it is due. A
letter due at once is appended visible. The group's
:class:`~ferrymq.broker.delivery.state.RetryCursor` scans the visible letters in offset order and
keeps at most ``max_retry_loaded`` of them in memory ahead of receivers, so memory does not grow
with the number of pending retries. A long-polling RECEIVE also waits on the retry queue's
``QueueState`` and is woken when a letter (or a due letter's copy) becomes visible there.

Every change is journaled (:mod:`~ferrymq.broker.delivery.store`) before it is acknowledged in
sync flush mode; leases are journaled with their wall-clock deadline, so after a restart an
acked message is never redelivered and a leased one stays invisible until its lease ends, and a
member that comes back with its member id can still ack it.

An *ephemeral* group (a broadcasting consumer without an instance name asks for one in its
heartbeat) is removed like ``group delete`` removes a group (state, journal, retry queue) once
it has no members: at the next tick after its member left or was evicted, or
``max_session_timeout_ms`` after a broker start that found it (members are not kept across a
restart; a member that comes back in time keeps it). One holding dead letters is kept until
they are redriven or purged. A heartbeat that does not ask for it makes the group durable.

Running out of file descriptors (EMFILE, ENFILE) or disk space is not fatal here either, and
changes nothing half-way: every change is journaled *before* it is applied in memory (a lease,
an ack, a policy, a tag filter, a failure retried in place), and a move writes the message's
copy before it finishes the original, so a failure of either leaves the group as it was. A
request that meets it is answered BUSY or STORAGE_FULL with a retry-after (a RECEIVE that
already leased messages returns them instead); a multi-step request stops at the failed step
and says which of its entries were not done. Before a change, the group's journal descriptor
is opened and held (:meth:`~ferrymq.storage.journal.Journal.hold`), so its appends cannot meet
EMFILE half-way. Time-driven work (expired leases, departed members' leases: :meth:`tick`)
that cannot be done stays where it is (the lease stays leased, so nobody else gets the message)
and is tried again at every tick, with one warning per episode. A finish that is already in
memory but could not be journaled waits in its store's ``deferred`` records and is journaled at
the next ticks (its nack is answered once that is durable).

Everything here runs on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import logging
import shutil
import uuid
from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferrymq._hints import DELETE_DLQ
from ferrymq._time import Clock
from ferrymq.broker.delivery.letters import (
    StoredRecord,
    iter_stored,
    make_letter,
    read_letter,
    stored_record,
)
from ferrymq.broker.delivery.orderly import Failure, OrderlyCursor
from ferrymq.broker.delivery.state import (
    AckRun,
    DeliveryGroup,
    DeliveryMember,
    Lease,
    MemberLink,
    RetryCursor,
    SourceCursor,
    TagFilter,
)
from ferrymq.broker.delivery.store import Callback, GroupStore
from ferrymq.broker.flusher import flush_postponed
from ferrymq.broker.groups import has_live_members
from ferrymq.broker.scheduler import CANCELLED_STATE, NOT_SCHEDULED
from ferrymq.broker.topics import check_topic_name
from ferrymq.errors import (
    BrokerError,
    BusyError,
    CorruptRecordError,
    InvalidRequestError,
    MemberConflictError,
    NonEmptyGroupError,
    PolicyViolationError,
    StorageFailureError,
    UnknownGroupError,
    UnknownMemberError,
    UnknownTopicError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.letters import (
    DELIVERY_GROUP_NAME,
    DLQ_TOPIC_PREFIX,
    MAX_REASON_CHARS,
    RETRY_TOPIC_PREFIX,
    Letter,
    delivery_group_name_problem,
)
from ferrymq.protocol.markers import ReadCommittedFilter
from ferrymq.protocol.records import (
    ATTR_CONTROL,
    ATTR_SCHEDULED,
    ATTR_TRANSACTIONAL,
    BatchHeader,
    RawRecord,
    decode_msg_id,
    encode_msg_id,
    filter_batch,
    iter_batches,
    iter_raw_records,
)
from ferrymq.protocol.schedule import SCHEDULED_ID
from ferrymq.protocol.tags import parse_tag_expression
from ferrymq.storage.files import fsync_directory

if TYPE_CHECKING:
    import asyncio

    from ferrymq.broker.config import BrokerConfig
    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.scheduler import Scheduler
    from ferrymq.broker.topics import QueueState, TopicRegistry
    from ferrymq.storage.log import Log

log = logging.getLogger("ferrymq.broker")

DELETED_SUFFIX = "~deleted"
"""A deleted group's directory is renamed ``<group>~deleted`` (a name no group can have) before
its topics and files are removed; :meth:`DeliveryManager.load` finishes what a crash left."""

DEFAULT_RETRY_DELAYS_MS = [
    s * 1000 for s in (10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800,
                       3600, 7200)
]
"""RocketMQ's retry ladder: 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h."""
DEFAULT_MAX_RECONSUME = 16
MAX_RETRY_DELAY_MS = 24 * 3600 * 1000
MAX_RECONSUME_LIMIT = 1000
MAX_RETRY_LADDER = 64
MAX_DLQ_SCAN = 100_000
"""Most dead letters MESSAGE_STATUS reads looking for a message (older ones: CONSUMED)."""
RECEIVE_FIRST_READ_BYTES = 64 * 1024
"""RECEIVE reads a queue in steps starting at this size (growing 4x) until the lease is full."""
ORDERLY_READ_GAP = 4096
"""Orderly RECEIVE reads ready heads closer than this many offsets in one sequential pass."""
DLQ_RECHECK_MS = 60_000
"""An ephemeral group without members kept for its dead letters is looked at again this often
(and at once after a DLQ purge or redrive)."""
MAX_REDRIVE_BATCH = 10_000
"""Most dead letters one DLQ_ADMIN redrive moves (the CLI loops for more)."""
MAX_RETRY_SCAN = 100_000
"""MESSAGE_STATUS looks for a message's retry letter among the newest this many records of the
group's retry queue (an older letter that is still pending is not found: see delivery.md)."""
RETRY_READ_BYTES = 256 * 1024
"""The retry cursor reads its queue in steps of this size."""
RETRY_COUNT_BYTES = 64 * 1024 * 1024
"""DESCRIBE_DELIVERY counts visible letters the retry cursor has not read yet, reading at most
this many bytes of the retry queue per call (it goes on where it stopped next time)."""

_OK = int(ErrorCode.NONE)
_BAD_RECEIPT = int(ErrorCode.INVALID_RECEIPT)


def check_delivery_group_name(name: str) -> None:
    """Raise InvalidRequestError unless ``name`` can name a delivery group."""
    problem = delivery_group_name_problem(name)
    if problem is not None:
        raise InvalidRequestError(problem)


def _runs(offsets: Iterable[int]) -> list[list[int]]:
    """Sorted offsets as ``[start, count]`` runs (journal form)."""
    out: list[list[int]] = []
    for o in sorted(offsets):
        if out and out[-1][0] + out[-1][1] == o:
            out[-1][1] += 1
        else:
            out.append([o, 1])
    return out


def _expand(runs: list[list[int]]) -> list[int]:
    return [o for start, n in runs for o in range(start, start + n)]


def _batches_between(
    lg: Log, first: int, last: int, chunk_filter: Callable[[bytes], bool] | None = None,
) -> Iterator[tuple[memoryview, int, BatchHeader, list[RawRecord]]]:
    """Each stored batch holding offsets ``first..last`` with its records in that range, read
    sequentially (1 MiB at a time; stops early at a gap it cannot read past). With
    ``chunk_filter``, the batches of a chunk read are skipped unless it returns True for it.

    Raises:
        CorruptRecordError: a batch's records do not add up.
    """
    pos = max(first, lg.start_offset)
    while pos <= last:
        try:
            data = lg.read(pos, 1 << 20)
        except BrokerError:
            return
        if not data:
            return
        before = pos
        wanted = chunk_filter is None or chunk_filter(data)
        mv = memoryview(data)
        for p0, h in iter_batches(mv):
            if wanted and h.last_offset >= pos:
                yield mv, p0, h, [r for r in iter_raw_records(mv, p0, h) if pos <= r[0] <= last]
            pos = max(pos, h.last_offset + 1)
            if pos > last:
                return
        if pos == before:
            return


class DeliveryManager:
    """Owns every delivery group of the broker (see the module docstring)."""

    def __init__(
        self, config: BrokerConfig, topics: TopicRegistry, flusher: Flusher, clock: Clock,
        data_dir: Path, scheduler: Scheduler,
    ) -> None:
        self.config = config
        self.topics = topics
        self.flusher = flusher
        self.clock = clock
        self.scheduler = scheduler  # runs the retry ladder (see the module docstring)
        self.sync = config.flush == "sync"
        self.dir = data_dir / "delivery"
        self.handles = topics.handles  # the journals' descriptors share the segments' cache
        self.groups: dict[str, DeliveryGroup] = {}
        self.stores: dict[str, GroupStore] = {}
        self._next_lease = 1
        self._short: BrokerError | None = None
        """What made time-driven work wait (no descriptor, no space) in the current episode:
        warned once when it starts, told when it is over."""
        self._short_seen = False  # a shortage met since the last tick
        self._idle_ephemeral: dict[str, int] = {}
        """Ephemeral groups without members -> monotonic ms when they are removed."""
        self._kept_for_dlq: set[str] = set()  # of those, kept for their dead letters (warned)
        self._unfinished_deletes: set[Path] = set()  # deleted groups' files left to remove

    # -- time ----------------------------------------------------------------------------------

    def _now(self) -> int:
        return int(self.clock.monotonic() * 1000)

    def _to_wall(self, mono_ms: int) -> int:
        return self.clock.wall_ms() + (mono_ms - self._now())

    def _to_mono(self, wall_ms: int) -> int:
        return self._now() + max(0, wall_ms - self.clock.wall_ms())

    # -- loading and saving --------------------------------------------------------------------

    def load(self) -> None:
        """Load every group from disk (after the topics are open); finish deleting groups a
        crash interrupted."""
        self.dir.mkdir(parents=True, exist_ok=True)
        deleted: list[Path] = []
        for d in sorted(self.dir.iterdir()):
            if d.is_dir() and DELIVERY_GROUP_NAME.fullmatch(d.name):
                self._load_group(d)
            elif d.is_dir() and d.name.endswith(DELETED_SUFFIX):
                deleted.append(d)
        for d in deleted:
            log.warning("delivery group %s: finishing its deletion", d.name[:-len(DELETED_SUFFIX)])
            self._remove_deleted(d)
        # members are not kept across a restart: an ephemeral group's come back within their
        # session, or it is removed as if they had left
        grace = self._now() + self.config.max_session_timeout_ms
        self._idle_ephemeral.update((g.name, grace) for g in self.groups.values() if g.ephemeral)

    def _load_group(self, d: Path) -> DeliveryGroup:
        store, snap, records = GroupStore.load(d, self.handles)
        g = DeliveryGroup(d.name, list(DEFAULT_RETRY_DELAYS_MS), DEFAULT_MAX_RECONSUME)
        if snap is not None:
            self._apply_snapshot(g, snap)
        for rec in records:
            self._replay(g, rec)
        for cur in g.sources.values():
            if isinstance(cur, OrderlyCursor):
                cur.rebuild(self._pending_keys(cur), self._now())
            cur.advance_floor()
        self._load_letters(g)
        self.groups[g.name] = g
        self.stores[g.name] = store
        if records or snap:
            log.info("delivery group %s: %d queues, %d leases, %d retry letters read", g.name,
                     len(g.sources), len(g.leases), len(g.retry.ready) + g.retry.in_flight)
        return g

    def _restore_lease(
        self, g: DeliveryGroup, key: tuple[str, int], lease_id: int, member: str,
        deadline_wall: int, reconsume: int, offsets: list[int],
    ) -> None:
        lease = Lease(lease_id, member, key, self._to_mono(deadline_wall), reconsume)
        if key[0] == g.retry_topic:
            for o in offsets:
                g.retry.leased[o] = lease
                g.retry.reload.discard(o)
                lease.offsets.add(o)
        else:
            cur = g.sources.get(key)
            if cur is None:
                cur = g.sources[key] = g.new_cursor(key[0], key[1], min(offsets, default=0))
            cur.restore(offsets, lease)
            if offsets and offsets[-1] >= cur.next and not isinstance(cur, OrderlyCursor):
                cur.next = max(offsets) + 1
        if lease.offsets:
            g.add_lease(lease, len(lease.offsets))
        self._next_lease = max(self._next_lease, lease_id + 1)

    def _apply_snapshot(self, g: DeliveryGroup, snap: dict[str, Any]) -> None:
        g.retry_delays_ms = list(snap["delays"])
        g.max_reconsume = int(snap["max"])
        g.start_from = int(snap.get("start", m.OffsetSpec.EARLIEST))
        g.orderly = bool(snap.get("orderly", False))
        g.ephemeral = bool(snap.get("ephemeral", False))
        g.dlq_floor = int(snap["dlq_floor"])
        self._next_lease = max(self._next_lease, int(snap["lease_seq"]))
        for topic, queue, floor, nxt, leases, *orderly in snap["sources"]:
            cur = g.sources[(topic, queue)] = g.new_cursor(topic, queue, floor)
            cur.next = nxt
            if isinstance(cur, OrderlyCursor) and orderly:
                pending, failures = orderly
                cur.pending.update(_expand(pending))
                for off, reconsume, until_wall, since, reason in failures:
                    cur.failures[off] = Failure(reconsume, self._to_mono(until_wall), since,
                                                reason)
            for lease_id, member, deadline, reconsume, runs in leases:
                self._restore_lease(g, (topic, queue), lease_id, member, deadline, reconsume,
                                    _expand(runs))
        g.acked = deque(AckRun(*r) for r in snap.get("acks", ()))
        for topic, expression, since in snap.get("filters", ()):
            self._set_tag_filter(g, topic, expression, {int(q): int(o) for q, o in since})
        retry = snap["retry"]
        if len(retry) == 4:  # format 1: every letter was in memory; read them again from floor
            floor, _nxt, done, leases = retry
            g.retry = RetryCursor(floor)
        else:
            floor, nxt, ready, done, leases = retry
            g.retry = RetryCursor(floor)
            g.retry.next = g.retry.counted = nxt
            g.retry.reload = set(_expand(ready))
        g.retry.done = set(_expand(done))
        for lease_id, member, deadline, reconsume, runs in leases:
            self._restore_lease(g, (g.retry_topic, 0), lease_id, member, deadline, reconsume,
                                _expand(runs))

    def _replay(self, g: DeliveryGroup, rec: list[Any]) -> None:
        kind = rec[0]
        if kind == "L" or kind == "C":
            _, topic, queue, lease_id, member, deadline, reconsume, runs = rec
            key = (topic, queue)
            offsets = _expand(runs)
            if kind == "C":  # the offsets left their old lease
                self._forget(g, key, offsets)
            self._restore_lease(g, key, lease_id, member, deadline, reconsume, offsets)
        elif kind == "A":
            _, topic, queue, runs = rec[:4]
            self._forget(g, (topic, queue), _expand(runs), finished=True)
            if len(rec) > 4:  # an acknowledgement (not a move): remember when
                self._remember_acks(g, rec)
        elif kind == "N":
            _, topic, queue, nxt = rec
            cur = g.sources.get((topic, queue))
            if cur is None:
                cur = g.sources[(topic, queue)] = g.new_cursor(topic, queue, nxt)
            if isinstance(cur, OrderlyCursor):
                cur.advance_to(nxt)
            else:
                cur.next = max(cur.next, nxt)
        elif kind == "F":
            _, topic, queue, offset, reconsume, until_wall, since, reason = rec
            cur = g.sources.get((topic, queue))
            if isinstance(cur, OrderlyCursor) and offset in cur.pending:
                lease = cur.leased.pop(offset, None)
                if lease is not None:
                    lease.offsets.discard(offset)
                    g.drop_from_lease(lease)
                cur.failures[offset] = Failure(reconsume, self._to_mono(until_wall), since,
                                               reason)
        elif kind == "P":
            g.retry_delays_ms = list(rec[1])
            g.max_reconsume = int(rec[2])
            g.start_from = int(rec[3])
            if len(rec) > 4:
                g.orderly = bool(rec[4])
            if len(rec) > 5:
                g.ephemeral = bool(rec[5])
        elif kind == "D":
            g.dlq_floor = max(g.dlq_floor, int(rec[1]))
        elif kind == "T":
            _, topic, expression, since = rec
            self._set_tag_filter(g, topic, expression, {int(q): int(o) for q, o in since})
        else:
            raise CorruptRecordError(f"delivery journal of {g.name}: unknown record {kind!r}")

    def _forget(
        self, g: DeliveryGroup, key: tuple[str, int], offsets: list[int], *,
        finished: bool = False,
    ) -> None:
        """Replay: ``offsets`` leave their leases (and are done when ``finished``)."""
        if key[0] == g.retry_topic:
            rc = g.retry
            for o in offsets:
                lease = rc.leased.pop(o, None)
                if lease is not None:
                    lease.offsets.discard(o)
                    g.drop_from_lease(lease)
                if finished:
                    rc.reload.discard(o)
                    if o >= rc.next:
                        rc.done.add(o)
            return
        cur = g.sources.get(key)
        if cur is None:
            if not finished or not offsets:
                return
            cur = g.sources[key] = g.new_cursor(key[0], key[1], min(offsets))
        if isinstance(cur, OrderlyCursor):
            for o in offsets:
                if finished:
                    lease = cur.finish(o)
                else:  # a changed lease: still pending, still failed if it was
                    lease = cur.leased.pop(o, None)
                    if lease is not None:
                        lease.offsets.discard(o)
                if lease is not None:
                    g.drop_from_lease(lease)
            return
        for o in offsets:
            lease = cur.finish(o)
            if lease is not None:
                g.drop_from_lease(lease)
            if o >= cur.next:
                cur.next = o + 1

    def _load_letters(self, g: DeliveryGroup) -> None:
        """After loading: read the letters the cursor had read but not leased (the snapshot's
        ready offsets) and those of restored leases. Nothing else: the cursor reads on from
        ``next``, and pending letters are the scheduler's."""
        rc = g.retry
        qs = self._internal_queue(g.retry_topic, create=False)
        if qs is None:
            rc.restore([], {})
            rc.advance_floor()
            return
        lg = qs.log
        if rc.next < lg.start_offset:  # retention deleted letters nobody got
            rc.skip_to(lg.start_offset)
        want = sorted(rc.reload | set(rc.leased))
        records = self._read_records(lg, want)
        wall = self.clock.wall_ms()
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
                ready.append((o, letter, self._held_until(r, letter, wall)))
        rc.restore(ready, leased)
        rc.advance_floor()

    def _read_records(self, lg: Log, offsets: list[int]) -> dict[int, StoredRecord]:
        """The records at ``offsets`` (rising), near ones read in one pass."""
        out: dict[int, StoredRecord] = {}
        want = set(offsets)
        i = 0
        while i < len(offsets):
            j = i
            while j + 1 < len(offsets) and offsets[j + 1] - offsets[j] <= ORDERLY_READ_GAP:
                j += 1
            for mv, _p0, _h, recs in _batches_between(lg, offsets[i], offsets[j]):
                for rec in recs:
                    if rec[0] in want:
                        out[rec[0]] = stored_record(mv, rec)
            i = j + 1
        return out

    def _held_until(self, record: StoredRecord, letter: Letter, wall: int) -> int | None:
        """A visible letter written by an older broker (before retries were scheduled) with a
        due time still ahead: the monotonic time it may go. None for anything else (copies of
        scheduled letters carry ``%SCHEDULED_ID`` and are due by definition)."""
        if SCHEDULED_ID in record.properties or letter.due_wall <= wall:
            return None
        return self._to_mono(letter.due_wall)

    def snapshot(self, g: DeliveryGroup) -> dict[str, Any]:
        """The group's state as a snapshot map (see _apply_snapshot)."""

        def leases(leased: dict[int, Lease]) -> list[list[Any]]:
            by_lease: dict[int, Lease] = {}
            for lease in leased.values():
                by_lease[lease.lease_id] = lease
            return [
                [ls.lease_id, ls.member, self._to_wall(ls.deadline), ls.reconsume,
                 _runs(ls.offsets)]
                for ls in by_lease.values()
            ]

        rc = g.retry
        return {
            "delays": g.retry_delays_ms,
            "max": g.max_reconsume,
            "start": g.start_from,
            "dlq_floor": g.dlq_floor,
            "lease_seq": self._next_lease,
            "orderly": g.orderly,
            "ephemeral": g.ephemeral,
            "sources": [
                [c.topic, c.queue, c.floor, c.next, leases(c.leased)]
                + ([_runs(c.pending), [
                    [off, f.reconsume, self._to_wall(f.until), f.since_wall, f.reason]
                    for off, f in c.failures.items()]] if isinstance(c, OrderlyCursor) else [])
                for c in g.sources.values()
            ],
            "retry": [rc.floor, rc.next, _runs(rc.ready), _runs(rc.done), leases(rc.leased)],
            "acks": [list(r) for r in g.acked],
            "filters": [[topic, tf.expression, [[q, o] for q, o in tf.since.items()]]
                        for topic, tf in g.tag_filters.items()],
        }

    def compact(self, force: bool = False) -> None:
        """Fold long journals into snapshots (only between moves: see the module docstring).
        A journal that cannot be rotated now (no descriptor, no space) stays as it is and is
        tried again at the next tick."""
        limit = self.config.delivery_journal_bytes
        full = self.flusher.full
        for name, store in self.stores.items():
            if not force and store.journal.size <= limit:
                continue
            g = self.groups[name]
            if g.pending_moves or store.waiters or store.failed is not None or store.deferred \
                    or store in full:
                continue
            try:
                store.rotate(self.snapshot(g))
            except OSError as exc:
                err = self._shortage(exc, f"compact the delivery journal of {name}")
                if err is None:
                    raise
                self._note_short(err)

    def close(self) -> None:
        """Snapshot and close every group (clean shutdown). A group that cannot be snapshotted
        (no descriptor, no space) keeps its journal, which the next start replays."""
        for name, store in self.stores.items():
            g = self.groups[name]
            try:
                if store.deferred:
                    with contextlib.suppress(BrokerError):
                        self._journal_deferred(g)
                if g.pending_moves == 0 and store.failed is None and not store.deferred:
                    store.rotate(self.snapshot(g))
            except OSError as exc:
                if self._shortage(exc, "") is None:
                    raise
                log.warning("delivery group %s: no snapshot at shutdown (%s); its journal is "
                            "replayed at the next start", name, exc)
            finally:
                store.close()

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
        limit = self.config.max_delivery_groups
        if len(self.groups) >= limit:
            raise PolicyViolationError(
                f"delivery group {name!r} not created: the broker has {len(self.groups)} "
                f"delivery groups, max_delivery_groups={limit} (delete unused ones: ferrymq "
                "group delete)")
        d = self.dir / name
        try:
            g = self._load_group(d)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise
        log.info("created delivery group %s", name)
        return g

    def _drop_new(self, g: DeliveryGroup) -> None:
        """Undo :meth:`_create` of a group nothing was journaled for."""
        del self.groups[g.name]
        with contextlib.suppress(OSError):
            self.stores.pop(g.name).close()
        shutil.rmtree(self.dir / g.name, ignore_errors=True)

    def _journal(self, g: DeliveryGroup, record: list[Any]) -> int:
        """Append one change to the group's journal (before applying it); the position to
        wait for.

        Raises:
            StorageFailureError: the journal had an fsync failure (restart needed).
            StorageFullError, BusyError: no space or no descriptor (with a retry-after);
                nothing was written.
        """
        store = self.stores[g.name]
        self._check_store(g, store)
        try:
            pos = store.append(record)
        except OSError as exc:
            raise self.flusher.write_error(exc, f"the delivery journal of {g.name}") from exc
        self.flusher.mark_dirty(store)
        return pos

    def _check_store(self, g: DeliveryGroup, store: GroupStore) -> None:
        if store.failed is not None:
            raise StorageFailureError(f"delivery journal of {g.name} had an fsync failure")
        self.flusher.check_writable(store)

    @contextlib.contextmanager
    def _writing(self, g: DeliveryGroup) -> Iterator[None]:
        """Around a change of ``g``: refuse it before anything changed when its journal cannot
        take writes, and hold the journal's descriptor open meanwhile (the cache cannot close
        it between two appends, so they meet no EMFILE).

        Raises:
            StorageFailureError, StorageFullError, BusyError: as :meth:`_journal`.
        """
        store = self.stores[g.name]
        self._check_store(g, store)
        journal = store.journal
        try:
            journal.hold()
        except OSError as exc:
            raise self.flusher.write_error(exc, f"the delivery journal of {g.name}") from exc
        try:
            yield
        finally:
            journal.release()

    def _shortage(self, exc: BaseException, what: str) -> BrokerError | None:
        """The retriable answer for a failure for lack of descriptors or disk space (BUSY or
        STORAGE_FULL with the retry-after: ``exc`` itself when it is one already), None for any
        other failure."""
        if flush_postponed(exc):
            return exc
        if isinstance(exc, OSError):
            return self.flusher.shortage_error(exc, what)
        return None

    def _note_short(self, err: BrokerError) -> None:
        """Time-driven work waits for descriptors or space: warn once per episode."""
        self._short_seen = True
        if self._short is None:
            self._short = err
            log.warning("delivery groups: %s; expired leases, departed members' leases and "
                        "journal records wait and are retried at every tick", err)

    def _journal_or_defer(self, g: DeliveryGroup, record: list[Any],
                          cb: Callback | None = None) -> int:
        """Journal a change already applied in memory that may come after later records (a
        finish, a DLQ floor). When no descriptor or space is there, keep it in the store's
        ``deferred`` records (journaled again at every tick) and return -1; ``cb`` is told
        once it is durable (or failed for good).

        Raises:
            StorageFailureError: the journal failed for good (``cb`` was not told).
        """
        store = self.stores[g.name]
        if store.deferred:  # keep their order
            store.deferred.append((record, cb))
            return -1
        try:
            pos = self._journal(g, record)
        except BrokerError as exc:
            if self._shortage(exc, "") is None:
                raise
            self._note_short(exc)
            store.deferred.append((record, cb))
            return -1
        if cb is not None:
            store.when_durable(pos, cb, sync=self.sync)
        return pos

    def _journal_deferred(self, g: DeliveryGroup) -> None:
        """Journal the deferred records of ``g`` (tick).

        Raises:
            BrokerError: still no descriptor or space (the rest stay deferred), or the
                journal failed for good (their waiters are told).
        """
        store = self.stores[g.name]
        while store.deferred:
            record, cb = store.deferred[0]
            try:
                pos = self._journal(g, record)
            except BrokerError as exc:
                if self._shortage(exc, "") is None:
                    failed, store.deferred = store.deferred, []
                    for _rec, c in failed:
                        if c is not None:
                            c(exc)
                raise
            store.deferred.pop(0)
            if cb is not None:
                store.when_durable(pos, cb, sync=self.sync)

    def when_durable(self, group: str, pos: int, cb: Callable[[BaseException | None], None]) -> None:
        """Run ``cb`` once journal position ``pos`` of ``group`` is durable."""
        self.stores[group].when_durable(pos, cb, sync=self.sync)

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

        ``ephemeral`` asks for a group the broker removes once it has no members (see
        :meth:`_remove_idle_ephemeral`); it is taken when the group is created, and a group
        becomes durable for good when a member heartbeats without it.

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
            if topic not in self.topics.topics:
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
        now = self._now()
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
                pos = self._journal(g, ["P", list(new_delays), new_max, new_start, orderly,
                                        new_ephemeral])
            except BaseException:
                if g0 is None:
                    self._drop_new(g)
                raise
            g.retry_delays_ms = list(new_delays)
            g.max_reconsume = new_max
            g.start_from = new_start
            g.orderly = orderly
            if g.ephemeral and not new_ephemeral:
                log.info("delivery group %s: durable now (a member joined without asking for "
                         "an ephemeral group)", name)
            g.ephemeral = new_ephemeral
        g.awaited.update(t for t in missing if not any(k[0] == t for k in g.sources))
        if not member_id:
            member_id = f"{client_id or 'consumer'}-{uuid.uuid4().hex[:12]}"
        mem = g.members.get(member_id)
        if mem is None:
            mem = g.members[member_id] = DeliveryMember(
                member_id, client_id, host, now, session_timeout_ms, list(subscriptions),
                exclusive, link,
            )
            self._idle_ephemeral.pop(name, None)
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
            self._evict(g, mid, f"consumer {mid} replaced: its connection closed")

    def _evict(self, g: DeliveryGroup, member_id: str, reason: str) -> None:
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
        mem.last_heartbeat = self._now()
        return g, mem

    def leave(self, name: str, member_id: str) -> None:
        """A member leaves: its leases go back to the group at once, without counting (or at
        the next ticks, when no descriptor or space lets them move now)."""
        g = self.group(name)
        if g.members.pop(member_id, None) is None:
            raise UnknownMemberError(f"member {member_id[:100]!r} is not in group {name!r}")
        log.info("delivery group %s: member %s left", name, member_id)
        self._release_member(g, member_id, counts=False, reason="consumer left")

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
        if g.pending_moves or g.returning or self.stores[name].deferred:
            raise BusyError(f"delivery group {name!r} is still handing back or moving "
                            "messages to its retry or dead-letter queue",
                            retry_after_ms=self.config.busy_retry_after_ms)
        dead = self._dlq_size(g)
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
        gone = self.dir / f"{name}{DELETED_SUFFIX}"
        (self.dir / name).rename(gone)
        try:
            fsync_directory(self.dir)
        except OSError as exc:  # the rename is done; a crash before it is durable undoes it
            if self._shortage(exc, "") is None:
                raise
        del self.groups[name]
        self._idle_ephemeral.pop(name, None)
        self._kept_for_dlq.discard(name)
        with contextlib.suppress(OSError):  # renamed away: its last fsync is moot
            self.stores.pop(name).close()
        g.wake()
        self._finish_delete(gone)
        log.info("delivery group %s: deleted (%d dead letters with it)", name, dead)
        return dead

    def _finish_delete(self, d: Path) -> None:
        """:meth:`_remove_deleted`, or at a later tick when descriptors or space are short."""
        try:
            self._remove_deleted(d)
        except OSError as exc:
            err = self._shortage(exc, f"remove the files of the deleted delivery group {d.name}")
            if err is None:
                raise
            self._note_short(err)
            self._unfinished_deletes.add(d)

    def _remove_deleted(self, d: Path) -> None:
        """Remove a deleted group's retry and dead-letter topics, then its directory (unless a
        group of that name exists again: its topics are its own)."""
        name = d.name[:-len(DELETED_SUFFIX)]
        if name not in self.groups:
            for topic in (RETRY_TOPIC_PREFIX + name, DLQ_TOPIC_PREFIX + name):
                if topic in self.topics.topics:
                    self.topics.delete(topic)
        shutil.rmtree(d, ignore_errors=True)
        fsync_directory(self.dir)

    def _release_member(self, g: DeliveryGroup, member_id: str, *, counts: bool, reason: str) -> None:
        """Hand the leases of a member that is gone back to the group: now, or at the next
        ticks when no descriptor or space lets them move (they stay leased meanwhile, so
        nobody else gets them). An ephemeral group left without members is removed soon."""
        g.returning.extend((ls, counts, reason) for ls in g.leases.values()
                           if ls.member == member_id)
        if g.ephemeral and not g.members:
            self._idle_ephemeral[g.name] = self._now()
        try:
            self._return_leases(g)
        except (OSError, BrokerError) as exc:
            err = self._shortage(exc, f"hand back the leases of {member_id}")
            if err is None:
                raise
            self._note_short(err)

    def _return_leases(self, g: DeliveryGroup) -> None:
        """Move the messages of ``g.returning`` on (retry queue, DLQ, or in place), oldest
        first; what cannot move now stays there.

        Raises:
            BrokerError, OSError: no descriptor or space (or a failed journal) for the next.
        """
        ret = g.returning
        if not ret:
            return
        with self._writing(g):
            while ret:
                lease, counts, reason = ret[0]
                for off in sorted(lease.offsets):
                    self._fail(g, lease.key, off, lease, counts=counts, delay_ms=0,
                               reason=reason)
                ret.popleft()

    # -- receive ------------------------------------------------------------------------------

    def receive(
        self, g: DeliveryGroup, member_id: str, subscriptions: list[tuple[str, str]],
        max_messages: int, max_bytes: int, invisible_ms: int,
    ) -> tuple[list[m.Delivery], int]:
        """Lease what is available now: due retries first, then new messages.

        Returns the deliveries and the journal position to wait for (-1: none). When a step
        meets no descriptor or space, what was leased before it is returned; nothing was.

        Raises:
            BusyError, StorageFullError: no descriptor or space, and nothing was leased (with
                a retry-after; nothing changed).
            StorageFailureError: the group's journal failed (restart needed).
        """
        out: list[m.Delivery] = []
        try:
            with self._writing(g):
                return self._receive(g, member_id, subscriptions, max_messages, max_bytes,
                                     invisible_ms, out)
        except (OSError, BrokerError) as exc:
            err = self._shortage(exc, f"receive for delivery group {g.name}")
            if err is None:
                raise
            if not out:
                raise err from exc
            return out, self.stores[g.name].journal.size  # all of it journaled

    def _receive(
        self, g: DeliveryGroup, member_id: str, subscriptions: list[tuple[str, str]],
        max_messages: int, max_bytes: int, invisible_ms: int, out: list[m.Delivery],
    ) -> tuple[list[m.Delivery], int]:
        cfg = self.config
        now = self._now()
        deadline = now + invisible_ms
        deadline_wall = self.clock.wall_ms() + invisible_ms
        room = min(max_messages, cfg.max_receive_messages,
                   cfg.max_in_flight_per_member - g.in_flight.get(member_id, 0))
        budget = min(max_bytes, cfg.max_fetch_bytes)
        pos = -1
        if room <= 0 or budget <= 0:
            return out, pos
        filters = {t: parse_tag_expression(e) for t, e in subscriptions}
        pos = self._note_tag_filters(g, subscriptions, filters)
        room, budget, p = self._receive_letters(g, member_id, filters, room, budget, deadline,
                                                deadline_wall, out)
        pos = max(pos, p)
        for topic, tags in filters.items():
            if room <= 0 or budget <= 0:
                break
            t = self.topics.topics.get(topic)
            if t is None:  # subscribed before it exists (see heartbeat)
                continue
            n = len(t.queues)
            if topic in g.awaited and all((topic, q) in g.sources for q in range(n)):
                g.awaited.discard(topic)  # every queue has its cursor now
            for i in range(n):
                if room <= 0 or budget <= 0:
                    break
                qs = t.queues[(g.rr + i) % n]
                receive_queue = self._receive_orderly if g.orderly else self._receive_queue
                taken, used, p = receive_queue(g, member_id, qs, tags, room, budget,
                                               deadline, deadline_wall, out)
                room -= taken
                budget -= used
                pos = max(pos, p)
        g.rr += 1
        return out, pos

    def _note_tag_filters(
        self, g: DeliveryGroup, subscriptions: list[tuple[str, str]],
        filters: dict[str, frozenset[str] | None],
    ) -> int:
        """Remember the tag expression this receive filters each topic with, when it is not the
        one the group used last (``message status`` tells a filtered-out message from an acked
        one by it). Returns the journal position of the change, or -1 (the usual case: a dict
        lookup per subscribed topic)."""
        pos = -1
        for topic, tags in filters.items():
            f = g.tag_filters.get(topic)
            if f is not None and f.tags == tags:
                continue
            expression = dict(subscriptions)[topic]  # as ``filters``: the last of a topic wins
            since = {q: cur.next for (t, q), cur in g.sources.items() if t == topic}
            pos = self._journal(g, ["T", topic, expression, [[q, o] for q, o in since.items()]])
            self._set_tag_filter(g, topic, expression, since)
        return pos

    def _set_tag_filter(self, g: DeliveryGroup, topic: str, expression: str,
                        since: dict[int, int]) -> None:
        try:
            tags = parse_tag_expression(expression)
        except InvalidRequestError:  # checked when it was used: not from this broker
            g.tag_filters.pop(topic, None)
            return
        g.tag_filters[topic] = TagFilter(expression, tags, since)

    def _receive_letters(
        self, g: DeliveryGroup, member_id: str, filters: dict[str, frozenset[str] | None],
        room: int, budget: int, deadline: int, deadline_wall: int, out: list[m.Delivery],
    ) -> tuple[int, int, int]:
        """Lease visible retry letters of the subscribed topics, oldest first (each in its own
        delivery: letters of one batch may differ in topic and attempt count)."""
        rc = g.retry
        qs = self._internal_queue(g.retry_topic, create=False)
        pos = -1
        if qs is None or (not rc.ready and rc.next >= qs.visible_end):
            return room, budget, pos
        held = rc.held
        cands: list[int] = []
        for off, letter in rc.ready.items():
            if len(cands) >= room:
                break
            if letter.topic in filters and off not in held:
                cands.append(off)
        if len(cands) < room:
            cands.extend(self._scan_retry(g, qs, filters, room - len(cands)))
        if not cands:
            return room, budget, pos
        lg = qs.log
        taken: set[int] = set()
        for offs, batch in self._read_offsets(lg, cands, budget, set(cands)):
            off = offs[0]
            if off not in rc.ready:
                continue
            letter = rc.ready[off]
            lease = Lease(self._next_lease, member_id, (g.retry_topic, 0), deadline,
                          letter.reconsume)
            pos = self._journal(g, ["L", g.retry_topic, 0, lease.lease_id, member_id,
                                    deadline_wall, letter.reconsume, [[off, 1]]])
            self._next_lease += 1
            rc.lease(off, lease)
            g.add_lease(lease, 1)
            taken.add(off)
            out.append((g.retry_topic, 0, qs.topic_id, lease.lease_id, letter.reconsume, off, off,
                        batch))
            room -= 1
            budget -= len(batch)
        gone = [o for o in cands if o not in taken and o < lg.start_offset]
        if gone:  # deleted by retention before anyone got them
            pos = self._journal(g, ["A", g.retry_topic, 0, _runs(gone)])
            for o in gone:
                rc.finish(o)
            rc.advance_floor()
        return room, budget, pos

    def _scan_retry(
        self, g: DeliveryGroup, qs: QueueState, filters: Container[str], want: int,
    ) -> list[int]:
        """Read visible letters from the retry cursor's scan position into ``ready`` until
        ``want`` of them belong to a topic in ``filters`` or ``max_retry_loaded`` are ready;
        return the offsets of those ``want``. Scheduled letters (not due yet) are skipped: the
        scheduler appends their copies when they are due."""
        rc = g.retry
        lg = qs.log
        if rc.next < lg.start_offset:  # retention deleted letters nobody got
            rc.skip_to(lg.start_offset)
        end = qs.visible_end
        limit = self.config.max_retry_loaded
        wall = self.clock.wall_ms()
        found: list[int] = []
        while rc.next < end and len(rc.ready) < limit and len(found) < want:
            try:
                data = lg.read(rc.next, RETRY_READ_BYTES, upto_offset=end)
            except BrokerError as exc:
                log.error("retry queue of %s: cannot read offset %d: %s", g.name, rc.next, exc)
                break
            if not data:
                break
            before = rc.next
            mv = memoryview(data)
            for p0, h in iter_batches(mv):
                if h.last_offset < rc.next:
                    continue
                if h.attributes & ATTR_SCHEDULED:  # a letter not due yet: the scheduler's
                    rc.passed(rc.next, h.last_offset, plain=False)
                    continue
                if len(rc.ready) >= limit or len(found) >= want:
                    break
                try:
                    recs = list(iter_raw_records(mv, p0, h))
                except CorruptRecordError as exc:
                    log.error("retry queue of %s: %s; skipped", g.name, exc)
                    rc.passed(rc.next, h.last_offset, plain=True)
                    continue
                for rec in recs:
                    o = rec[0]
                    if o < rc.next:
                        continue
                    if len(rc.ready) >= limit or len(found) >= want:
                        break
                    rc.passed(o, o, plain=True)
                    if o in rc.done:  # finished before a restart
                        rc.done.discard(o)
                        continue
                    if o in rc.leased:  # leased before a restart
                        rc.track(o)
                        continue
                    r = stored_record(mv, rec)
                    try:
                        letter = read_letter(r)
                    except CorruptRecordError as exc:
                        log.error("retry queue of %s: %s; skipped", g.name, exc)
                        continue
                    until = self._held_until(r, letter, wall)
                    rc.add(o, letter, until)
                    if letter.topic in filters and until is None:
                        found.append(o)
            if rc.next == before:
                break
        rc.advance_floor()
        return found

    def _retry_waiting(self, g: DeliveryGroup) -> int:
        """Retry letters waiting: pending in the scheduler, read by the cursor and not leased,
        and visible ones the cursor has not read yet (counted incrementally, see
        RETRY_COUNT_BYTES)."""
        rc = g.retry
        qs = self._internal_queue(g.retry_topic, create=False)
        if qs is None:
            return len(rc.ready)
        lg = qs.log
        if rc.next < lg.start_offset:
            rc.skip_to(lg.start_offset)
        if rc.counted < rc.next:
            rc.counted, rc.ahead = rc.next, 0
        pos = rc.counted
        end = lg.end_offset
        budget = RETRY_COUNT_BYTES
        while pos < end and budget > 0:
            try:
                data = lg.read(pos, 1 << 20)
            except BrokerError:
                break
            if not data:
                break
            budget -= len(data)
            before = pos
            for _p0, h in iter_batches(data):  # headers only
                if h.last_offset < pos:
                    continue
                if not h.attributes & ATTR_SCHEDULED:
                    rc.ahead += h.last_offset - max(h.base_offset, pos) + 1
                pos = h.last_offset + 1
            if pos == before:
                break
        rc.counted = pos
        unread = rc.ahead - len(rc.done) - sum(1 for o in rc.leased if o >= rc.next)
        scheduled, _ = self.scheduler.topic_stats(qs.topic_id)
        return scheduled + len(rc.ready) + max(0, unread)

    def wakeups(
        self, g: DeliveryGroup, subscriptions: Iterable[tuple[str, str]]
    ) -> list[set[asyncio.Future[None]]]:
        """What a long-polling RECEIVE of ``g`` waits on: the group itself (leases handed
        back, orderly keys ready), its retry queue (a letter, or the copy of a due scheduled
        letter, became visible) and the subscribed queues."""
        sets = [g.waiters]
        rt = self.topics.topics.get(g.retry_topic)
        if rt is not None:
            sets.append(rt.queues[0].waiters)
        for topic, _ in subscriptions:
            t = self.topics.topics.get(topic)
            if t is not None:
                sets.extend(qs.waiters for qs in t.queues)
        return sets

    def _receive_queue(
        self, g: DeliveryGroup, member_id: str, qs: QueueState, tags: frozenset[str] | None,
        room: int, budget: int, deadline: int, deadline_wall: int, out: list[m.Delivery],
    ) -> tuple[int, int, int]:
        key = (qs.topic, qs.queue)
        lg = qs.log
        cur = g.sources.get(key)
        if cur is None:  # journaled, so a restart does not move a "latest" start
            start = self._start(g, qs)
            self._journal(g, ["N", qs.topic, qs.queue, start])
            cur = g.sources[key] = SourceCursor(qs.topic, qs.queue, start)
        if cur.next < lg.start_offset:  # retention deleted what this group never got
            cur.skip_to(lg.start_offset)
        end = qs.lso  # transactions: nothing past the first open one (read_committed)
        if cur.next >= end:
            return 0, 0, -1
        start = cur.next
        txf = _txn_filter(lg, start, end)
        parts: list[bytes | memoryview] = []
        offsets: list[int] = []
        new_next = start
        used = 0
        chunk = min(budget, RECEIVE_FIRST_READ_BYTES)
        gaps = tags is not None  # leased offsets are not contiguous
        while new_next < end and len(offsets) < room and used < budget:
            # read what the lease can use: small first, growing, not the whole byte budget
            data = lg.read(new_next, chunk, upto_offset=end)
            if not data:
                break
            before = new_next
            mv = memoryview(data)
            for p0, h in iter_batches(mv):
                if room - len(offsets) <= 0 or used >= budget:
                    break
                first = max(h.base_offset, new_next)
                last = h.last_offset
                # the scheduler appends a copy when due; markers and aborted data are skipped
                if h.attributes & _SKIP_BITS and _skipped(h, txf):
                    new_next = max(new_next, last + 1)
                    gaps = True
                    continue
                if tags is None:
                    take = min(last - first + 1, room - len(offsets))
                    offsets.extend(range(first, first + take))
                    parts.append(mv[p0 : p0 + h.size])
                    used += h.size
                    new_next = first + take
                else:
                    keep: list[tuple[int, int, int, int, int, int, int, int]] = []
                    stop = last + 1
                    for rec in iter_raw_records(mv, p0, h):
                        if rec[0] < first:
                            continue
                        t0, t1 = rec[2], rec[3]
                        if t1 > t0 and str(mv[t0:t1], "utf-8", "replace") in tags:
                            if len(offsets) + len(keep) >= room:
                                stop = rec[0]
                                break
                            keep.append(rec)
                    if keep:
                        offsets.extend(r[0] for r in keep)
                        fb = filter_batch(mv, p0, h, keep)
                        parts.append(fb)
                        used += len(fb)
                    new_next = stop
            if new_next == before:
                break
            chunk = min(max(budget - used, 1), chunk * 4)
        if not offsets:
            pos = self._journal(g, ["N", qs.topic, qs.queue, new_next])
            cur.skip_to(new_next)
            return 0, 0, pos
        lease = Lease(self._next_lease, member_id, key, deadline, 0)
        runs = [[offsets[0], len(offsets)]] if not gaps else _runs(offsets)
        pos = self._journal(g, ["L", qs.topic, qs.queue, lease.lease_id, member_id, deadline_wall,
                                0, runs])
        self._next_lease += 1
        cur.lease(offsets, lease)
        g.add_lease(lease, len(offsets))
        batches = b"".join(parts)
        out.append((qs.topic, qs.queue, qs.topic_id, lease.lease_id, 0, offsets[0], offsets[-1],
                    batches))
        if new_next > offsets[-1] + 1:  # (when this cannot be journaled, it is scanned again)
            pos = self._journal(g, ["N", qs.topic, qs.queue, new_next])
        cur.skip_to(new_next)
        return len(offsets), len(batches), pos

    def _receive_orderly(
        self, g: DeliveryGroup, member_id: str, qs: QueueState, tags: frozenset[str] | None,
        room: int, budget: int, deadline: int, deadline_wall: int, out: list[m.Delivery],
    ) -> tuple[int, int, int]:
        """Lease heads of sharding keys from one queue of an orderly group (see orderly.py):
        ready ones first (failed ones whose backoff ended, next messages of finished keys), then
        new ones from the scan position. A read or a journal write that fails (no descriptor,
        no space) puts back what the call took: the scan position and the ready heads."""
        key = (qs.topic, qs.queue)
        lg = qs.log
        pos = -1
        cur = g.sources.get(key)
        if cur is None:
            first = self._start(g, qs)
            pos = self._journal(g, ["N", qs.topic, qs.queue, first])
            cur = g.sources[key] = OrderlyCursor(qs.topic, qs.queue, first)
        assert isinstance(cur, OrderlyCursor)
        if cur.next < lg.start_offset:
            cur.skip_to(lg.start_offset)
        taken: dict[int, list[tuple[list[int], bytes]]] = {}  # reconsume -> (offsets, batch)
        gone: list[int] = []
        examined: list[int] = []  # what the scan made pending (undone if it is not journaled)
        start = cur.next
        ready = cur.take_ready(self._now())
        try:
            n = self._orderly_scan(cur, lg, qs.lso, tags, ready, room, budget, taken, gone,
                                   examined)
            if cur.next > start:
                pos = self._journal(g, ["N", qs.topic, qs.queue, cur.next])
        except BaseException:
            cur.rewind(start, examined)
            cur.unready(ready)
            raise
        if gone:  # filtered out or deleted: finished for the group, without an ack time
            pos = max(pos, self._journal_or_defer(g, ["A", qs.topic, qs.queue, _runs(gone)]))
        total = 0
        groups = [(r, parts) for r, parts in taken.items() if parts]
        for i, (reconsume, parts) in enumerate(groups):
            lease = Lease(self._next_lease, member_id, key, deadline, reconsume)
            offsets = [o for offs, _ in parts for o in offs]
            try:
                pos = self._journal(g, ["L", qs.topic, qs.queue, lease.lease_id, member_id,
                                        deadline_wall, reconsume, _runs(offsets)])
            except BaseException:  # these and the rest stay pending, ready again
                cur.unready(o for _, rest in groups[i:] for offs, _ in rest for o in offs)
                raise
            self._next_lease += 1
            cur.lease(offsets, lease)
            g.add_lease(lease, len(offsets))
            batches = b"".join(part for _, part in parts)
            out.append((qs.topic, qs.queue, qs.topic_id, lease.lease_id, reconsume, min(offsets),
                        max(offsets), batches))
            total += len(batches)
        cur.advance_floor()
        return n, total, pos

    def _orderly_scan(
        self, cur: OrderlyCursor, lg: Log, end: int, tags: frozenset[str] | None,
        ready: list[int], room: int, budget: int,
        taken: dict[int, list[tuple[list[int], bytes]]], gone: list[int], examined: list[int],
    ) -> int:
        """The reading part of :meth:`_receive_orderly`: the ready heads' records (into
        ``taken`` by attempt count; those past the byte budget back to ready), then new
        messages from the scan position up to ``end`` (every one examined is added to
        ``examined``; the deliverable ones to ``taken[0]``, filtered ones to ``gone``).
        Returns how many messages it took.

        Raises:
            OSError: a read met no descriptor (the caller undoes the scan).
        """
        n = used = 0
        if ready:
            if len(ready) > room:
                cur.unready(ready[room:])
                del ready[room:]
            failures = cur.failures
            got: set[int] = set()
            for offs, part in self._read_offsets(lg, ready, budget, failures):
                f = failures.get(offs[0])  # a redelivery gets its own lease (its own count)
                taken.setdefault(f.reconsume if f is not None else 0, []).append((offs, part))
                got.update(offs)
                used += len(part)
            n = len(got)
            for off in ready:
                if off not in got:
                    if off < lg.start_offset:  # deleted by retention
                        cur.finish(off)
                        gone.append(off)
                    else:  # past the byte budget
                        cur.unready([off])
            ready[:] = [o for o in ready if o in got]  # the rest were dealt with here
        limit = self.config.max_orderly_held
        txf = _txn_filter(lg, cur.next, end)
        chunk = min(budget, RECEIVE_FIRST_READ_BYTES)
        fresh = taken.setdefault(0, [])
        stop = False
        while not stop and cur.next < end and n < room and used < budget \
                and cur.held_count < limit:
            data = lg.read(cur.next, chunk, upto_offset=end)
            if not data:
                break
            before = cur.next
            mv = memoryview(data)
            for p0, h in iter_batches(mv):
                if h.attributes & _SKIP_BITS and _skipped(h, txf):  # scheduled, marker, aborted
                    if h.last_offset >= cur.next:
                        gone.extend(range(max(h.base_offset, cur.next), h.last_offset + 1))
                        cur.next = h.last_offset + 1
                    continue
                keep: list[tuple[int, int, int, int, int, int, int, int]] = []
                for rec in iter_raw_records(mv, p0, h):
                    o = rec[0]
                    if o < cur.next:
                        continue
                    if n >= room or used >= budget or cur.held_count >= limit:
                        stop = True
                        break
                    t0, t1, s1 = rec[2], rec[3], rec[4]
                    if tags is not None and not (
                            t1 > t0 and str(mv[t0:t1], "utf-8", "replace") in tags):
                        cur.next = o + 1
                        gone.append(o)
                        continue
                    examined.append(o)
                    if cur.examine(o, str(mv[t1:s1], "utf-8", "replace") if s1 > t1 else ""):
                        keep.append(rec)
                        n += 1
                if keep:
                    fb = filter_batch(mv, p0, h, keep)
                    fresh.append(([r[0] for r in keep], fb))
                    used += len(fb)
                if stop:
                    break
            if cur.next == before:
                break
            chunk = min(max(budget - used, 1), chunk * 4)
        return n

    def _read_offsets(
        self, lg: Log, offsets: list[int], budget: int, alone: Container[int],
    ) -> list[tuple[list[int], bytes]]:
        """The records at ``offsets`` (rising) as batches, up to ``budget`` bytes: the wanted
        records of one stored batch share one filtered batch, except those in ``alone``, which
        get one each. Near offsets are read in one pass (clusters split at gaps of
        ORDERLY_READ_GAP offsets), so a thousand heads cost a few reads, not a thousand."""
        out: list[tuple[list[int], bytes]] = []
        want = set(offsets)
        used = 0
        i = 0
        while i < len(offsets) and used < budget:
            j = i
            while j + 1 < len(offsets) and offsets[j + 1] - offsets[j] <= ORDERLY_READ_GAP:
                j += 1
            first, last = offsets[i], offsets[j]
            i = j + 1
            for mv, p0, h, recs in _batches_between(lg, first, last):
                keep = [r for r in recs if r[0] in want]
                shared = [r for r in keep if r[0] not in alone]
                if shared:
                    b = filter_batch(mv, p0, h, shared)
                    out.append(([r[0] for r in shared], b))
                    used += len(b)
                for r in keep:
                    if r[0] in alone:
                        b = filter_batch(mv, p0, h, [r])
                        out.append(([r[0]], b))
                        used += len(b)
                if used >= budget:
                    break
        return out

    def _pending_keys(self, cur: OrderlyCursor) -> dict[int, str | None]:
        """After a restart: the sharding key of each pending offset of ``cur`` (missing: gone)."""
        out: dict[int, str | None] = {}
        t = self.topics.topics.get(cur.topic)
        if t is None or cur.queue >= len(t.queues) or not cur.pending:
            return out
        want = cur.pending
        for mv, _p0, _h, recs in _batches_between(t.queues[cur.queue].log, min(want), max(want)):
            for rec in recs:
                if rec[0] in want:
                    t1, s1 = rec[3], rec[4]
                    out[rec[0]] = str(mv[t1:s1], "utf-8", "replace") if s1 > t1 else ""
        return out

    def _start(self, g: DeliveryGroup, qs: QueueState) -> int:
        """Where a new cursor of ``g`` starts on ``qs``."""
        if g.start_from == m.OffsetSpec.EARLIEST:
            return qs.log.start_offset
        if g.start_from == m.OffsetSpec.LATEST:
            # a topic created after the group subscribed to it: all of it is news
            return qs.log.start_offset if qs.topic in g.awaited else qs.lso
        return min(qs.log.offset_for_time(g.start_from), qs.lso)

    # -- ack, nack, change invisible ----------------------------------------------------------

    def _lookup(
        self, g: DeliveryGroup, topic: str, queue: int, offset: int, lease_id: int
    ) -> Lease | None:
        if topic == g.retry_topic:
            lease = g.retry.leased.get(offset)
        else:
            cur = g.sources.get((topic, queue))
            lease = cur.leased.get(offset) if cur is not None else None
        if lease is None or lease.lease_id != lease_id:
            return None
        return lease

    def _finish(self, g: DeliveryGroup, key: tuple[str, int], offset: int) -> None:
        cursor = g.retry if key[0] == g.retry_topic else g.sources[key]
        lease = cursor.finish(offset)
        if lease is not None:
            g.drop_from_lease(lease)
        if isinstance(cursor, OrderlyCursor) and cursor.ready:
            g.wake()  # the key's next message can go

    def _advance(self, g: DeliveryGroup, keys: Iterable[tuple[str, int]]) -> None:
        for key in keys:
            if key[0] == g.retry_topic:
                g.retry.advance_floor()
            else:
                g.sources[key].advance_floor()

    def ack(
        self, g: DeliveryGroup, entries: list[m.AckEntry]
    ) -> tuple[list[tuple[str, int, int, int]], int]:
        """Finish leased messages; returns the refused ones and the journal position to wait
        for. Each entry is journaled, then applied. When one meets no descriptor or space, the
        request is refused if nothing was acked yet (nothing changed); else that entry's and
        the later entries' offsets come back with the retriable code, the earlier ones are
        acked.

        Raises:
            BusyError, StorageFullError: no descriptor or space (nothing changed).
            StorageFailureError: the group's journal failed.
        """
        failed: list[tuple[str, int, int, int]] = []
        pos = -1
        with self._writing(g):
            for i, (topic, queue, lease_id, offsets) in enumerate(entries):
                key = (topic, queue)
                cursor: SourceCursor | OrderlyCursor | RetryCursor | None = (
                    g.retry if topic == g.retry_topic else g.sources.get(key)
                )
                if cursor is None:
                    failed.extend((topic, queue, o, _BAD_RECEIPT) for o in offsets)
                    continue
                leased = cursor.leased
                done: list[int] = []
                held: Lease | None = None
                letters = g.retry.letters if cursor is g.retry else None
                origins: list[list[Any]] = []
                for o in offsets:
                    lease = leased.get(o)
                    if lease is None or lease.lease_id != lease_id:
                        failed.append((topic, queue, o, _BAD_RECEIPT))
                        continue
                    if letters is not None and (letter := letters.get(o)) is not None:
                        origins.append([letter.topic, letter.queue, letter.offset])
                    done.append(o)
                    held = lease
                if held is None:
                    continue
                rec: list[Any] = ["A", topic, queue, _runs(done), self.clock.wall_ms()]
                if letters is not None:
                    rec.append(origins)
                try:
                    p = self._journal(g, rec)
                except BrokerError as exc:
                    if pos < 0 or self._shortage(exc, "") is None:
                        raise
                    code = int(exc.code)
                    failed.extend((topic, queue, o, code) for o in done)
                    failed.extend((t, q, o, code) for t, q, _l, offs in entries[i + 1:]
                                  for o in offs)
                    break
                pos = p
                for o in done:
                    cursor.finish(o)
                g.drop_from_lease(held, len(done))
                if isinstance(cursor, OrderlyCursor) and cursor.ready:
                    g.wake()  # next messages of these keys can go
                self._remember_acks(g, rec)
                cursor.advance_floor()
        return failed, pos

    def _remember_acks(self, g: DeliveryGroup, rec: list[Any]) -> None:
        """Keep when messages were acknowledged (an "A" record of an ack carries the time; a
        retry letter's carries the original positions)."""
        limit = self.config.delivery_ack_history
        if len(rec) == 6:
            for topic, queue, offset in rec[5]:
                g.record_acks(topic, queue, [[offset, 1]], rec[4], limit)
        else:
            g.record_acks(rec[1], rec[2], rec[3], rec[4], limit)

    def nack(self, g: DeliveryGroup, entries: list[m.NackEntry]
             ) -> tuple[list[tuple[int, int]], list[asyncio.Future[None]]]:
        """Give messages back for a later attempt (or the dead-letter queue). Returns the
        results and, in sync mode, what to wait for before answering: each nacked message's
        new state (its retry copy and the journal record that finishes the original) durable,
        so that a nack answered survives a crash as an ack does.

        When a message cannot be moved (no descriptor, no space) it stays leased: the request
        is refused if nothing was nacked yet, else that entry and the later ones get the
        retriable code.

        Raises:
            InvalidRequestError: a delay above MAX_RETRY_DELAY_MS (nothing done).
            BusyError, StorageFullError: no descriptor or space (nothing changed).
        """
        if any(e[4] > MAX_RETRY_DELAY_MS for e in entries):
            raise InvalidRequestError(f"nack delay must be at most {MAX_RETRY_DELAY_MS} ms")
        results: list[tuple[int, int]] = []
        waits: list[asyncio.Future[None]] = []
        with self._writing(g):
            for i, (topic, queue, offset, lease_id, delay_ms, reason, counts) in \
                    enumerate(entries):
                lease = self._lookup(g, topic, queue, offset, lease_id)
                if lease is None:
                    results.append((_BAD_RECEIPT, -1))
                    continue
                fut: asyncio.Future[None] | None = None
                if self.sync:
                    fut = asyncio.get_running_loop().create_future()
                try:
                    self._fail(g, lease.key, offset, lease, counts=counts, delay_ms=delay_ms,
                               reason=reason or "consumer asked to retry later",
                               on_durable=None if fut is None
                               else functools.partial(_settle_future, fut))
                except (OSError, BrokerError) as exc:
                    err = self._shortage(exc, f"nack in delivery group {g.name}")
                    if err is None:
                        raise
                    if all(code != _OK for code, _ in results):
                        raise err from exc
                    results.extend((int(err.code), -1) for _ in entries[i:])
                    break
                if fut is not None:
                    waits.append(fut)
                results.append((_OK, -1))
        return results, waits

    def change_invisible(
        self, g: DeliveryGroup, member_id: str, entries: list[tuple[str, int, int, int, int]]
    ) -> tuple[list[tuple[int, int]], int]:
        """New leases (new receipts) ending ``invisible_ms`` from now: one per old lease and
        time, each journaled before it replaces the old one. When one meets no descriptor or
        space, the request is refused if nothing changed yet; else its entries and the later
        ones get the retriable code (they keep their old leases).

        Raises:
            InvalidRequestError: an invisible time out of range (nothing done).
            BusyError, StorageFullError: no descriptor or space (nothing changed).
        """
        for entry in entries:
            self.check_invisible(entry[4])
        results: list[tuple[int, int]] = [(_BAD_RECEIPT, -1)] * len(entries)
        now = self._now()
        wall = self.clock.wall_ms()
        pos = -1
        plan: dict[tuple[tuple[str, int], int, int], list[tuple[int, Lease, int]]] = {}
        for i, (topic, queue, offset, lease_id, invisible_ms) in enumerate(entries):
            old = self._lookup(g, topic, queue, offset, lease_id)
            if old is not None:
                plan.setdefault((old.key, lease_id, invisible_ms), []).append((i, old, offset))
        with self._writing(g):
            steps = list(plan.items())
            for j, ((key, _, inv), items) in enumerate(steps):
                lease = Lease(self._next_lease, member_id, key, now + inv, items[0][1].reconsume)
                try:
                    p = self._journal(g, ["C", key[0], key[1], lease.lease_id, lease.member,
                                          wall + inv, lease.reconsume,
                                          _runs(o for _, _, o in items)])
                except BrokerError as exc:
                    if pos < 0 or self._shortage(exc, "") is None:
                        raise
                    for _k, rest in steps[j:]:
                        for i, _old, _o in rest:
                            results[i] = (int(exc.code), -1)
                    break
                pos = p
                self._next_lease += 1
                g.add_lease(lease, 0)
                cursor = g.retry if key[0] == g.retry_topic else g.sources[key]
                for i, old, offset in items:
                    old.offsets.discard(offset)
                    g.drop_from_lease(old)
                    lease.offsets.add(offset)
                    g.in_flight[member_id] = g.in_flight.get(member_id, 0) + 1
                    cursor.leased[offset] = lease
                    results[i] = (_OK, lease.lease_id)
        return results, pos

    def check_invisible(self, invisible_ms: int) -> None:
        """Raise InvalidRequestError unless ``invisible_ms`` is an acceptable lease."""
        if not 0 < invisible_ms <= self.config.max_invisible_ms:
            raise InvalidRequestError(
                f"invisible time must be 1..{self.config.max_invisible_ms} ms, not {invisible_ms}"
            )

    # -- moves to the retry and dead-letter queues --------------------------------------------

    def _fail_in_place(
        self, g: DeliveryGroup, cur: OrderlyCursor, offset: int, reconsume: int, delay_ms: int,
        reason: str,
    ) -> int:
        """Orderly: the head stays the head of its key and is delivered again after a short
        fixed backoff (``orderly_retry_ms``, or the nack's own delay)."""
        if delay_ms < 0:
            delay_ms = self.config.orderly_retry_ms
        now = self._now()
        wall = self.clock.wall_ms()
        old = cur.failures.get(offset)
        f = Failure(reconsume, now + delay_ms, old.since_wall if old is not None else wall,
                    reason[:MAX_REASON_CHARS])
        pos = self._journal(g, ["F", cur.topic, cur.queue, offset, reconsume, wall + delay_ms,
                                f.since_wall, f.reason])
        lease = cur.fail(offset, f, now)
        if lease is not None:
            g.drop_from_lease(lease)
        if delay_ms == 0:
            g.wake()
        return pos

    def skip(self, name: str, msg_id: str) -> None:
        """Send a pending message of an orderly group to its dead-letter queue on purpose, so
        that its sharding key moves on (``ferrymq group skip``).

        Raises:
            InvalidRequestError: not a message id, or not a pending head of the group.
            UnknownGroupError, UnknownTopicError.
        """
        g = self.group(name)
        topic, queue, offset = self._locate(msg_id)
        cur = g.sources.get((topic, queue))
        if not isinstance(cur, OrderlyCursor) or offset not in cur.pending:
            raise InvalidRequestError(
                f"message {msg_id} is not pending in orderly group {name!r} (skip works on "
                "messages an orderly group has reached and not finished)")
        k = cur.key_of.get(offset, "")
        if k and cur.heads.get(k) != offset:
            raise InvalidRequestError(
                f"message {msg_id} waits behind message {cur.heads[k]} of its key {k!r}; "
                "skip the first one")
        f = cur.failures.get(offset)
        lease = cur.leased.get(offset) or Lease(0, "", (topic, queue), 0,
                                                f.reconsume if f is not None else 0)
        with self._writing(g):
            self._fail(g, (topic, queue), offset, lease, counts=False, delay_ms=0,
                       reason="skipped on purpose (ferrymq group skip)"
                       + (f"; last failure: {f.reason}" if f is not None else ""), dead=True)

    def _internal_queue(self, name: str, *, create: bool) -> QueueState | None:
        t = self.topics.topics.get(name)
        if t is None:
            if not create:
                return None
            t = self.topics.create(name, 1, {}, self.clock.wall_ms(), internal_ok=True)
        return t.queues[0]

    def _retry_queue(self, g: DeliveryGroup) -> QueueState:
        """The group's retry queue, created on first use."""
        qs = self._internal_queue(g.retry_topic, create=False)
        if qs is None:
            qs = self._internal_queue(g.retry_topic, create=True)
            assert qs is not None
            g.wake()  # long polls that started before it existed wait on it from now on
        return qs

    def _read_record(
        self, g: DeliveryGroup, key: tuple[str, int], offset: int
    ) -> StoredRecord | None:
        try:
            if key[0] == g.retry_topic:
                qs = self._internal_queue(key[0], create=False)
                if qs is None:
                    return None
            else:
                qs = self.topics.queue(*key)
            data = qs.log.read(offset, 1)
        except BrokerError:
            return None
        for r in iter_stored(data, offset):
            return r if r.offset == offset else None
        return None

    def _fail(
        self, g: DeliveryGroup, key: tuple[str, int], offset: int, lease: Lease, *,
        counts: bool, delay_ms: int, reason: str, dead: bool = False,
        on_durable: Callback | None = None,
    ) -> None:
        """A delivery failed (or is handed back): move the message on, then finish it here.

        An orderly group keeps the message where it is (retried in place) unless it is dead;
        ``dead`` sends it to the dead-letter queue whatever its count. ``on_durable`` (sync
        mode) is told when the message's new state is durable.

        The copy is written before anything changes: when it cannot be (no descriptor to read
        the message or to write the copy, no space), this raises and the message is still
        leased as it was, so no letter is written twice and nobody else gets it meanwhile.

        Raises:
            BrokerError: the journal or the target queue refuses writes (BUSY or STORAGE_FULL
                with a retry-after, STORAGE_ERROR).
            OSError: no descriptor or no space to read the message or write its copy.
        """
        reconsume = lease.reconsume + (1 if counts else 0)
        cur = g.sources.get(key)
        if isinstance(cur, OrderlyCursor) and not dead and reconsume <= g.max_reconsume:
            pos = self._fail_in_place(g, cur, offset, reconsume, delay_ms, reason)
            if on_durable is not None:
                self.when_durable(g.name, pos, on_durable)
            return
        record = self._read_record(g, key, offset)
        if record is None:  # deleted by retention (or the topic was deleted): nothing to move
            pos = self._journal(g, ["A", key[0], key[1], [[offset, 1]]])
            log.warning("delivery group %s: %s/%d@%d is gone; dropped from the group", g.name,
                        key[0], key[1], offset)
            self._finish(g, key, offset)
            self._advance(g, [key])
            if on_durable is not None:
                self.when_durable(g.name, pos, on_durable)
            return
        if key[0] == g.retry_topic:
            try:
                origin = read_letter(record)
            except CorruptRecordError:
                origin = Letter(key[0], key[1], offset, "", 0)
        else:
            t = self.topics.get(key[0])
            origin = Letter(key[0], key[1], offset, encode_msg_id(t.topic_id, key[1], offset), 0)
        wall = self.clock.wall_ms()
        if not dead and reconsume > g.max_reconsume:
            dead = True
            reason = f"{reason} (failed {reconsume} times, max_reconsume {g.max_reconsume})"
        if dead:
            target = g.dlq_topic
            due_wall = wall
        else:
            if delay_ms < 0:
                ladder = g.retry_delays_ms
                delay_ms = ladder[min(max(reconsume - 1, 0), len(ladder) - 1)]
            target = g.retry_topic
            due_wall = wall + delay_ms
        letter = origin._replace(reconsume=reconsume, due_wall=due_wall, reason=reason,
                                 dead_wall=wall if dead else -1)
        scheduled = not dead and due_wall > wall  # else visible at once
        batch = make_letter(record, letter, deliver_at=due_wall if scheduled else None)
        qs = self._retry_queue(g) if not dead else self._internal_queue(target, create=True)
        assert qs is not None
        self.flusher.check_writable(qs)
        res = qs.log.append(batch, now_ms=wall)  # OSError: nothing stored, nothing changed
        # the copy is written: the original is finished here (journaled once the copy is
        # durable: a crash in between delivers the message twice, never zero times)
        self._finish(g, key, offset)
        if scheduled and not res.duplicate:  # the scheduler makes a copy visible when due
            self.scheduler.on_append(qs, batch, res.base_offset, res.append_time_ms)
        self.flusher.mark_dirty(qs)
        if not self.sync:
            qs.advance(qs.log.end_offset)
        g.pending_moves += 1
        g.moving[origin.msg_id] = ("DEAD" if dead else "RETRYING", letter)
        end = res.last_offset + 1

        def moved(exc: BaseException | None) -> None:
            if flush_postponed(exc) and qs not in self.flusher.failed:
                qs.wait_durable(end, moved)  # durable once the flusher wrote its tail again
                return
            g.pending_moves -= 1
            g.moving.pop(origin.msg_id, None)
            if exc is not None:
                log.error("delivery group %s: move to %s failed: %s", g.name, target, exc)
                if on_durable is not None:
                    on_durable(exc)
                return
            if self.groups.get(g.name) is not g:  # deleted meanwhile
                if on_durable is not None:
                    on_durable(None)
                return
            try:
                self._journal_or_defer(g, ["A", key[0], key[1], [[offset, 1]]], on_durable)
            except BrokerError as e:
                log.error("delivery group %s: %s", g.name, e)
                if on_durable is not None:
                    on_durable(e)
            self._advance(g, [key])

        if self.sync:
            qs.wait_durable(end, moved)
        else:
            moved(None)

    # -- time passes ---------------------------------------------------------------------------

    def tick(self) -> None:
        """Expire leases, evict silent members, hand back departed members' leases, journal
        deferred records, wake receivers of due orderly retries, remove ephemeral groups left
        without members, compact. (Receivers of retry letters are woken by the retry queue:
        see :meth:`wakeups`.) Work that meets no descriptor or space waits for the next tick
        (one warning per episode, see the module docstring)."""
        now = self._now()
        self._short_seen = False
        for g in list(self.groups.values()):
            if not (g.members or g.expiry or g.returning or g.retry.held
                    or self.stores[g.name].deferred):
                continue  # idle: nothing can be due
            try:
                self._tick_group(g, now)
            except (OSError, BrokerError) as exc:
                err = exc if isinstance(exc, StorageFailureError) else self._shortage(
                    exc, f"serve delivery group {g.name}")
                if err is None:
                    raise
                self._note_short(err)
        if self._idle_ephemeral:
            self._remove_idle_ephemeral(now)
        for d in list(self._unfinished_deletes):
            self._unfinished_deletes.discard(d)
            self._finish_delete(d)
        self.compact()
        if self._short is not None and not self._short_seen:
            log.warning("delivery groups: the work that waited (%s) is done", self._short)
            self._short = None

    def _tick_group(self, g: DeliveryGroup, now: int) -> None:
        """One group's part of :meth:`tick`.

        Raises:
            BrokerError, OSError: no descriptor or space (or a failed journal) for what was
                due; it stays due.
        """
        if self.stores[g.name].deferred:
            self._journal_deferred(g)
        for mid, mem in list(g.members.items()):
            if now - mem.last_heartbeat > mem.session_timeout_ms:
                self._evict(g, mid, f"consumer {mid} evicted: no heartbeat for "
                                    f"{mem.session_timeout_ms} ms")
        if g.returning:
            self._return_leases(g)
        exp = g.expiry
        if exp and exp[0][0] <= now:
            with self._writing(g):
                while exp and exp[0][0] <= now:
                    deadline, lease_id = exp[0]
                    lease = g.leases.get(lease_id)
                    if lease is not None and lease.deadline == deadline:
                        for off in sorted(lease.offsets):
                            self._fail(g, lease.key, off, lease, counts=True, delay_ms=0,
                                       reason="lease expired before an ack")
                    heapq.heappop(exp)  # only once all of it moved: else tried again
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

    def _remove_idle_ephemeral(self, now: int) -> None:
        """Remove the ephemeral groups whose last member left or was evicted (or that got no
        member within ``max_session_timeout_ms`` of a broker start), as :meth:`delete` does,
        once nothing of theirs is moving. One with dead letters is kept (they are not dropped
        silently: see docs/delivery.md) and looked at again every DLQ_RECHECK_MS."""
        for name, when in list(self._idle_ephemeral.items()):
            if when > now:
                continue
            g = self.groups.get(name)
            if g is None or g.members or not g.ephemeral:
                del self._idle_ephemeral[name]
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
                                self._dlq_size(g), g.dlq_topic, name)
                self._idle_ephemeral[name] = now + DLQ_RECHECK_MS
                continue
            except OSError as exc:
                err = self._shortage(exc, f"remove the ephemeral delivery group {name}")
                if err is None:
                    raise
                self._note_short(err)
                continue
            log.info("delivery group %s: removed (ephemeral, no members left)%s", name,
                     f"; {dead} dead letters with it" if dead else "")

    # -- admin -------------------------------------------------------------------------------

    def describe(self, name: str) -> m.DescribeDeliveryResponse:
        """Members, per-queue progress and lag, retry and DLQ sizes."""
        g = self.group(name)
        now = self._now()
        wall = self.clock.wall_ms()
        members = [
            (mem.member_id, mem.client_id, mem.host, now - mem.last_heartbeat,
             g.in_flight.get(mem.member_id, 0))
            for mem in g.members.values()
        ]
        topics = {t for mem in g.members.values() for t, _ in mem.subscriptions}
        topics |= {t for t, _ in g.sources}
        queues: list[m.DeliveryQueue] = []
        lags: list[int] = []
        for topic in sorted(topics):
            t = self.topics.topics.get(topic)
            if t is None:
                continue
            for qs in t.queues:
                cur = g.sources.get((topic, qs.queue))
                floor = cur.floor if cur is not None else qs.log.start_offset
                nxt = cur.next if cur is not None else floor
                end = qs.visible_end
                age = -1
                if floor < end:
                    try:
                        data = qs.log.read(max(floor, qs.log.start_offset), 1)
                        b = next(iter_batches(data), None)
                        if b is not None:
                            age = max(0, wall - b[1].append_time_ms)
                    except BrokerError:
                        pass
                queues.append((topic, qs.queue, floor, nxt, end,
                               cur.in_flight if cur is not None else 0, age))
                never = end - max(nxt, qs.log.start_offset)  # retention: gone, not owed
                lags.append(max(0, never) + (cur.unfinished if cur is not None else 0))
        dlq_size = self._dlq_size(g)
        blocked: list[m.BlockedKey] = []
        for cur in g.sources.values():
            if not isinstance(cur, OrderlyCursor):
                continue
            t = self.topics.topics.get(cur.topic)
            if t is None:
                continue
            for k, off, f in cur.blocked():
                nxt = -1 if off in cur.leased else self._to_wall(f.until)
                blocked.append((cur.topic, cur.queue, k, encode_msg_id(t.topic_id, cur.queue, off),
                                f.reconsume, f.since_wall, nxt, f.reason))
        return m.DescribeDeliveryResponse(
            g.name, members, queues, self._retry_waiting(g), g.retry.in_flight, dlq_size,
            list(g.retry_delays_ms), g.max_reconsume, g.orderly, blocked, lags,
        )

    def _dlq_size(self, g: DeliveryGroup) -> int:
        """Dead letters not redriven or purged (one per offset of the dead-letter queue)."""
        dlq = self._internal_queue(g.dlq_topic, create=False)
        return max(0, dlq.log.end_offset - max(g.dlq_floor, dlq.log.start_offset)) if dlq else 0

    def _dlq_records(
        self, g: DeliveryGroup, limit: int
    ) -> tuple[int, int, list[StoredRecord]]:
        """Dead letters from the DLQ floor: ``(first, end, up to limit records)``."""
        qs = self._internal_queue(g.dlq_topic, create=False)
        if qs is None:
            return g.dlq_floor, g.dlq_floor, []
        lg = qs.log
        first = max(g.dlq_floor, lg.start_offset)
        end = lg.end_offset
        out: list[StoredRecord] = []
        pos = first
        while pos < end and len(out) < limit:
            data = lg.read(pos, 1 << 20)
            if not data:
                break
            before = pos
            for r in iter_stored(data, pos):
                if len(out) >= limit:
                    break
                out.append(r)
                pos = r.offset + 1
            if pos == before:  # nothing readable in this chunk
                break
        return first, end, out

    def _locate(self, msg_id: str) -> tuple[str, int, int]:
        """(topic, queue, offset) of a message id.

        Raises:
            InvalidRequestError: not a message id.
            UnknownTopicError: no topic has its topic id.
        """
        try:
            topic_id, queue, offset = decode_msg_id(msg_id)
        except ValueError:
            raise InvalidRequestError(f"not a message id: {msg_id[:64]!r}") from None
        t = self.topics.by_id.get(topic_id)
        if t is None:
            raise UnknownTopicError(f"no topic has id {topic_id} (message {msg_id})")
        return t.name, queue, offset

    def message_status(self, msg_id: str) -> m.MessageStatusResponse:
        """The state of one message in every delivery group that knows its topic."""
        topic, queue, offset = self._locate(msg_id)
        qs = self.topics.queue(topic, queue)
        if not qs.log.start_offset <= offset < qs.log.end_offset:
            raise InvalidRequestError(f"message {msg_id} is not stored (deleted or never written)")
        out: list[m.MessageGroupStatus] = []
        for g in self.groups.values():
            cur = g.sources.get((topic, queue))
            subscribed = any(tp == topic for mem in g.members.values() for tp, _ in mem.subscriptions)
            if cur is None and not subscribed:
                continue
            mv = g.moving.get(msg_id)
            if mv is not None:
                state, letter = mv
                out.append((g.name, state, "", -1, letter.reconsume,
                            letter.due_wall if state == "RETRYING" else -1, letter.reason, -1))
                continue
            if cur is not None and offset in cur.leased:
                lease = cur.leased[offset]
                out.append((g.name, "DELIVERED", lease.member, self._to_wall(lease.deadline), 0,
                            -1, "", -1))
                continue
            if isinstance(cur, OrderlyCursor) and offset in cur.pending:
                f = cur.failures.get(offset)
                if f is not None:  # retried in place
                    out.append((g.name, "RETRYING", "", -1, f.reconsume, self._to_wall(f.until),
                                f.reason, -1))
                else:  # behind its key's head
                    out.append((g.name, "WAITING", "", -1, 0, -1, "", -1))
                continue
            if cur is None or offset >= cur.next:
                out.append((g.name, "WAITING", "", -1, 0, -1, "", -1))
                continue
            judged, filtered = self._filtered(g, topic, queue, offset)
            if filtered:  # never delivered: nothing to look for in the retry queue or the DLQ
                out.append((g.name, "FILTERED", "", -1, 0, -1, filtered, -1))
                continue
            retrying, searched_all = self._retry_status(g, msg_id)
            if retrying is not None:
                out.append((g.name, *retrying))
                continue
            dead = self._find_dead(g, msg_id)
            if dead is not None:
                out.append((g.name, "DEAD", "", -1, dead.reconsume, -1, dead.reason,
                            dead.dead_wall))
                continue
            at = g.acked_at(topic, queue, offset)
            note = ""
            if at < 0 and not judged:
                note = ("acknowledged, or filtered out by a tag expression the group no longer "
                        "uses (no time kept)")
            if at < 0 and not searched_all:
                note = (f"{note or 'acknowledged'}; or still retrying: only the newest "
                        f"{MAX_RETRY_SCAN} records of the retry queue were searched")
            out.append((g.name, "CONSUMED", "", -1, 0, -1, note, at))
        return m.MessageStatusResponse(topic, queue, offset, out)

    def _retry_status(
        self, g: DeliveryGroup, msg_id: str
    ) -> tuple[tuple[str, str, int, int, int, str, int] | None, bool]:
        """The status of ``msg_id`` from its newest letter in the group's retry queue: RETRYING
        (a scheduled letter pending in the scheduler, or a visible one not yet leased) or
        DELIVERED (leased), or None when it has no unfinished letter; and whether the whole
        retry queue was searched (only its newest MAX_RETRY_SCAN records are).

        Nothing is kept in memory per pending retry: the letters are found by reading the retry
        queue (a substring test of each chunk read skips the chunks without the id)."""
        qs = self._internal_queue(g.retry_topic, create=False)
        if qs is None:
            return None, True
        lg = qs.log
        end = lg.end_offset
        first = max(lg.start_offset, end - MAX_RETRY_SCAN)
        needle = msg_id.encode()
        found: tuple[int, bool, Letter] | None = None
        try:
            for mv, _p0, h, recs in _batches_between(lg, first, end - 1,
                                                     lambda data: needle in data):
                for rec in recs:
                    if needle in mv[rec[5]:rec[6]].tobytes():
                        r = stored_record(mv, rec)
                        if r.properties.get("%MSGID") == msg_id:
                            with contextlib.suppress(CorruptRecordError):  # not a letter
                                found = (r.offset, bool(h.attributes & ATTR_SCHEDULED),
                                         read_letter(r))
        except CorruptRecordError as exc:
            log.error("retry queue of %s: %s; status search stopped there", g.name, exc)
        searched_all = first <= lg.start_offset
        if found is None:
            return None, searched_all
        off, scheduled, letter = found
        if scheduled:  # not visible yet: the scheduler has it
            state, due = self.scheduler.lookup(qs.topic_id, 0, off)
            if state in (CANCELLED_STATE, NOT_SCHEDULED):
                return None, searched_all
            # PENDING; or FIRED/DONE without a copy after it (the copy could not be written:
            # it fires again after a restart)
            return ("RETRYING", "", -1, letter.reconsume, due, letter.reason, -1), searched_all
        rc = g.retry
        lease = rc.leased.get(off)
        if lease is not None:
            return ("DELIVERED", lease.member, self._to_wall(lease.deadline), letter.reconsume,
                    -1, letter.reason, -1), searched_all
        if rc.is_finished(off):
            return None, searched_all
        return ("RETRYING", "", -1, letter.reconsume, letter.due_wall, letter.reason, -1), \
            searched_all

    def _filtered(self, g: DeliveryGroup, topic: str, queue: int, offset: int) -> tuple[bool, str]:
        """Whether the group's current tag expression of ``topic`` judged the message at
        ``offset`` (a finished one, below the cursor), and if it filtered it out, why ("" when
        not). A message before the position where that expression came into use was judged by
        an earlier one, which the group does not keep."""
        f = g.tag_filters.get(topic)
        if f is None or offset < f.since.get(queue, 0):
            return False, ""
        if f.tags is None:
            return True, ""
        rec = self._read_record(g, (topic, queue), offset)
        if rec is None:
            return True, ""
        tag = rec.tag.decode("utf-8", "replace")
        if tag in f.tags:
            return True, ""
        what = f"its tag is {tag!r}" if tag else "it has no tag"
        return True, (f"filtered out by the group's tag expression {f.expression!r} ({what}): "
                      "never delivered")

    def _find_dead(self, g: DeliveryGroup, msg_id: str) -> Letter | None:
        _, _, recs = self._dlq_records(g, MAX_DLQ_SCAN)
        for r in recs:
            if r.properties.get("%MSGID") == msg_id:
                try:
                    return read_letter(r)
                except CorruptRecordError:
                    return None
        return None

    def dlq_admin(
        self, name: str, action: int, max_messages: int, dry_run: bool
    ) -> tuple[m.DlqAdminResponse, int]:
        """Redrive or purge dead letters; returns the answer and a journal position."""
        g = self.group(name)
        if action == m.DlqAction.PURGE:
            if max_messages > 0:
                first, end, recs = self._dlq_records(g, max_messages)
                stop = recs[-1].offset + 1 if recs else first
                count = len(recs)
            else:  # everything: no need to read it
                first, end, _ = self._dlq_records(g, 0)
                stop = end
                count = max(0, end - first)
            if dry_run or stop <= g.dlq_floor:
                return m.DlqAdminResponse(first, stop, count), -1
            pos = self._journal(g, ["D", stop])
            g.dlq_floor = stop
            self._recheck_ephemeral(g)
            return m.DlqAdminResponse(first, stop, count), pos
        if action != m.DlqAction.REDRIVE:
            raise InvalidRequestError(f"unknown DLQ action {action}")
        first, end, recs = self._dlq_records(
            g, min(max_messages, MAX_REDRIVE_BATCH) if max_messages > 0 else MAX_REDRIVE_BATCH)
        stop = recs[-1].offset + 1 if recs else first
        if dry_run or not recs:
            return m.DlqAdminResponse(first, stop, len(recs)), -1
        with self._writing(g):
            qs = self._retry_queue(g)
            self.flusher.check_writable(qs)
            wall = self.clock.wall_ms()
            count = 0
            last_end = 0
            for r in recs:
                try:
                    origin = read_letter(r)
                except CorruptRecordError:
                    continue
                letter = origin._replace(reconsume=0, due_wall=wall,
                                         reason="redriven from DLQ", dead_wall=-1)
                try:
                    res = qs.log.append(make_letter(r, letter), now_ms=wall)  # visible: due now
                except OSError as exc:  # stop here: what was copied is redriven, no more
                    err = self._shortage(exc, f"redrive dead letters of {g.name}")
                    if err is None or not count:
                        raise
                    stop = r.offset
                    break
                last_end = res.last_offset + 1
                count += 1
            self.flusher.mark_dirty(qs)
            if not self.sync:
                qs.advance(qs.log.end_offset)
            pos = self._journal(g, ["D", stop]) if not self.sync else -1
            g.dlq_floor = stop
        self._recheck_ephemeral(g)
        g.pending_moves += 1

        def moved(exc: BaseException | None) -> None:
            if flush_postponed(exc) and qs not in self.flusher.failed:
                qs.wait_durable(last_end, moved)  # durable once the flusher wrote it again
                return
            g.pending_moves -= 1
            if exc is not None:
                log.error("delivery group %s: redrive failed: %s", g.name, exc)
                return
            if self.sync:
                try:
                    self._journal_or_defer(g, ["D", stop])
                except BrokerError as e:
                    log.error("delivery group %s: %s", g.name, e)
            g.wake()

        if self.sync and last_end:
            qs.wait_durable(last_end, moved)
        else:
            moved(None)
        return m.DlqAdminResponse(first, stop, count), pos

    def _recheck_ephemeral(self, g: DeliveryGroup) -> None:
        """An ephemeral group without members kept for its dead letters: look again now."""
        if g.name in self._idle_ephemeral:
            self._idle_ephemeral[g.name] = self._now()


_SKIP_BITS = ATTR_SCHEDULED | ATTR_TRANSACTIONAL | ATTR_CONTROL


def _txn_filter(lg: Log, start: int, end: int) -> ReadCommittedFilter | None:
    """The read_committed filter for a read of ``[start, end)`` (None: no aborted data)."""
    aborted = lg.aborted_txns(start, end)
    return ReadCommittedFilter(aborted) if aborted else None


def _skipped(h: BatchHeader, txf: ReadCommittedFilter | None) -> bool:
    """Whether delivery leaves this batch out: a scheduled original (its copy comes when due),
    a transaction marker, or data of an aborted transaction. Call in offset order."""
    if h.attributes & ATTR_SCHEDULED:
        return True
    if txf is not None:
        return not txf.keep(h.producer_id, h.base_offset, h.attributes)
    return bool(h.attributes & ATTR_CONTROL)


def _settle_future(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if not fut.done():
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
