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
``producer_id_expiry_ms`` are forgotten.

Snapshot payload (msgpack)::

    {"version": 1, "producers": [[producer_id, epoch, last_append_time_ms,
                                  [[first_seq, last_seq, base_offset, last_offset,
                                    append_time_ms], ...]], ...]}
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from ferrymq.errors import CorruptRecordError, OutOfOrderSequenceError, ProducerFencedError
from ferrymq.protocol.records import BatchHeader
from ferrymq.storage.checkpoint import read_checkpoint, write_checkpoint
from ferrymq.storage.files import SNAPSHOT_SUFFIX, parse_base_offset, segment_file_name

__all__ = [
    "DEFAULT_PRODUCER_ID_EXPIRY_MS",
    "PRODUCER_BATCHES_CACHED",
    "SNAPSHOTS_KEPT",
    "BatchMetadata",
    "ProducerEntry",
    "ProducerStateManager",
]

PRODUCER_BATCHES_CACHED = 5  # a producer has at most 5 batches in flight (Kafka's limit)
SNAPSHOTS_KEPT = 2  # the newest, plus one in case the newest is unreadable
DEFAULT_PRODUCER_ID_EXPIRY_MS = 7 * 24 * 3600 * 1000
SNAPSHOT_VERSION = 1

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
    """State of one producer id: its epoch and its last batches (oldest first)."""

    epoch: int
    last_append_time_ms: int
    batches: deque[BatchMetadata] = field(default_factory=lambda: deque(maxlen=PRODUCER_BATCHES_CACHED))

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

    # --- rules -------------------------------------------------------------------------------

    def check(self, h: BatchHeader) -> BatchMetadata | None:
        """Check a producer batch before it is written.

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
        if h.producer_epoch > entry.epoch:
            if h.base_sequence != 0:
                raise OutOfOrderSequenceError(
                    f"producer {pid} new epoch {h.producer_epoch}: expected sequence 0, got {h.base_sequence}"
                )
            return None
        first, last = h.base_sequence, h.last_sequence
        for cached in entry.batches:
            if cached.first_seq == first and cached.last_seq == last:
                return cached
        expected = entry.last_seq + 1
        if first != expected:
            raise OutOfOrderSequenceError(
                f"producer {pid} epoch {h.producer_epoch}: expected sequence {expected}, got {first}"
            )
        return None

    def update(self, h: BatchHeader) -> None:
        """Record a stored (stamped) batch; also used to replay the log without checks."""
        pid = h.producer_id
        if pid < 0:
            return
        entry = self.producers.get(pid)
        if entry is None or entry.epoch != h.producer_epoch:
            entry = ProducerEntry(h.producer_epoch, h.append_time_ms)
            self.producers[pid] = entry
        entry.batches.append(
            BatchMetadata(h.base_sequence, h.last_sequence, h.base_offset, h.last_offset, h.append_time_ms)
        )
        entry.last_append_time_ms = max(entry.last_append_time_ms, h.append_time_ms)

    def remove_expired(self, now_ms: int) -> int:
        """Forget producers whose last batch is older than the expiry; return how many."""
        limit = now_ms - self.producer_id_expiry_ms
        expired = [pid for pid, e in self.producers.items() if e.last_append_time_ms < limit]
        for pid in expired:
            del self.producers[pid]
        return len(expired)

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

    def take_snapshot(self, offset: int) -> None:
        """Write the state as of ``offset`` (the log end) and drop old snapshots."""
        producers = [
            [
                pid,
                e.epoch,
                e.last_append_time_ms,
                [
                    [b.first_seq, b.last_seq, b.base_offset, b.last_offset, b.append_time_ms]
                    for b in e.batches
                ],
            ]
            for pid, e in self.producers.items()
        ]
        payload = msgpack.packb({"version": SNAPSHOT_VERSION, "producers": producers})
        write_checkpoint(self._path(offset), payload)
        for old in self.snapshot_offsets()[:-SNAPSHOTS_KEPT]:
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
        self.producers = {}
        self.delete_snapshots_after(end_offset)
        for offset in reversed(self.snapshot_offsets()):
            try:
                payload = read_checkpoint(self._path(offset))
                if payload is None:
                    continue
                self.producers = _decode_snapshot(payload)
            except CorruptRecordError as exc:
                _log.warning("ignoring unreadable producer snapshot %s: %s", self._path(offset), exc)
                continue
            return offset
        return -1


def _decode_snapshot(payload: bytes) -> dict[int, ProducerEntry]:
    try:
        doc: Any = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        if not isinstance(doc, dict) or doc.get("version") != SNAPSHOT_VERSION:
            raise CorruptRecordError("producer snapshot: unknown version")
        out: dict[int, ProducerEntry] = {}
        for pid, epoch, last_time, batches in doc["producers"]:
            entry = ProducerEntry(int(epoch), int(last_time))
            for fs, ls, bo, lo, t in batches:
                entry.batches.append(BatchMetadata(int(fs), int(ls), int(bo), int(lo), int(t)))
            out[int(pid)] = entry
        return out
    except CorruptRecordError:
        raise
    except Exception as exc:  # noqa: BLE001 - msgpack and unpacking raise many types
        raise CorruptRecordError(f"producer snapshot: bad payload: {exc}") from None
