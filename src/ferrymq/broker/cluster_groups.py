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
forgets those groups. Memberships are not logged: after a failover the new coordinator knows no
member, so heartbeats get UNKNOWN_MEMBER and the members rejoin (as in Kafka), then resume from
the committed offsets.

Not yet: the log is neither compacted nor snapshotted (a new leader replays the whole queue;
Kafka compacts by key), and offsets committed within a transaction (TXN_OFFSET_COMMIT) are not
written here (docs/cluster.md).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import msgpack

from ferrymq.cluster.model import NO_LEADER
from ferrymq.cluster.topics import DEFAULT, create_topic
from ferrymq.errors import (
    BrokerError,
    CorruptRecordError,
    MetadataError,
    NotCoordinatorError,
    NotLeaderError,
    TopicAlreadyExistsError,
)
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, coordinator_queue
from ferrymq.protocol.messages import Acks
from ferrymq.protocol.records import RecordInput, decode_records, encode_batch

if TYPE_CHECKING:
    from ferrymq.broker.cluster_link import ClusterLink
    from ferrymq.broker.consumer_groups import ConsumerGroupCoordinator
    from ferrymq.broker.topics import QueueState

log = logging.getLogger("ferrymq.broker")

READ_BYTES = 1 << 20
"""Bytes read at a time when a new coordinator replays its queue."""

Offsets = dict[tuple[str, int], int]


def replay(qs: QueueState, topic_ids: dict[str, int]) -> dict[str, Offsets]:
    """The committed offsets per group that the records of ``qs`` (a queue of
    ``%GROUPS%offsets``) add up to, keeping only topics whose id is in ``topic_ids``."""
    groups: dict[str, Offsets] = {}
    pos = qs.log.start_offset
    while pos < qs.log.end_offset:
        data = qs.log.read(pos, READ_BYTES)
        if not data:
            break
        try:
            recs = decode_records(data)
        except CorruptRecordError as exc:
            log.warning("%s: unreadable record at %d: %s", qs, pos, exc)
            break
        nxt = pos
        for rec in recs:
            nxt = rec.offset + 1
            if rec.offset >= pos:
                _apply(groups, rec.body, topic_ids, qs, rec.offset)
        if nxt <= pos:
            break
        pos = nxt
    return groups


def _apply(groups: dict[str, Offsets], body: bytes, topic_ids: dict[str, int], qs: QueueState,
           offset: int) -> None:
    try:
        d = msgpack.unpackb(body, raw=False, strict_map_key=False)
        name = str(d["g"])
        if d["t"] == "DELETE":
            groups.pop(name, None)
            return
        offs = groups.setdefault(name, {})
        for topic, topic_id, queue, committed in d["o"]:
            if topic_ids.get(topic) == topic_id:
                offs[(str(topic), int(queue))] = int(committed)
    except (KeyError, ValueError, TypeError) as exc:
        log.warning("%s: bad record at %d: %s", qs, offset, exc)


class ClusterGroups:
    """The consumer groups this broker coordinates (see the module docstring)."""

    def __init__(self, link: ClusterLink) -> None:
        self.link = link
        self.groups: ConsumerGroupCoordinator = link.server.consumer_groups
        self.led: set[int] = set()
        """Queues of ``%GROUPS%offsets`` this broker leads, their groups loaded."""
        self._creating: asyncio.Task[None] | None = None

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
            self._creating = asyncio.get_running_loop().create_task(self._create())

    async def _create(self) -> None:
        node, cfg = self.link.node, self.link.server.config
        try:
            await create_topic(node.store, node.keys, OFFSETS_TOPIC, cfg.offsets_topic_queues,
                               DEFAULT, DEFAULT, {}, self.link.server.clock.wall_ms(),
                               default_replicas_setting=cfg.default_replicas,
                               default_min_insync_setting=cfg.default_min_insync,
                               internal_ok=True)
            log.info("created %s (%d queues) for consumer groups", OFFSETS_TOPIC,
                     cfg.offsets_topic_queues)
        except TopicAlreadyExistsError:
            pass
        except (MetadataError, BrokerError) as exc:  # the next group request asks again
            log.warning("creating %s failed: %s", OFFSETS_TOPIC, exc)

    # --- leadership of the log -------------------------------------------------------------------

    def on_role(self, queue: int, leads: bool, new_epoch: bool) -> None:
        """This broker now leads queue ``queue`` of ``%GROUPS%offsets`` (``new_epoch``: it did
        not lead it at this epoch before: replay it) or not (forget its groups)."""
        if leads and (new_epoch or queue not in self.led):
            self.groups.drop(self._groups_of(queue))
            topics = self.link.server.topics
            ids = {name: t.topic_id for name, t in topics.topics.items()}
            offsets = replay(topics.queue(OFFSETS_TOPIC, queue), ids)
            self.groups.adopt(offsets)
            self.led.add(queue)
            log.info("coordinating the consumer groups of %s/%d: %d groups with committed "
                     "offsets", OFFSETS_TOPIC, queue, len(offsets))
        elif not leads and queue in self.led:
            self.led.discard(queue)
            self.groups.drop(self._groups_of(queue))

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
        qs = t.queues[queue]
        rep = qs.replica
        if rep is None:
            raise NotCoordinatorError(f"{qs} has no replica role here")
        try:
            rep.check_produce(Acks.ALL)
        except NotLeaderError as exc:
            raise NotCoordinatorError(f"group {group!r}: {exc.message}") from None
        srv.flusher.check_writable(qs)
        now = srv.clock.wall_ms()
        body = bytes(msgpack.packb(rec, use_bin_type=True))
        batch = encode_batch([RecordInput(body, now, rec["t"].encode(), group.encode())])
        try:
            res = qs.log.append(batch, now_ms=now)
        except OSError as exc:
            raise srv.flusher.write_error(exc, f"the offsets of group {group!r}") from None
        srv.flusher.mark_dirty(qs)
        qs.advance(qs.log.end_offset)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def acked(exc: BaseException | None) -> None:
            if done.done():
                return
            if exc is None:
                done.set_result(None)
            else:
                done.set_exception(exc)

        rep.wait_acks(res.last_offset + 1, 0, acked)
        try:
            await done
        except NotLeaderError as exc:
            raise NotCoordinatorError(f"group {group!r}: {exc.message}") from None
        if queue not in self.led:
            raise NotCoordinatorError(f"broker {self.link.node.broker_id} stopped coordinating "
                                      f"group {group!r} while writing its offsets")
