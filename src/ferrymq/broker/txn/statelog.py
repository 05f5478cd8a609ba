"""The coordinator's durable state: the ``%TXN%state`` log, its records and the snapshot.

``%TXN%state`` (one queue, internal, never fetched by clients) holds one record per transition,
msgpack, keyed by the transactional id (TXN: the *full* state of one tid) or the sink id (SINK:
a sink batch committed, with the staged members it decides), so replay needs only the newest
record per tid. The snapshot (``meta/txn_coordinator``, a checkpoint file) holds every tid's
record, the sink fences and the log offset it covers; start-up loads it and replays the rest
(:meth:`StateLog.load`) into a :class:`~.state.TxnBook`.

In a cluster (:attr:`StateLog.cluster`) the topic is a replicated cluster topic (created through
the metadata store, never here), a write counts once the queue's high watermark covers it,
there is no snapshot file, and the coordinator replays the queue from its start when it starts
leading it (:meth:`StateLog.replay_all`; :mod:`.cluster`).

**Compaction in a cluster** (Kafka compacts ``__transaction_state`` by key). The coordinator
keeps a :class:`StateReplay` of the records up to the high watermark; once the log has grown by
``txn_state_segment_bytes`` it appends a snapshot of that replay (SNAPSHOT records, parts ``i``
of ``n``, ``upto`` = the offset the replay reached; idle ids past ``txn_id_expiration_ms`` left
out), waits until it is replicated, and deletes the segments below ``upto``. Every TXN record
holds the *full* state of its id, so replay merges a complete snapshot instead of replacing the
state with it: an id (or sink fence) last set by a record at or after ``upto`` keeps that
record's state, every other id takes the snapshot's, and ids the snapshot does not have are
gone. That holds wherever the replay starts (0, or a start the deletion moved), and a snapshot
whose parts are not all there (its writer died) is never used.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from ferrymq._time import Clock
from ferrymq.broker.flusher import flush_postponed
from ferrymq.broker.topics import replicated
from ferrymq.broker.txn.state import TxnBook, TxnMeta
from ferrymq.errors import (
    CorruptRecordError,
    NotCoordinatorError,
    StorageFailureError,
    StorageFullError,
)
from ferrymq.protocol.coordinator import TXN_TOPIC
from ferrymq.protocol.messages import TxnState
from ferrymq.protocol.records import RecordInput, decode_records, encode_batch
from ferrymq.storage.checkpoint import read_checkpoint, write_checkpoint

if TYPE_CHECKING:
    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.topics import QueueState, TopicRegistry

log = logging.getLogger("ferrymq.broker")

SNAPSHOT_INTERVAL_S = 1.0
READ_BYTES = 1 << 20
SNAPSHOT_PART_BYTES = 256 * 1024
"""About the most bytes of one SNAPSHOT record (more parts when there are many ids)."""


def meta_record(meta: TxnMeta) -> dict[str, Any]:
    """The ``%TXN%state`` record (and snapshot entry) of a tid's state."""
    return {
        "t": "TXN", "tid": meta.tid, "pid": meta.pid, "epoch": meta.epoch,
        "state": int(meta.state), "timeout_ms": meta.timeout_ms,
        "started_ms": meta.started_ms, "updated_ms": meta.updated_ms,
        "queues": [list(q) for q in meta.queues],
        "offsets": {g: [[t, q, o] for (t, q), o in offs.items()]
                    for g, offs in meta.offsets.items()},
        "sink": list(meta.sink) if meta.sink else None, "ttl_ms": meta.ttl_ms,
        "staged_ms": meta.staged_ms, "bumped_by": meta.bumped_by,
    }


def meta_from_record(d: dict[str, Any]) -> TxnMeta:
    """Inverse of :func:`meta_record`.

    Raises:
        KeyError, ValueError, TypeError: not a TXN record.
    """
    sink = d.get("sink")
    return TxnMeta(
        str(d["tid"]), int(d["pid"]), int(d["epoch"]), TxnState(int(d["state"])),
        int(d["timeout_ms"]), int(d["started_ms"]), int(d["updated_ms"]),
        {(str(t), int(q)): None for t, q in d["queues"]},
        {str(g): {(str(t), int(q)): int(o) for t, q, o in offs}
         for g, offs in d["offsets"].items()},
        (str(sink[0]), int(sink[1])) if sink else None, int(d["ttl_ms"]),
        int(d["staged_ms"]), str(d["bumped_by"]),
    )


