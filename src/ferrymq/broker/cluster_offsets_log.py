"""The records of ``%GROUPS%offsets`` and what they add up to: replay and compaction.

Theory of operation
-------------------
A queue of ``%GROUPS%offsets`` holds three kinds of msgpack records (keyed by the group):

- ``{"t": "OFFSETS", "g": group, "o": [[topic, topic_id, queue, offset], ...]}``: committed
  offsets (the last one per group, topic and queue wins);
- ``{"t": "MEMBERS", "g": group, "gen": generation, "m": [[member_id, client_id, host,
  [topic, ...], session_timeout_ms, [[topic, queue], ...]], ...]}``: the group's generation
  and members with their assignment, written at every rebalance (the last one wins: Kafka's
  group metadata record), so a new coordinator knows the members and fences stale
  generations without making everybody rejoin;
- ``{"t": "DELETE", "g": group}``: a deleted group;
- ``{"t": "SNAPSHOT", "upto": P, "n": N, "i": I, "gs": {group: [[topic, topic_id, queue,
  offset], ...]}, "ms": {group: [generation, members]}}``: part ``I`` of ``N`` of a snapshot:
  every group's offsets and membership as the records below offset ``P`` add them up.

**Compaction** (Kafka compacts ``__consumer_offsets`` by key; our records carry only what a
commit changed, so we snapshot instead). The queue's leader keeps an :class:`OffsetsReplay`
advanced to the high watermark; when the log has grown by ``offsets_segment_bytes`` since the
last compaction, it appends a snapshot of that replay (``upto`` = the position it reached),
waits until the high watermark covers the snapshot, then deletes the segments that hold only
offsets below ``upto`` (:meth:`~ferrymq.storage.log.Log.delete_before`). Followers follow the
leader's log start. The topic's segments roll at ``offsets_segment_bytes`` and it has no
time or size retention, so nothing else ever deletes a committed offset.

**Replay.** A log that still starts at offset 0 is replayed record by record and its snapshots
skipped: they say what the records before them add up to. A log whose start moved (records
deleted) must start from a snapshot: the records from the start are held until the first
complete snapshot whose ``upto`` is at or above the start, which replaces the state, then the
held records at or after ``upto`` are applied again (a commit written between ``upto`` and the
snapshot is newer than the snapshot). After that, later snapshots are skipped again. A snapshot
whose parts are not all there (its writer died) is never used; the start moved only after a
complete one was replicated.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from ferrymq.errors import CorruptRecordError
from ferrymq.protocol.records import RecordInput, decode_records, encode_batch

if TYPE_CHECKING:
    from ferrymq.broker.topics import QueueState

log = logging.getLogger("ferrymq.broker")

READ_BYTES = 1 << 20
"""Bytes read at a time when the log is replayed."""
SNAPSHOT_BATCH_BYTES = 256 * 1024
"""About the most bytes of one snapshot batch (several batches when there are many groups:
each stays well under what a follower's fetch asks for)."""

Offsets = dict[tuple[str, int], int]
Entry = list[Any]  # [topic, topic_id, queue, offset]


@dataclass
class OffsetsReplay:
    """The committed offsets per group that a queue of ``%GROUPS%offsets`` adds up to, read
    incrementally (see the module docstring).

    Attributes:
        topic_id_of: a live topic's id (None: no such topic): entries of other topics
            (deleted, or deleted and created again under a new id) are skipped.
        groups: the offsets per group so far.
        ids: the topic id each topic's entries in :attr:`groups` were accepted with.
        position: the next offset to read.
    """

    topic_id_of: Callable[[str], int | None]
    groups: dict[str, Offsets] = field(default_factory=dict)
    members: dict[str, list[Any]] = field(default_factory=dict)
    """Per group, its last ``[generation, members]`` (a MEMBERS record's fields)."""
    ids: dict[str, int] = field(default_factory=dict)
    position: int = -1
    _held: list[tuple[int, dict[str, Any]]] | None = None
    _parts: dict[tuple[int, int], dict[str, dict[str, Any]]] = field(default_factory=dict)

    def advance(self, qs: QueueState, upto: int) -> None:
        """Read the records of ``qs`` from :attr:`position` up to offset ``upto``."""
        lg = qs.log
        if self.position < 0:
            self.position = lg.start_offset
            if lg.start_offset > 0:
                self._held = []  # the start moved: wait for a snapshot
        pos = max(self.position, lg.start_offset)
        while pos < upto:
            data = lg.read(pos, READ_BYTES, upto_offset=upto)
            if not data:
                break
            try:
                recs = decode_records(data)
            except CorruptRecordError as exc:
                log.warning("%s: unreadable record at %d: %s", qs, pos, exc)
                break
            nxt = pos
            for rec in recs:
                if rec.offset >= upto:
                    break
                nxt = rec.offset + 1
                if rec.offset >= pos:
                    self._record(qs, rec.offset, rec.body)
            if nxt <= pos:
                break
            pos = nxt
        self.position = pos
        if self._held is not None and pos >= lg.end_offset:
            if self._held:
                log.warning("%s: its start %d is past offset 0 and no snapshot covers it: the "
                            "offsets of records before the start are lost", qs, lg.start_offset)
            for offset, d in self._held:  # the best it has: what the records say
                self._apply(qs, offset, d)
            self._held = None

    def _record(self, qs: QueueState, offset: int, body: bytes) -> None:
        try:
            d = msgpack.unpackb(body, raw=False, strict_map_key=False)
            kind = d["t"]
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("%s: bad record at %d: %s", qs, offset, exc)
            return
        if kind == "SNAPSHOT":
            if self._held is not None:
                self._snapshot_part(qs, offset, d)
        elif self._held is not None:
            self._held.append((offset, d))
        else:
            self._apply(qs, offset, d)

    def _snapshot_part(self, qs: QueueState, offset: int, d: dict[str, Any]) -> None:
        try:
            key = (int(d["upto"]), int(d["n"]))
            parts = self._parts.setdefault(key, {})
            parts[str(d["i"])] = {"gs": d["gs"], "ms": d.get("ms", {})}
        except (KeyError, ValueError, TypeError) as exc:
            log.warning("%s: bad snapshot record at %d: %s", qs, offset, exc)
            return
        upto, n = key
        if len(parts) < n or upto < qs.log.start_offset:
            return
        self.groups = {}
        self.members = {}
        for part in parts.values():
            for group, entries in part["gs"].items():
                self._apply(qs, offset, {"t": "OFFSETS", "g": group, "o": entries})
            for group, (gen, members) in part.get("ms", {}).items():
                self._apply(qs, offset, {"t": "MEMBERS", "g": group, "gen": gen, "m": members})
        for held_offset, held in self._held or ():
            if held_offset >= upto:
                self._apply(qs, held_offset, held)
        self._held = None
        self._parts.clear()

    def _apply(self, qs: QueueState, offset: int, d: dict[str, Any]) -> None:
        try:
            name = str(d["g"])
            if d["t"] == "DELETE":
                self.groups.pop(name, None)
                self.members.pop(name, None)
                return
            if d["t"] == "MEMBERS":
                self.members[name] = [int(d["gen"]), list(d["m"])]
                return
            if d["t"] != "OFFSETS":
                return
            offs = self.groups.setdefault(name, {})
            for topic, topic_id, queue, committed in d["o"]:
                if self.topic_id_of(topic) == topic_id:
                    offs[(str(topic), int(queue))] = int(committed)
                    self.ids[topic] = topic_id

        except (KeyError, ValueError, TypeError) as exc:
            log.warning("%s: bad record at %d: %s", qs, offset, exc)

    def live(self) -> dict[str, Offsets]:
        """:attr:`groups` without the entries of topics deleted (or created again) since."""
        stale = {t for t, i in self.ids.items() if self.topic_id_of(t) != i}
        if not stale:
            return self.groups
        return {g: {k: o for k, o in offs.items() if k[0] not in stale}
                for g, offs in self.groups.items()}


def replay(qs: QueueState, topic_ids: dict[str, int]) -> dict[str, Offsets]:
    """The committed offsets per group that the whole of ``qs`` adds up to, keeping only
    topics whose id is in ``topic_ids``."""
    r = OffsetsReplay(topic_ids.get)
    r.advance(qs, qs.log.end_offset)
    return r.groups


def snapshot_batches(r: OffsetsReplay, now_ms: int) -> Iterator[bytes | bytearray]:
    """The batches of one snapshot of what ``r`` read, as of its position (one record per
    part, about :data:`SNAPSHOT_BATCH_BYTES` each)."""
    parts: list[tuple[dict[str, list[Entry]], dict[str, list[Any]]]] = [({}, {})]
    size = 0
    upto = r.position
    offsets = r.live()
    for group in offsets.keys() | r.members.keys():
        offs = offsets.get(group, {})
        entries: list[Entry] = [[t, r.ids[t], q, o] for (t, q), o in offs.items()]
        ms = r.members.get(group)
        cost = len(group) + sum(len(t) + 24 for (t, _q) in offs) + len(repr(ms or ""))
        if size and size + cost > SNAPSHOT_BATCH_BYTES:
            parts.append(({}, {}))
            size = 0
        parts[-1][0][group] = entries
        if ms is not None:
            parts[-1][1][group] = ms
        size += cost
    for i, (gs, mss) in enumerate(parts):
        body = msgpack.packb({"t": "SNAPSHOT", "upto": upto, "n": len(parts), "i": i, "gs": gs,
                              "ms": mss}, use_bin_type=True)
        yield encode_batch([RecordInput(bytes(body), now_ms, b"SNAPSHOT")])
