"""The half topic ``%HALF%transactions`` and its floor checkpoint: appends, reads and searches.

Half messages and their op records are appended to the half topic's one queue (created on first
use: a broker that never saw a half message lists no half topic). The *floor* checkpoint
(``<data-dir>/transactions/floor``) says where a start reads it from: below it every half
message is resolved. This module does the I/O; what the records mean is :mod:`.state`'s.
In a cluster (:attr:`HalfLog.cluster`) the half topic is a replicated cluster topic, created
through the metadata store (:mod:`.cluster`), never here, and written only by its leader.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ferrymq._time import Clock
from ferrymq.broker.delivery.letters import StoredRecord, stored_record
from ferrymq.broker.half_messages.state import Outcome, outcome_of
from ferrymq.errors import (
    BrokerError,
    CorruptRecordError,
    InvalidRequestError,
    LogClosedError,
    NotCoordinatorError,
)
from ferrymq.protocol.half_messages import (
    HALF_GROUP,
    HALF_OFFSET,
    HALF_OP,
    HALF_TARGET_QUEUE,
    HALF_TARGET_TOPIC,
    HALF_TOPIC,
)
from ferrymq.protocol.records import (
    RecordInput,
    encode_batch,
    encode_properties,
    iter_batches,
    iter_raw_records,
)
from ferrymq.storage.checkpoint import read_checkpoint, write_checkpoint

if TYPE_CHECKING:
    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.topics import QueueState, TopicRegistry
    from ferrymq.storage.log import AppendResult

log = logging.getLogger("ferrymq.broker")

READ_BYTES = 1 << 20
"""Half-topic bytes read per step when rebuilding or looking up an old outcome."""
MAX_LOOKUP_BYTES = 64 << 20
"""An outcome not in memory is searched for in at most this many bytes of the half topic."""
_FLOOR = struct.Struct(">q")


class HalfLog:
    """The half topic's queue, seen by the half-message manager.

    Args:
        topics: the registry (the half topic is created there on first use).
        flusher: marks appends dirty and says whether the queue may be written.
        clock: wall-clock time of new topics.
        data_dir: the broker's data directory (the floor checkpoint is under it).
        sync: ``flush == "sync"`` (async mode makes appends visible at once).
    """

    def __init__(self, topics: TopicRegistry, flusher: Flusher, clock: Clock, data_dir: Path,
                 *, sync: bool) -> None:
        self.topics = topics
        self.flusher = flusher
        self.clock = clock
        self.sync = sync
        self.dir = data_dir / "transactions"
        self.cluster = False
        """A cluster's: the topic is replicated; appends wake the followers."""

    @property
    def exists(self) -> bool:
        """Whether the half topic was ever created."""
        return HALF_TOPIC in self.topics.topics

    @property
    def queue(self) -> QueueState:
        """The half topic's one queue (created on first use)."""
        topic = self.topics.topics.get(HALF_TOPIC)
        if topic is None:
            if self.cluster:
                raise NotCoordinatorError(f"{HALF_TOPIC} does not exist yet; retry")
            topic = self.topics.create(HALF_TOPIC, 1, {}, self.clock.wall_ms(), internal_ok=True)
        return topic.queues[0]

    # -- the floor checkpoint --------------------------------------------------------------------

    def read_floor(self) -> int:
        """The checkpointed floor (0 when there is none or it is unreadable)."""
        try:
            raw = read_checkpoint(self.dir / "floor")
            if raw is not None and len(raw) == _FLOOR.size:
                return int(_FLOOR.unpack(raw)[0])
        except (CorruptRecordError, OSError) as exc:
            log.warning("half messages: floor checkpoint unreadable (%s); reading the whole half "
                        "topic", exc)
        return 0

    def write_floor(self, floor: int) -> bool:
        """Checkpoint ``floor``; False (logged) when it could not be written."""
        try:
            write_checkpoint(self.dir / "floor", _FLOOR.pack(floor))
        except OSError as exc:
            log.error("half messages: cannot write the floor checkpoint: %s", exc)
            return False
        return True

    # -- writing -----------------------------------------------------------------------------------

    def append_half(self, batch: bytes | bytearray, now: int) -> AppendResult:
        """Append a half message (nothing stored when it raises).

        Raises:
            StorageFullError, StorageFailureError, BusyError: the queue cannot be written.
        """
        qs = self.queue
        qs.check_own_write()
        self.flusher.check_writable(qs)
        try:
            return qs.log.append(batch, now_ms=now)
        except OSError as exc:  # nothing was stored (the segment cut the file back)
            raise self.write_error(exc) from None

    def append_op(self, props: dict[str, str], now: int) -> bool:
        """Append one op record; False when it could not be written."""
        qs = self.queue
        if qs in self.flusher.failed or qs in self.flusher.full:
            return False
        try:
            qs.check_own_write()
        except BrokerError as exc:
            log.warning("half messages: cannot write an op record to %s: %s", qs, exc)
            return False
        try:
            qs.log.append(encode_batch([RecordInput(b"", now, properties=encode_properties(props))]),
                          now_ms=now)
        except OSError as exc:
            self.write_error(exc)
            log.warning("half messages: cannot write an op record to %s: %s", qs, exc)
            return False
        except (BrokerError, LogClosedError) as exc:
            log.warning("half messages: cannot write an op record to %s: %s", qs, exc)
            return False
        self.written(qs)
        return True

    def written(self, qs: QueueState) -> None:
        """``qs`` was appended to: the flusher fsyncs it; async mode shows it at once."""
        self.flusher.mark_dirty(qs)
        if not self.sync or qs.replica is not None:  # a replica role wakes its followers
            qs.advance(qs.log.end_offset)

    def write_error(self, exc: OSError) -> BrokerError:
        """The error to answer for a failed write (the watermarks hear of a full disk)."""
        return self.flusher.write_error(exc, "the half message's record")

    # -- reading -----------------------------------------------------------------------------------

    def find_outcome(self, off: int) -> Outcome | None:
        """The outcome of the half message at ``off`` as its op record says (searched for in at
        most :data:`MAX_LOOKUP_BYTES`); None when it has none (or is no half message)."""
        qs = self.queue
        if not qs.log.start_offset <= off < qs.log.end_offset:
            return None
        half: dict[str, str] | None = None
        for o, append_ms, rec in self.scan(off, MAX_LOOKUP_BYTES):
            props = rec.properties
            if o == off:
                if HALF_OP in props:
                    return None
                half = props
            elif half is not None and props.get(HALF_OFFSET) == str(off):
                return outcome_of(half.get(HALF_GROUP, ""), half.get(HALF_TARGET_TOPIC, ""),
                                  int(half.get(HALF_TARGET_QUEUE, "-1") or -1), props, append_ms)
        return None

    def read_half(self, off: int) -> StoredRecord:
        """The half message at ``off``.

        Raises:
            CorruptRecordError, OffsetOutOfRangeError, LogClosedError: it cannot be read.
        """
        for o, _ms, rec in self.scan(off, 1, step=1):  # just the batch holding it
            if o == off:
                return rec
            break
        raise CorruptRecordError(f"half message at offset {off} not found")

    def scan(self, start: int, max_bytes: int | None, *,
             step: int = READ_BYTES) -> Iterator[tuple[int, int, StoredRecord]]:
        """``(offset, append time, record)`` from ``start`` to the end (or ``max_bytes``),
        reading ``step`` bytes at a time (at least one batch)."""
        qs = self.queue
        pos = start
        read = 0
        while pos < qs.log.end_offset and (max_bytes is None or read < max_bytes):
            data = qs.log.read(pos, step)
            if not data:
                return
            read += len(data)
            mv = memoryview(data)
            nxt = pos
            for p, hdr in iter_batches(mv):
                nxt = hdr.last_offset + 1
                try:
                    for rec in iter_raw_records(mv, p, hdr):
                        if rec[0] >= pos:
                            yield rec[0], hdr.append_time_ms, stored_record(mv, rec)
                except CorruptRecordError as exc:
                    log.warning("half messages: %s batch at %d unreadable: %s", qs,
                                hdr.base_offset, exc)
            if nxt <= pos:
                return
            pos = nxt


def first_record(batch: bytes | bytearray | memoryview) -> StoredRecord:
    """The record of a one-record batch.

    Raises:
        InvalidRequestError: it holds none.
    """
    mv = memoryview(batch)
    for p, hdr in iter_batches(mv):
        for rec in iter_raw_records(mv, p, hdr):
            return stored_record(mv, rec)
    raise InvalidRequestError("a half message batch holds exactly one record")
