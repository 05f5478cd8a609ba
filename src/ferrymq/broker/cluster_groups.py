"""Consumer groups in a cluster: which broker coordinates a group, and its offsets replicated.

Theory of operation
-------------------
Kafka's group coordinator, as CLUSTER.md ("Stateful services") asks: a group's committed offsets
are a deterministic function of a replicated log. The log is the internal topic
``%GROUPS%offsets`` (``offsets_topic_queues`` queues, the cluster's default replicas and
``min_insync``), created through the metadata store by the first broker asked about a group.
Group ``g`` lives in queue :func:`~ferrymq.protocol.coordinator.coordinator_queue` of it, and
its **coordinator** is that queue's leader. A group request (JOIN_GROUP, HEARTBEAT,
LEAVE_GROUP, COMMIT_OFFSETS, FETCH_OFFSETS, RESET_OFFSETS, DESCRIBE_GROUP, DELETE_GROUP) that
reaches another broker is refused with NOT_COORDINATOR (retriable: the client finds the
coordinator again, :mod:`ferrymq.client._coordinator`, and retries there).

Writes: a commit (a reset, a delete) appends one record to the group's queue, msgpack
``{"t": "OFFSETS", "g": group, "o": [[topic, topic_id, queue, offset], ...]}`` (``{"t":
"DELETE", "g": group}`` for a deleted group), keyed by the group, and is answered once the
queue's high watermark covers it (acks=all: every in-sync replica has it, and at least
``min_insync`` of them); only then is it applied to the in-memory
:class:`~ferrymq.broker.consumer_groups.ConsumerGroupCoordinator` (its ``files=False`` mode). A
write that is refused or not replicated changes nothing in memory; one whose leader lost the
queue meanwhile is answered NOT_COORDINATOR (the record, if kept, is replayed by the next
leader: committing the same offsets again is harmless).

Failover: when this broker becomes the leader of a queue of ``%GROUPS%offsets`` it replays the
whole queue into the committed offsets of its groups (:meth:`ClusterGroups.on_leader`; the last
record per group, topic and queue wins; entries of a topic deleted since, or deleted and
created again, which has another topic id, are skipped); when it stops leading the queue, it
forgets those groups.

Memberships (Kafka's group metadata record): every generation change appends a MEMBERS record
(generation, members, assignment; :meth:`ClusterGroups.persist`); JOIN_GROUP and LEAVE_GROUP are
answered once it is replicated, other changes (expiry, resized topics) write it in the
background. A new coordinator restores the members, sessions starting afresh, and the
generation, so members go on without rejoining and stale generations stay fenced.

Compaction: the leader of a queue snapshots its groups' offsets into it and deletes the
segments the snapshot replaced (:mod:`ferrymq.broker.cluster_offsets_log`), so a new leader
replays about two segments (``offsets_segment_bytes``), not every commit ever made.

Offsets committed within a transaction (TXN_OFFSET_COMMIT) are written here when the
transaction commits, by its coordinator (:mod:`ferrymq.broker.txn.cluster`: directly, or
through COMMIT_OFFSETS when another broker coordinates the group).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

import msgpack

from ferrymq.broker.cluster_offsets_log import OffsetsReplay, snapshot_batches
from ferrymq.broker.consumer_groups import Member
from ferrymq.broker.topics import replicated
from ferrymq.cluster.model import NO_LEADER
from ferrymq.cluster.topics import DEFAULT, create_topic
from ferrymq.errors import (
    BrokerError,
    MetadataError,
    NotCoordinatorError,
    NotLeaderError,
    TopicAlreadyExistsError,
)
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, coordinator_queue
from ferrymq.protocol.messages import Acks
from ferrymq.protocol.records import RecordInput, encode_batch

if TYPE_CHECKING:
    from ferrymq.broker.cluster_link import ClusterLink
    from ferrymq.broker.consumer_groups import ConsumerGroup, ConsumerGroupCoordinator

log = logging.getLogger("ferrymq.broker")

COMPACT_CHECK_S = 1.0
"""How often the leader of a queue of ``%GROUPS%offsets`` reads its new records and asks
whether it is time to compact."""
Offsets = dict[tuple[str, int], int]


async def create_internal_topic(link: ClusterLink, name: str, queues: int, what: str) -> None:
    """Create the internal cluster topic ``name`` (the cluster's default replicas and
    ``min_insync``) for ``what``; nothing when it exists. A failure is logged: the next request
    that needs it asks again."""
    node, cfg = link.node, link.server.config
    try:
        await create_topic(node.store, node.keys, name, queues, DEFAULT, DEFAULT, {},
                           link.server.clock.wall_ms(),
                           default_replicas_setting=cfg.default_replicas,
                           default_min_insync_setting=cfg.default_min_insync,
                           internal_ok=True)
        log.info("created %s (%d queues) for %s", name, queues, what)
    except TopicAlreadyExistsError:
        pass
    except (MetadataError, BrokerError) as exc:
        log.warning("creating %s failed: %s", name, exc)


class ClusterGroups:
    """The consumer groups this broker coordinates (see the module docstring)."""

    def __init__(self, link: ClusterLink) -> None:
        self.link = link
        self.groups: ConsumerGroupCoordinator = link.server.consumer_groups
        self.led: set[int] = set()
        """Queues of ``%GROUPS%offsets`` this broker leads, their groups loaded."""
        self._creating: asyncio.Task[None] | None = None
        self._replays: dict[int, OffsetsReplay] = {}
        """Per led queue, its records replayed up to its high watermark (compaction's view)."""
        self._compacted_at: dict[int, int] = {}
        """Per led queue, its size in bytes after its last compaction (or its loading)."""
        self._compactor: asyncio.Task[None] | None = None
        self._persisted: dict[str, int] = {}
        """Per group coordinated here, the generation its last replicated MEMBERS record has."""
        self._persisting: dict[str, tuple[int, asyncio.Future[None]]] = {}
        """Per group, the generation being written and the write."""
        self.groups.on_generation = self._generation_moved

    def start(self) -> None:
        """Start compacting the queues this broker comes to lead."""
        self._compactor = asyncio.get_running_loop().create_task(self._compact_forever())

    async def stop(self) -> None:
        """Stop compacting."""
        if self._compactor is not None:
            self._compactor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._compactor

    # --- who coordinates -------------------------------------------------------------------------

    def check_coordinator(self, group: str) -> None:
        """Raise unless this broker coordinates ``group`` (asking the cluster to create
        ``%GROUPS%offsets`` if it does not exist yet).

        Raises:
            NotCoordinatorError: another broker does, or none yet.
        """
        t = self.link.server.topics.topics.get(OFFSETS_TOPIC)
        if t is None:
            self._create_soon()
            raise NotCoordinatorError(f"group {group[:249]!r} has no coordinator yet: the "
                                      f"cluster is creating {OFFSETS_TOPIC}; retry")
        q = coordinator_queue(group, len(t.queues))
        if q not in self.led:
            rec = self.link.node.view.queues.get((OFFSETS_TOPIC, q))
            leader = rec.leader if rec is not None else NO_LEADER
            now = f"broker {leader} leads it" if leader != NO_LEADER else "it has no leader now"
            raise NotCoordinatorError(
                f"broker {self.link.node.broker_id} does not coordinate group {group[:249]!r}: "
                f"its offsets are in {OFFSETS_TOPIC}/{q} and {now}")

    def _create_soon(self) -> None:
        if self._creating is None or self._creating.done():
            self._creating = asyncio.get_running_loop().create_task(self.create_internal(
                OFFSETS_TOPIC, self.link.server.config.offsets_topic_queues, "consumer groups"))

    async def create_internal(self, name: str, queues: int, what: str) -> None:
        """Create the internal topic ``name`` of a service (``what``) in the cluster
        (:func:`create_internal_topic`)."""
        await create_internal_topic(self.link, name, queues, what)

    # --- leadership of the log -------------------------------------------------------------------

    def on_role(self, queue: int, leads: bool, new_epoch: bool) -> None:
        """This broker now leads queue ``queue`` of ``%GROUPS%offsets`` (``new_epoch``: it did
        not lead it at this epoch before: replay it) or not (forget its groups)."""
        if leads and (new_epoch or queue not in self.led):
            self.groups.drop(self._groups_of(queue))
            topics = self.link.server.topics
            qs = topics.queue(OFFSETS_TOPIC, queue)
            r = OffsetsReplay(self._topic_id_of)
            r.advance(qs, qs.log.end_offset)
            offsets = r.live()
            memberships = self._memberships(r)
            self.groups.adopt({g: dict(o) for g, o in offsets.items()}, memberships)
            for g, (gen, _members) in memberships.items():
                self._persisted[g] = gen
            self._replays[queue] = r
            self._compacted_at[queue] = qs.log.size_bytes
            self.led.add(queue)
            log.info("coordinating the consumer groups of %s/%d: %d groups with committed "
                     "offsets, %d with members", OFFSETS_TOPIC, queue, len(offsets),
                     sum(1 for _gen, ms in memberships.values() if ms))
        elif not leads and queue in self.led:
            self.led.discard(queue)
            self._replays.pop(queue, None)
            self._compacted_at.pop(queue, None)
            names = self._groups_of(queue)
            self.groups.drop(names)
            for g in names:
                self._persisted.pop(g, None)

    def _memberships(self, r: OffsetsReplay) -> dict[str, tuple[int, list[Member]]]:
        """The groups' generations and members as ``r`` read them; each member's session
        starts now."""
        now = self.link.server.now_monotonic_ms()
        out: dict[str, tuple[int, list[Member]]] = {}
        for group, (gen, members) in r.members.items():
            try:
                out[group] = (gen, [
                    Member(str(mid), str(client), str(host), tuple(map(str, topics)),
                           int(timeout), now, [(str(t), int(q)) for t, q in assignment])
                    for mid, client, host, topics, timeout, assignment in members])
            except (ValueError, TypeError) as exc:
                log.warning("group %s: bad membership record: %s (its members rejoin)", group,
                            exc)
        return out

    def _topic_id_of(self, name: str) -> int | None:
        t = self.link.server.topics.topics.get(name)
        return None if t is None else t.topic_id

    def _groups_of(self, queue: int) -> list[str]:
        t = self.link.server.topics.topics.get(OFFSETS_TOPIC)
        if t is None:
            return []
        n = len(t.queues)
        return [g for g in self.groups.groups if coordinator_queue(g, n) == queue]

    # --- writes ------------------------------------------------------------------------------------

    async def commit(self, group: str, member_id: str, generation: int,
                     entries: list[tuple[str, int, int]]) -> None:
        """Store committed offsets: fenced by generation, replicated, then applied.

        Raises:
            NotCoordinatorError, IllegalGenerationError, UnknownMemberError,
            NotEnoughReplicasError, StorageFullError, StorageFailureError.
        """
        self.check_coordinator(group)
        self.groups.check_commit(group, member_id, generation)
        await self._write_offsets(group, entries)
        self.groups.commit(group, "", -1, entries)

    async def set_offsets(self, group: str, offsets: Offsets) -> None:
        """Overwrite some committed offsets (reset-offset), replicated first."""
        self.check_coordinator(group)
        self.groups.check_new(group)
        await self._write_offsets(group, [(t, q, o) for (t, q), o in offsets.items()])
        self.groups.set_offsets(group, offsets)

    async def delete(self, group: str) -> None:
        """Delete a group without members: a tombstone replicated first, then forgotten."""
        self.check_coordinator(group)
        self.groups.check_deletable(group)
        if group in self.groups.groups:
            await self._write(group, {"t": "DELETE", "g": group})
            self.groups.delete(group)
            self._persisted.pop(group, None)

    # --- membership -----------------------------------------------------------------------------

    def _generation_moved(self, g: ConsumerGroup) -> None:
        """A group's generation moved (a join, leave, expiry, resized topic, offset reset):
        log its membership in the background (a JOIN answer waits for it, :meth:`persist`)."""
        fut = asyncio.ensure_future(self.persist(g.name))
        fut.add_done_callback(_quiet)

    async def persist(self, group: str) -> None:
        """Make ``group``'s current generation and members durable in its queue (a MEMBERS
        record, replicated) unless they are already; a write of the same generation under way
        is waited for, not repeated.

        Raises:
            NotCoordinatorError, NotEnoughReplicasError, StorageFullError, StorageFailureError.
        """
        g = self.groups.groups.get(group)
        if g is None or self._persisted.get(group, -1) >= g.generation:
            return
        under_way = self._persisting.get(group)
        if under_way is not None and under_way[0] >= g.generation:
            await asyncio.shield(under_way[1])
            return
        gen = g.generation
        rec = {"t": "MEMBERS", "g": group, "gen": gen, "m": [
            [mm.member_id, mm.client_id, mm.host, list(mm.topics), mm.session_timeout_ms,
             [[t, q] for t, q in mm.assignment]] for mm in g.members.values()]}
        fut = asyncio.ensure_future(self._write(group, rec))
        self._persisting[group] = (gen, fut)
        try:
            await asyncio.shield(fut)
        finally:
            if self._persisting.get(group, (0, None))[1] is fut:
                del self._persisting[group]
        if gen > self._persisted.get(group, -1):
            self._persisted[group] = gen

    async def _write_offsets(self, group: str, entries: list[tuple[str, int, int]]) -> None:
        topics = self.link.server.topics
        await self._write(group, {"t": "OFFSETS", "g": group, "o": [
            [t, topics.get(t).topic_id, q, o] for t, q, o in entries]})

    async def _write(self, group: str, rec: dict[str, Any]) -> None:
        """Append ``rec`` to ``group``'s queue and wait until the high watermark covers it."""
        srv = self.link.server
        self.check_coordinator(group)
        t = srv.topics.get(OFFSETS_TOPIC)
        queue = coordinator_queue(group, len(t.queues))
        body = bytes(msgpack.packb(rec, use_bin_type=True))
        batch = encode_batch([RecordInput(body, srv.clock.wall_ms(), rec["t"].encode(),
                                          group.encode())])
        try:
            await self._append(queue, [batch], f"the offsets of group {group!r}")
        except NotLeaderError as exc:
            raise NotCoordinatorError(f"group {group!r}: {exc.message}") from None
        if queue not in self.led:
            raise NotCoordinatorError(f"broker {self.link.node.broker_id} stopped coordinating "
                                      f"group {group!r} while writing its offsets")

    async def _append(self, queue: int, batches: list[bytes | bytearray], what: str) -> None:
        """Append ``batches`` to queue ``queue`` of ``%GROUPS%offsets`` as its leader and wait
        until the high watermark covers the last.

        Raises:
            NotCoordinatorError: no replica role here.
            NotLeaderError: not its leader (any more), or fenced.
            NotEnoughReplicasError, StorageFullError, StorageFailureError.
        """
        srv = self.link.server
        qs = srv.topics.get(OFFSETS_TOPIC).queues[queue]
        rep = qs.replica
        if rep is None:
            raise NotCoordinatorError(f"{qs} has no replica role here")
        rep.check_produce(Acks.ALL)
        srv.flusher.check_writable(qs)
        now = srv.clock.wall_ms()
        last = -1
        try:
            for batch in batches:
                last = qs.log.append(batch, now_ms=now).last_offset
        except OSError as exc:
            raise srv.flusher.write_error(exc, what) from None
        finally:
            if last >= 0:
                srv.flusher.mark_dirty(qs)
                qs.advance(qs.log.end_offset)
        await replicated(rep, last + 1)

    # --- compaction ----------------------------------------------------------------------------

    async def _compact_forever(self) -> None:
        while True:
            await asyncio.sleep(COMPACT_CHECK_S)
            for queue in sorted(self.led):
                try:
                    await self.compact(queue)
                except (BrokerError, OSError) as exc:  # tried again at the next check
                    log.warning("compacting %s/%d failed: %s", OFFSETS_TOPIC, queue, exc)

    async def compact(self, queue: int, *, force: bool = False) -> bool:
        """Read the new replicated records of queue ``queue`` (led here); when it grew by
        ``offsets_segment_bytes`` since its last compaction (or ``force``), write a snapshot
        of its groups' offsets and delete the segments it replaced. Whether it compacted."""
        srv = self.link.server
        r = self._replays.get(queue)
        t = srv.topics.topics.get(OFFSETS_TOPIC)
        if r is None or t is None or queue not in self.led:
            return False
        qs = t.queues[queue]
        if qs.replica is None:
            return False
        r.advance(qs, qs.visible_end)  # a leader's visible end is its high watermark
        grown = qs.log.size_bytes - self._compacted_at.get(queue, 0)
        if not force and grown < srv.config.offsets_segment_bytes:
            return False
        upto = r.position
        batches = list(snapshot_batches(r, srv.clock.wall_ms()))
        await self._append(queue, batches, f"a snapshot of {OFFSETS_TOPIC}/{queue}")
        if self._replays.get(queue) is not r:
            return False  # lost the queue meanwhile: its next leader compacts
        deleted = qs.log.delete_before(upto, now_ms=srv.clock.wall_ms())
        self._compacted_at[queue] = qs.log.size_bytes
        log.info("compacted %s/%d: a snapshot of %d groups as of offset %d, %d segments "
                 "deleted, the log starts at %d", OFFSETS_TOPIC, queue, len(r.groups), upto,
                 deleted, qs.log.start_offset)
        return True


def _quiet(fut: asyncio.Future[None]) -> None:
    """A background membership write failed: the next one (or a JOIN) writes it again."""
    if not fut.cancelled() and (exc := fut.exception()) is not None:
        log.debug("logging a group's membership failed: %s", exc)
