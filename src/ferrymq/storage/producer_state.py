"""Idempotent-producer state of one log: fencing, duplicate and gap detection.

Theory of operation (Kafka ``ProducerStateManager``): an idempotent producer stamps each batch
with ``(producer_id, producer_epoch, base_sequence)``; sequences count records per producer and
log. The log remembers, per producer id, the current epoch and the metadata of the last
``PRODUCER_BATCHES_CACHED`` batches. For a batch with ``producer_id >= 0``:

- epoch below the current one: a zombie, :class:`ProducerFencedError`;
- epoch above the current one: the producer restarted; it must start again at sequence 0
  (else :class:`OutOfOrderSequenceError`) and its old state is replaced;
- same epoch: a batch whose ``(first_seq, last_seq)`` equals a cached one is a retry of a batch
  already stored: the caller answers with the cached offsets and writes nothing; a batch that
  starts right after the last sequence is accepted; anything else is a gap or a reordering:
  :class:`OutOfOrderSequenceError` (expected vs got);
- unknown producer id: any first sequence is accepted and tracking starts.

``producer_id == -1`` means not idempotent: no checks. The state is a cache of the batch
headers in the log: it is snapshotted to ``{offset:020d}.snapshot`` (a checkpoint file holding
msgpack) at segment roll and at close, and rebuilt on open by loading the latest readable
snapshot and replaying the batch headers after it. Producers whose last batch is older than
``producer_id_expiry_ms`` are forgotten, unless a transaction of theirs is open.

Transactions (docs/design-read-process-write.md §4). A producer's *open transaction* starts at
its first data batch with attribute bit 4 (``ATTR_TRANSACTIONAL``) while none is open: that
batch's base offset becomes ``ProducerEntry.txn_first_offset`` and
``ProducerStateManager.ongoing[pid]``. A control batch (bit 5, a commit/abort marker written by
the broker) of the producer ends it. Control batches carry no sequence, so they skip the
sequence checks and are never cached as batches; one with an older epoch is fenced like a data
batch, one with a newer epoch replaces the entry (empty batch list), so the producer's next
data batch of that epoch starts at sequence 0. A data batch with a newer epoch keeps the open
transaction (only a marker ends one).

Snapshot payload (msgpack)::

    {"version": 2, "producers": [[producer_id, epoch, last_append_time_ms, txn_first_offset,
                                  [[first_seq, last_seq, base_offset, last_offset,
                                    append_time_ms], ...]], ...]}

Version 1 (before transactions) lacks ``txn_first_offset``; it is still read, as -1.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from ferrymq.errors import CorruptRecordError, OutOfOrderSequenceError, ProducerFencedError
from ferrymq.protocol.records import ATTR_CONTROL, ATTR_TRANSACTIONAL, BatchHeader
from ferrymq.storage.checkpoint import read_checkpoint, write_checkpoint
from ferrymq.storage.files import SNAPSHOT_SUFFIX, parse_base_offset, segment_file_name

__all__ = [
    "DEFAULT_PRODUCER_ID_EXPIRY_MS",
    "PRODUCER_BATCHES_CACHED",
    "NO_TXN",
    "SNAPSHOTS_KEPT",
    "SNAPSHOT_VERSION",
    "BatchMetadata",
    "ProducerEntry",
    "ProducerStateManager",
]

PRODUCER_BATCHES_CACHED = 5  # a producer has at most 5 batches in flight (Kafka's limit)
SNAPSHOTS_KEPT = 2  # the newest, plus one in case the newest is unreadable
DEFAULT_PRODUCER_ID_EXPIRY_MS = 7 * 24 * 3600 * 1000
SNAPSHOT_VERSION = 2
NO_TXN = -1  # txn_first_offset of a producer without an open transaction
_TXN_BITS = ATTR_TRANSACTIONAL | ATTR_CONTROL

_log = logging.getLogger("ferrymq.storage")


@dataclass(frozen=True, slots=True)
class BatchMetadata:
    """What is remembered of one stored batch of an idempotent producer."""

    first_seq: int
    last_seq: int
    base_offset: int
    last_offset: int
    append_time_ms: int


@dataclass(slots=True)
class ProducerEntry:
    """State of one producer id: its epoch, its last batches (oldest first) and the first
    offset of its open transaction (``NO_TXN``: none)."""

    epoch: int
    last_append_time_ms: int
    batches: deque[BatchMetadata] = field(default_factory=lambda: deque(maxlen=PRODUCER_BATCHES_CACHED))
    txn_first_offset: int = NO_TXN

    @property
    def last_seq(self) -> int:
        """Sequence of the last record stored, or -1."""
        return self.batches[-1].last_seq if self.batches else -1


class ProducerStateManager:
    """Producer states of one log and their snapshots in ``directory``."""

    def __init__(self, directory: Path, *, producer_id_expiry_ms: int) -> None:
        """Empty state; call :meth:`load_snapshot` and replay headers to rebuild it."""
        self.directory = directory
        self.producer_id_expiry_ms = producer_id_expiry_ms
        self.producers: dict[int, ProducerEntry] = {}
        self.ongoing: dict[int, int] = {}
        """Open transactions: producer id -> first offset (mirrors ``txn_first_offset``)."""

    @property
    def entries(self) -> Mapping[int, ProducerEntry]:
        """The producer entries by producer id (read-only view of :attr:`producers`)."""
        return self.producers

    # --- rules -------------------------------------------------------------------------------

    def check(self, h: BatchHeader) -> BatchMetadata | None:
        """Check a producer batch before it is written.

        A control batch (bit 5) is checked for fencing only: it carries no sequence.

        Returns:
            The cached metadata when the batch is a duplicate of a stored one, else None.

        Raises:
            ProducerFencedError: the epoch is older than the producer's current epoch.
            OutOfOrderSequenceError: the sequence does not follow the last stored one.
        """
        pid = h.producer_id
        if pid < 0:
            return None
        entry = self.producers.get(pid)
        if entry is None:
            return None
        if h.producer_epoch < entry.epoch:
            raise ProducerFencedError(
                f"producer {pid} epoch {h.producer_epoch} is fenced by epoch {entry.epoch}"
            )
        # Control batches are told apart only on the rare branches below, so that an accepted
        # data batch pays no extra test here.
        if h.producer_epoch > entry.epoch:
            if h.base_sequence != 0 and not h.attributes & ATTR_CONTROL:
                raise OutOfOrderSequenceError(
                    f"producer {pid} new epoch {h.producer_epoch}: expected sequence 0, got {h.base_sequence}"
                )
            return None
        first, last = h.base_sequence, h.last_sequence
        for cached in entry.batches:
            if cached.first_seq == first and cached.last_seq == last:
                return None if h.attributes & ATTR_CONTROL else cached
        expected = entry.last_seq + 1
        if first != expected and not h.attributes & ATTR_CONTROL:
            raise OutOfOrderSequenceError(
                f"producer {pid} epoch {h.producer_epoch}: expected sequence {expected}, got {first}"
            )
        return None

    def update(self, h: BatchHeader) -> None:
        """Record a stored (stamped) batch; also used to replay the log without checks."""
        if h.producer_id < 0:
            return
        if h.attributes & _TXN_BITS:
            self.update_txn(h)
        else:
            self.update_plain(h)

    def update_plain(self, h: BatchHeader) -> None:
        """:meth:`update` for a batch the caller knows has neither bit 4 nor bit 5 set.

        ``Log.append``'s fast path: it has tested the attributes already.
        """
        pid = h.producer_id
        if pid < 0:
            return
        entry = self.producers.get(pid)
        if entry is None or entry.epoch != h.producer_epoch:
            first = entry.txn_first_offset if entry is not None else NO_TXN
            entry = ProducerEntry(h.producer_epoch, h.append_time_ms, txn_first_offset=first)
            self.producers[pid] = entry
        entry.batches.append(
            BatchMetadata(h.base_sequence, h.last_sequence, h.base_offset, h.last_offset, h.append_time_ms)
        )
        entry.last_append_time_ms = max(entry.last_append_time_ms, h.append_time_ms)

    def update_txn(self, h: BatchHeader) -> None:
        """:meth:`update` for a transactional data batch (bit 4) or a control batch (bit 5).

        A data batch opens the producer's transaction at its base offset unless one is open;
        a control batch ends it (and, with a newer epoch, replaces the entry).
        """
        pid = h.producer_id
        if pid < 0:
            return
        if not h.attributes & ATTR_CONTROL:
            self.update_plain(h)
            data_entry = self.producers[pid]
            if data_entry.txn_first_offset < 0:
                data_entry.txn_first_offset = h.base_offset
                self.ongoing[pid] = h.base_offset
            return
        entry = self.producers.get(pid)
        if entry is None or entry.epoch != h.producer_epoch:
            entry = ProducerEntry(h.producer_epoch, h.append_time_ms)
            self.producers[pid] = entry
        entry.txn_first_offset = NO_TXN
        self.ongoing.pop(pid, None)
        entry.last_append_time_ms = max(entry.last_append_time_ms, h.append_time_ms)

    def remove_expired(self, now_ms: int) -> int:
        """Forget producers whose last batch is older than the expiry; return how many.

        A producer with an open transaction is kept whatever its age.
        """
        limit = now_ms - self.producer_id_expiry_ms
        expired = [
            pid
            for pid, e in self.producers.items()
            if e.last_append_time_ms < limit and e.txn_first_offset < 0
        ]
        for pid in expired:
            del self.producers[pid]
        return len(expired)

    def set_producers(self, producers: dict[int, ProducerEntry]) -> None:
        """Replace the whole state (e.g. with a snapshot's, from :meth:`read_snapshot`)."""
        self.producers = producers
        self.ongoing = {
            pid: e.txn_first_offset for pid, e in producers.items() if e.txn_first_offset >= 0
        }

    # --- snapshots ---------------------------------------------------------------------------

    def snapshot_offsets(self) -> list[int]:
        """Offsets of the snapshot files present, ascending."""
        found = []
        for path in self.directory.iterdir():
            if path.name.endswith(SNAPSHOT_SUFFIX):
                offset = parse_base_offset(path.name)
                if offset is not None:
                    found.append(offset)
        return sorted(found)

    def _path(self, offset: int) -> Path:
        return self.directory / segment_file_name(offset, SNAPSHOT_SUFFIX)

    def take_snapshot(self, offset: int, *, keep_at_or_below: int | None = None) -> None:
        """Write the state as of ``offset`` (the log end) and drop old snapshots.

        The newest ``SNAPSHOTS_KEPT`` are kept and, when ``keep_at_or_below`` is given, also
        the newest one at or below it (the log passes the base of the segment holding its
        recovery point: unclean recovery rebuilds aborted-transaction indexes from there).
        """
        producers = [
            [
                pid,
                e.epoch,
                e.last_append_time_ms,
                e.txn_first_offset,
                [
                    [b.first_seq, b.last_seq, b.base_offset, b.last_offset, b.append_time_ms]
                    for b in e.batches
                ],
            ]
            for pid, e in self.producers.items()
        ]
        payload = msgpack.packb({"version": SNAPSHOT_VERSION, "producers": producers})
        write_checkpoint(self._path(offset), payload)
        offsets = self.snapshot_offsets()
        keep = set(offsets[-SNAPSHOTS_KEPT:])
        if keep_at_or_below is not None:
            floor = [o for o in offsets if o <= keep_at_or_below]
            if floor:
                keep.add(floor[-1])
        for old in offsets:
            if old not in keep:
                self._path(old).unlink(missing_ok=True)

    def delete_snapshots_after(self, offset: int) -> None:
        """Delete snapshots taken at offsets above ``offset`` (after a truncation)."""
        for snap in self.snapshot_offsets():
            if snap > offset:
                self._path(snap).unlink(missing_ok=True)

    def load_snapshot(self, end_offset: int) -> int:
        """Load the newest readable snapshot at or below ``end_offset``.

        Returns:
            The snapshot's offset (replay headers from there), or -1 when there is none (the
            state is empty: replay the whole log).
        """
        self.set_producers({})
        self.delete_snapshots_after(end_offset)
        offset, producers = self.read_snapshot(end_offset)
        self.set_producers(producers)
        return offset

    def read_snapshot(self, at_or_below: int) -> tuple[int, dict[int, ProducerEntry]]:
        """The newest readable snapshot at or below ``at_or_below``, without loading it or
        deleting anything.

        Returns:
            ``(offset, producers)``, or ``(-1, {})`` when there is none.
        """
        for offset in reversed(self.snapshot_offsets()):
            if offset > at_or_below:
                continue
            try:
                payload = read_checkpoint(self._path(offset))
                if payload is None:
                    continue
                return offset, _decode_snapshot(payload)
            except CorruptRecordError as exc:
                _log.warning("ignoring unreadable producer snapshot %s: %s", self._path(offset), exc)
        return -1, {}


def _decode_snapshot(payload: bytes) -> dict[int, ProducerEntry]:
    try:
        doc: Any = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        version = doc.get("version") if isinstance(doc, dict) else None
        if version not in (1, SNAPSHOT_VERSION):
            raise CorruptRecordError("producer snapshot: unknown version")
        out: dict[int, ProducerEntry] = {}
        for row in doc["producers"]:
            if version == 1:
                pid, epoch, last_time, batches = row
                txn_first = NO_TXN
            else:
                pid, epoch, last_time, txn_first, batches = row
            entry = ProducerEntry(int(epoch), int(last_time), txn_first_offset=max(int(txn_first), NO_TXN))
            for fs, ls, bo, lo, t in batches:
                entry.batches.append(BatchMetadata(int(fs), int(ls), int(bo), int(lo), int(t)))
            out[int(pid)] = entry
        return out
    except CorruptRecordError:
        raise
    except Exception as exc:  # noqa: BLE001 - msgpack and unpacking raise many types
        raise CorruptRecordError(f"producer snapshot: bad payload: {exc}") from None