def sink_record(sink_id: str, batch_id: int, at_ms: int,
                members: list[tuple[str, int, int]]) -> dict[str, Any]:
    """The SinkCommit record: the decision of a sink batch's staged members."""
    return {"t": "SINK", "sink_id": sink_id, "batch_id": batch_id, "at_ms": at_ms,
            "members": [[t, p, e] for t, p, e in members]}


def apply_record(book: TxnBook, d: dict[str, Any]) -> None:
    """Feed one state record to ``book`` (replay).

    Raises:
        KeyError, ValueError, TypeError: not a state record.
    """
    if d["t"] == "TXN":
        book.put(meta_from_record(d))
    elif d["t"] == "SINK":
        book.commit_sink(str(d["sink_id"]), int(d["batch_id"]), int(d["at_ms"]),
                         ((t, p, e) for t, p, e in d["members"]))


@dataclass
class StateReplay:
    """What the records of ``%TXN%state`` add up to, read incrementally (a coordinator's
    rebuild; a cluster coordinator's compaction, kept at the high watermark). See the module
    docstring for snapshots.

    Attributes:
        book: the state so far.
        position: the next offset to read.
        applied: records applied so far.
    """

    book: TxnBook = field(default_factory=TxnBook)
    position: int = 0
    applied: int = 0
    _set_at: dict[str, int] = field(default_factory=dict)
    """Tid -> offset of the record that last set its state."""
    _sink_at: dict[str, int] = field(default_factory=dict)
    """Sink id -> offset of the record that last moved its fence."""
    _parts: list[dict[str, Any]] = field(default_factory=list)
    """The parts of the snapshot being read, in order."""

    def advance(self, qs: QueueState, upto: int) -> None:
        """Apply the records of ``qs`` from :attr:`position` (or the log's start, if later) up
        to ``upto``. A damaged batch stops the replay there (logged)."""
        pos = max(self.position, qs.log.start_offset)
        while pos < upto:
            data = qs.log.read(pos, READ_BYTES)
            if not data:
                break
            try:
                recs = decode_records(data)
            except CorruptRecordError as exc:
                log.warning("transactions: unreadable state record at %d: %s", pos, exc)
                break
            nxt = pos
            for rec in recs:
                if rec.offset >= upto:
                    break
                nxt = rec.offset + 1
                if rec.offset < pos:
                    continue
                try:
                    self._apply(msgpack.unpackb(rec.body, raw=False, strict_map_key=False),
                                rec.offset)
                    self.applied += 1
                except (KeyError, ValueError, TypeError, AttributeError) as exc:
                    log.warning("transactions: bad state record at %d: %s", rec.offset, exc)
            if nxt <= pos:
                break
            pos = nxt
        self.position = max(self.position, pos)

    def _apply(self, d: dict[str, Any], offset: int) -> None:
        t = d["t"]
        if t == "SNAPSHOT":
            self._snapshot_part(d)
            return
        apply_record(self.book, d)
        if t == "TXN":
            self._set_at[str(d["tid"])] = offset
        elif t == "SINK":
            self._sink_at[str(d["sink_id"])] = offset
            for tid, _pid, _epoch in d["members"]:
                self._set_at[str(tid)] = offset

    def _snapshot_part(self, d: dict[str, Any]) -> None:
        i, n, upto = int(d["i"]), int(d["n"]), int(d["upto"])
        if i == 0:
            self._parts = [d]
        elif (self._parts and int(self._parts[-1]["i"]) == i - 1
              and int(self._parts[-1]["upto"]) == upto):
            self._parts.append(d)
        else:
            self._parts = []  # a part is missing: this snapshot is not used
            return
        if len(self._parts) == n:
            parts, self._parts = self._parts, []
            self._merge(parts, upto)

    def _merge(self, parts: list[dict[str, Any]], upto: int) -> None:
        """The snapshot says what the records below ``upto`` add up to."""
        book = self.book
        for meta in list(book.txns.values()):
            if self._set_at.get(meta.tid, -1) < upto:
                book.forget(meta)
                self._set_at.pop(meta.tid, None)
        for sink in list(book.sinks):
            if self._sink_at.get(sink, -1) < upto:
                del book.sinks[sink]
                self._sink_at.pop(sink, None)
        for part in parts:
            for rec in part["txns"]:
                if self._set_at.get(str(rec["tid"]), -1) < upto:
                    book.put(meta_from_record(rec))
            for sink, batch, at in part["sinks"]:
                if self._sink_at.get(str(sink), -1) < upto:
                    book.sinks[str(sink)] = (int(batch), int(at))

    def snapshot_records(self, now_ms: int, expiration_ms: int) -> list[dict[str, Any]]:
        """The SNAPSHOT records of the state so far (as of :attr:`position`), ids idle for
        ``expiration_ms`` left out (Kafka's ``transactional.id.expiration.ms``)."""
        upto = self.position
        txns = [meta_record(m) for m in self.book.txns.values()
                if not TxnBook.idle(m, now_ms, expiration_ms)]
        sinks = [[sid, b, a] for sid, (b, a) in self.book.sinks.items()]
        parts: list[dict[str, Any]] = []
        cur: dict[str, Any] = {"txns": [], "sinks": []}
        size = 0
        for kind, items in (("txns", txns), ("sinks", sinks)):
            for item in items:
                n = len(msgpack.packb(item, use_bin_type=True))
                if size and size + n > SNAPSHOT_PART_BYTES:
                    parts.append(cur)
                    cur, size = {"txns": [], "sinks": []}, 0
                cur[kind].append(item)
                size += n
        parts.append(cur)
        return [{"t": "SNAPSHOT", "upto": upto, "i": i, "n": len(parts), **p}
                for i, p in enumerate(parts)]


class StateLog:
    """``%TXN%state`` and the snapshot: records appended (and waited for), read back.

    Args:
        topics: the registry (the topic is created there on first use).
        flusher: marks appends dirty, says whether the queue may be written.
        clock: timestamps of records; snapshot pacing.
        data_dir: the broker's data directory (``meta/txn_coordinator`` under it).
        sync: ``flush == "sync"``: waits are for fsyncs (async mode: for the write).
        busy_retry_after_ms: the retry-after of a STORAGE_FULL answer.
    """

    def __init__(self, topics: TopicRegistry, flusher: Flusher, clock: Clock, data_dir: Path,
                 *, sync: bool, busy_retry_after_ms: int) -> None:
        self.topics = topics
        self.flusher = flusher
        self.clock = clock
        self.sync = sync
        self.busy_retry_after_ms = busy_retry_after_ms
        self.snapshot_path = data_dir / "meta" / "txn_coordinator"
        self.snap_offset = 0
        self.dirty = False
        self._last_snapshot = 0.0
        self.cluster = False
        """A cluster's coordinator: the topic is replicated, writes wait for its HW."""

    @property
    def exists(self) -> bool:
        """Whether ``%TXN%state`` was ever created."""
        return TXN_TOPIC in self.topics.topics

    @property
    def queue(self) -> QueueState:
        """``%TXN%state``'s one queue (created on first use)."""
        topic = self.topics.topics.get(TXN_TOPIC)
        if topic is None:
            if self.cluster:
                raise NotCoordinatorError(f"{TXN_TOPIC} does not exist yet; retry")
            topic = self.topics.create(TXN_TOPIC, 1, {}, self.clock.wall_ms(), internal_ok=True)
        return topic.queues[0]

    # -- writing -----------------------------------------------------------------------------------

    def write(self, rec: dict[str, Any], key: str) -> int:
        """Append one record; the end offset to wait for (:meth:`durable`).

        Raises:
            StorageFullError, StorageFailureError: as :meth:`append`.
        """
        now = self.clock.wall_ms()
        body = bytes(msgpack.packb(rec, use_bin_type=True))
        batch = encode_batch([RecordInput(body, now, rec["t"].encode(), b"", key.encode())])
        end = self.append(self.queue, batch, now, "the transaction log")
        self.dirty = True
        return end

    def save(self, meta: TxnMeta) -> int:
        """Record ``meta``'s state (stamped now); the end offset to wait for."""
        meta.updated_ms = self.clock.wall_ms()
        return self.write(meta_record(meta), meta.tid)

    def append(self, qs: QueueState, batch: bytes | bytearray, now: int, what: str) -> int:
        """Append a batch the coordinator built (a record, a marker); the end offset to wait
        for.

        Raises:
            StorageFullError: the disk is full (nothing written).
            StorageFailureError: the queue had an fsync failure (restart needed), or the write
                failed otherwise.
            NotLeaderError: a cluster's queue this broker does not lead.
        """
        qs.check_own_write()
        self.flusher.check_writable(qs)
        try:
            res = qs.log.append(batch, now_ms=now)
        except OSError as exc:
            raise self.flusher.write_error(exc, f"{what} to {qs}") from None
        self.flusher.mark_dirty(qs)
        if not self.sync or qs.replica is not None:  # a replica role wakes its followers
            qs.advance(qs.log.end_offset)
        return res.last_offset + 1

    async def durable(self, qs: QueueState, end: int) -> None:
        """Wait until ``qs`` is durable up to ``end`` (sync flush mode; async: written; a
        cluster's replicated queue: until its high watermark covers ``end``).

        Raises:
            StorageFullError: not fsynced for lack of space (retriable).
            StorageFailureError: the fsync failed otherwise.
            BusyError: postponed for lack of descriptors.
            NotLeaderError, NotEnoughReplicasError, RequestTimedOutError: a cluster's queue
                not replicated.
        """
        if qs.replica is not None:
            await replicated(qs.replica, end)
            return
        if not self.sync:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def done(exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is None:
                fut.set_result(None)
            elif isinstance(exc, StorageFullError):
                fut.set_exception(StorageFullError(
                    f"{qs} not fsynced for lack of space: {exc.message}",
                    retry_after_ms=self.busy_retry_after_ms))
            elif flush_postponed(exc):
                fut.set_exception(exc)
            else:
                fut.set_exception(StorageFailureError(f"{qs} not fsynced: {exc}"))

        qs.when_durable(end, done)
        await fut

    async def save_durable(self, meta: TxnMeta) -> None:
        """:meth:`save` and wait until it is durable."""
        await self.durable(self.queue, self.save(meta))

    # -- start-up ----------------------------------------------------------------------------------

    def replay_all(self, book: TxnBook) -> StateReplay:
        """Fill ``book`` (empty) from the whole log (a cluster's new coordinator); the replay,
        at the log's end."""
        r = StateReplay(book)
        if self.exists:
            self._replay(r, self.queue.log.start_offset)
        return r

    def load(self, book: TxnBook) -> None:
        """Fill ``book`` from the snapshot and the records after it."""
        start = 0
        raw: bytes | None = None
        try:
            raw = read_checkpoint(self.snapshot_path)
        except (CorruptRecordError, OSError) as exc:
            log.warning("transactions: snapshot unreadable (%s); replaying the whole log", exc)
        if raw is not None:
            try:
                snap = msgpack.unpackb(raw, raw=False, strict_map_key=False)
                for d in snap["txns"]:
                    book.put(meta_from_record(d))
                book.sinks = {str(s): (int(b), int(a)) for s, b, a in snap["sinks"]}
                start = int(snap["offset"])
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("transactions: snapshot unusable (%s); replaying the whole log", exc)
                book.clear()
                start = 0
        if self.exists:
            self._replay(StateReplay(book), max(start, self.queue.log.start_offset))
        self.snap_offset = start

    def _replay(self, r: StateReplay, start: int) -> None:
        qs = self.queue
        r.position = start
        r.advance(qs, qs.log.end_offset)
        log.info("transactions: replayed %d state records from offset %d: %d transactional ids",
                 r.applied, start, len(r.book.txns))

    # -- the snapshot ------------------------------------------------------------------------------

    def snapshot(self, book: TxnBook, *, force: bool = False) -> None:
        """Write the snapshot if anything changed (at most about once a second) and no
        completion is in flight (its PrepareX must be replayed from the log)."""
        if not self.dirty or not self.exists or self.cluster:
            return
        now = self.clock.monotonic()
        if not force and now - self._last_snapshot < SNAPSHOT_INTERVAL_S:
            return
        if any(t.completing for t in book.txns.values()):
            return
        self._last_snapshot = now
        offset = self.queue.log.end_offset
        data = {"offset": offset, "txns": [meta_record(t) for t in book.txns.values()],
                "sinks": [[s, b, a] for s, (b, a) in book.sinks.items()]}
        try:
            write_checkpoint(self.snapshot_path, msgpack.packb(data, use_bin_type=True))
        except OSError as exc:
            log.error("transactions: cannot write the snapshot: %s", exc)
            return
        self.snap_offset = offset
        self.dirty = False

    def retention_floors(self) -> dict[tuple[int, int], int]:
        """The state log must be kept from the snapshot's offset."""
        if not self.exists:
            return {}
        qs = self.queue
        # a cluster's log is compacted by its coordinator (snapshot records, then
        # Log.delete_before), never by retention: a follower's copy must hold what it holds
        return {(qs.topic_id, qs.queue): 0 if self.cluster else self.snap_offset}
