"""A log: one queue's ordered segments, the API the broker uses.

Theory of operation. Offsets are contiguous across segments: segment ``k+1`` starts at the
offset after segment ``k``'s last record. Only the last segment (the *active* one) is appended
to; it rolls when the next batch would make it exceed ``segment_bytes``, when its first batch
is older than ``segment_ms``, or when its offsets would overflow the u32 index field.

Append (single writer, the broker's event-loop thread): the producer-state check runs first
(fenced / out of order raise; a duplicate returns the original :class:`AppendResult` and writes
nothing); then the batch is stamped with ``base_offset = end_offset`` and ``append_time =
max(now_ms, last append time)`` and written with ``os.write``: no user-space buffer, so a batch
acknowledged after :meth:`Log.append` survives ``kill -9`` even before any fsync.

Flush (any thread, typically the broker's flusher): under the short ``_lock`` it snapshots the
active segment, the end offset and the segments sealed since the last flush; it fsyncs them
outside that lock, writes the sealed segments' index files, fsyncs the directory after a roll
and, when whole segments became durable, rewrites the recovery-point checkpoint. Flushes (and
the rare structural operations: retention, truncation, close) are serialised by
``_flush_lock``. Lock order: ``_flush_lock`` then ``_lock``. :attr:`Log.durable_offset` is the
end offset covered by the last completed flush; after :meth:`Log.open` it equals the end
offset.

Descriptors: each segment's ``.log`` is a handle of a :class:`~ferrymq.storage.handles.FileHandles`
cache, which the broker shares between all its logs (:meth:`Log.open` ``handles``); the cache
opens files on use and closes the least recently used idle ones, so a log holds no descriptor
while idle. A flush pins the descriptors it fsyncs; a descriptor with writes not yet fsynced is
never closed by the cache, and a closed one has nothing to fsync.

Reads, retention and truncation must run on the writer thread; only :meth:`Log.flush` and
:attr:`Log.durable_offset` are for other threads.

Transactions (docs/design-read-process-write.md §4). A batch with attribute bit 4 or 5 takes a
separate append path (one attribute test is all a plain batch pays). Control batches (commit
and abort markers, built by the broker's coordinator with
:func:`ferrymq.protocol.markers.encode_marker`) are appended like any batch; the first one in a
segment creates its ``.txnindex`` (so :meth:`Log.has_control` knows), and an ABORT marker for a
producer with an open transaction appends ``(producer_id, first_offset, marker_offset)`` to it.
The producer state tracks the open transactions (:meth:`Log.ongoing_txns`);
:meth:`Log.aborted_txns` reads the segments' entries, kept in memory.

Envelopes (:mod:`ferrymq.protocol.kafka.envelope`): batches of magic 2, Kafka batches stored as
they came, go through every path above like any batch (their header has every field those
read); :meth:`Log.append` also stamps the Kafka batch's base offset. :meth:`Log.read` and
:meth:`Log.read_view` convert the envelopes they return into FerryMQ batches, so readers see
magic 1 only, unless asked for the bytes as ``stored`` (the Kafka port, replication).

Replication (docs/cluster.md). A follower copies the leader's batches with
:meth:`Log.append_replica`: header and bytes unchanged (the leader's offsets and append
times), producer state and transaction index updated as :meth:`Log.append` would. Which leader
epoch wrote which offsets is not in the batches: :attr:`Log.epochs`
(:mod:`ferrymq.storage.epochs`) keeps it beside the log, and is cut with it by
:meth:`Log.truncate_to`, retention and :meth:`Log.open`. A follower whose log ends before the
leader's start begins again there with :meth:`Log.truncate_fully_and_start_at`.

Recovery-point checkpoint payload: ``<qq`` (little-endian): the recovery point (offsets below
it are fsynced) and the largest append time ever stamped (kept so that append times never go
backwards even after retention removed every batch).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

from ferrymq.errors import (
    ConfigError,
    CorruptRecordError,
    LogClosedError,
    OffsetOutOfRangeError,
    UnexpectedAppendOffsetError,
)
from ferrymq.protocol.kafka.envelope import (
    ENVELOPE_MAGIC,
    STAMPED_HEAD_SIZE,
    check_stored,
    stamp,
    to_native,
)
from ferrymq.protocol.markers import marker_of
from ferrymq.protocol.records import (
    ATTR_CONTROL,
    ATTR_TRANSACTIONAL,
    HEADER_SIZE,
    BatchHeader,
    decode_header,
    stamp_batch,
)
from ferrymq.storage.checkpoint import read_checkpoint, write_checkpoint
from ferrymq.storage.epochs import LeaderEpochCache
from ferrymq.storage.files import RECOVERY_POINT_FILE, fsync_directory
from ferrymq.storage.handles import FileHandle, FileHandles
from ferrymq.storage.index import MAX_RELATIVE_OFFSET
from ferrymq.storage.producer_state import DEFAULT_PRODUCER_ID_EXPIRY_MS, ProducerStateManager
from ferrymq.storage.recovery import (
    RecoveryReport,
    fsync_segments,
    load_segments,
    rebuild_txn_indexes,
)
from ferrymq.storage.segment import Segment
from ferrymq.storage.txnindex import AbortedTxn

__all__ = [
    "DEFAULT_INDEX_INTERVAL_BYTES",
    "DEFAULT_RETENTION_MS",
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_SEGMENT_MS",
    "MAX_SEGMENT_BYTES",
    "AppendResult",
    "Log",
    "LogConfig",
    "SegmentInfo",
]

_log = logging.getLogger("ferrymq.storage")

DEFAULT_SEGMENT_BYTES = 1 << 30  # 1 GiB: few files, cheap retention granularity
MAX_SEGMENT_BYTES = 0x7FFFFFFF  # batch positions are u32 in the index; stay well inside
DEFAULT_SEGMENT_MS = 7 * 24 * 3600 * 1000  # a week: retention can free a quiet queue's data
DEFAULT_INDEX_INTERVAL_BYTES = 4096  # one 8-byte entry per 4 KiB of log: 0.2% overhead
DEFAULT_RETENTION_MS = 7 * 24 * 3600 * 1000
DEFAULT_MAX_CONVERTED_BATCH_BYTES = 8 * 1024 * 1024 - 65536  # the broker's max_fetch_bytes
_RECOVERY_POINT = struct.Struct("<qq")
_TXN_BITS = ATTR_TRANSACTIONAL | ATTR_CONTROL


@dataclass(frozen=True, slots=True)
class LogConfig:
    """Per-log storage settings.

    Attributes:
        segment_bytes: roll when the active segment would exceed this.
        segment_ms: roll when the active segment's first batch is older than this.
        index_interval_bytes: bytes of log between two offset-index entries.
        retention_ms: delete sealed segments whose newest batch is older; None keeps forever.
        retention_bytes: delete the oldest sealed segments while the log stays above this;
            None: no size limit.
        producer_id_expiry_ms: forget idempotent producers idle for longer than this.
        max_converted_batch_bytes: most bytes a stored Kafka batch may decompress to when a
            FerryMQ reader reads it (it is converted then); larger is a read error, never an
            allocation. The broker sets its ``max_fetch_bytes``.
    """

    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    segment_ms: int = DEFAULT_SEGMENT_MS
    index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES
    retention_ms: int | None = DEFAULT_RETENTION_MS
    retention_bytes: int | None = None
    producer_id_expiry_ms: int = DEFAULT_PRODUCER_ID_EXPIRY_MS
    max_converted_batch_bytes: int = DEFAULT_MAX_CONVERTED_BATCH_BYTES

    def __post_init__(self) -> None:
        if not 1 <= self.segment_bytes <= MAX_SEGMENT_BYTES:
            raise ConfigError(f"segment_bytes must be in [1, {MAX_SEGMENT_BYTES}]")
        if self.max_converted_batch_bytes < 1:
            raise ConfigError("max_converted_batch_bytes must be >= 1")
        if self.segment_ms < 1 or self.index_interval_bytes < 0 or self.producer_id_expiry_ms < 0:
            raise ConfigError("segment_ms, index_interval_bytes, producer_id_expiry_ms: bad value")
        if self.retention_ms is not None and self.retention_ms < 0:
            raise ConfigError("retention_ms must be >= 0 or None")
        if self.retention_bytes is not None and self.retention_bytes < 0:
            raise ConfigError("retention_bytes must be >= 0 or None")


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Where a batch was stored; ``duplicate`` means it had been stored before (not rewritten)."""

    base_offset: int
    last_offset: int
    append_time_ms: int
    duplicate: bool


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """One segment as shown by ``topic describe``."""

    base_offset: int
    size_bytes: int
    max_append_time_ms: int | None


class Log:
    """One queue's log: ordered segments, producer state, flush and retention."""

    def __init__(
        self,
        directory: Path,
        config: LogConfig,
        segments: list[Segment],
        producers: ProducerStateManager,
        last_append_time_ms: int,
        recovery_point: int,
        handles: FileHandles,
        epochs: LeaderEpochCache,
    ) -> None:
        """Use :meth:`open`."""
        self.directory = directory
        self.epochs = epochs
        """Which leader epoch wrote which offsets (replicated queues; empty otherwise)."""
        self._handles = handles
        self.config = config
        self._segments = segments
        self._producers = producers
        self._last_append_time_ms = last_append_time_ms
        self._recovery_point = recovery_point
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._pending_sealed: list[Segment] = []
        self._directory_dirty = False
        self._end_offset = segments[-1].next_offset
        self._durable_offset = self._end_offset
        self._closed = False
        self._control_segments = [s for s in segments if s.has_control]
        self._pinned: tuple[FileHandle, int] | None = None
        """What :meth:`flush_begin` pinned, until :meth:`flush_end` (under ``_flush_lock``)."""

    # --- opening -----------------------------------------------------------------------------

    @classmethod
    def open(
        cls, directory: Path, config: LogConfig, *, clean_shutdown: bool, now_ms: int,
        handles: FileHandles | None = None,
    ) -> tuple[Log, RecoveryReport]:
        """Open (creating if needed) the log in ``directory`` and recover it.

        Args:
            directory: the log's own directory.
            config: storage settings.
            clean_shutdown: the broker's clean-shutdown marker existed: trust the files (the
                leader epoch cache is cut to the recovered log either way).
            now_ms: wall clock, for producer-id expiry.
            handles: the descriptor cache its segment files share with other logs (None: one
                of its own).

        Raises:
            CorruptRecordError: mid-log corruption (valid data after an invalid batch), or an
                unreadable ``leader-epochs`` file.
            OSError: the files cannot be read or repaired.
        """
        started = time.monotonic()
        handles = handles or FileHandles()
        directory.mkdir(parents=True, exist_ok=True)
        new = not any(directory.iterdir())
        recovery_point, last_time = _read_recovery_point(directory / RECOVERY_POINT_FILE)
        segments, findings = load_segments(
            directory,
            index_interval_bytes=config.index_interval_bytes,
            clean_shutdown=clean_shutdown,
            recovery_point=recovery_point,
            handles=handles,
        )
        try:
            fsync_segments(findings.scanned)
            for seg in reversed(segments):
                if seg.max_append_time_ms is not None:
                    last_time = max(last_time, seg.max_append_time_ms)
                    break
            producers = ProducerStateManager(directory, producer_id_expiry_ms=config.producer_id_expiry_ms)
            epochs = LeaderEpochCache.open(directory)
            log = cls(directory, config, segments, producers, last_time, recovery_point, handles,
                      epochs)
            epochs.truncate_from_end(log.end_offset)  # a power loss can leave it ahead
            epochs.truncate_from_start(log.start_offset)
            # a new log's first segment is named in its directory by the first flush, before
            # anything written to it is acknowledged in sync mode
            log._directory_dirty = new
            log._reload_producer_state()
            if findings.txn_batches:
                rebuild_txn_indexes(segments, findings, log._open_txns_at)
                log._control_segments = [s for s in segments if s.has_control]
            producers.remove_expired(now_ms)
            if not clean_shutdown or recovery_point > log.end_offset:
                log._write_recovery_point(log.end_offset)
        except BaseException:
            for seg in segments:
                seg.close()
            raise
        report = RecoveryReport(
            clean_shutdown=clean_shutdown,
            segments=len(segments),
            segments_scanned=findings.segments_scanned,
            indexes_rebuilt=findings.indexes_rebuilt,
            truncated_bytes=findings.truncated_bytes,
            lost_offsets=findings.lost_offsets,
            deleted_segments=findings.deleted_segments,
            start_offset=log.start_offset,
            end_offset=log.end_offset,
            elapsed_s=time.monotonic() - started,
        )
        return log, report

    def _reload_producer_state(self) -> None:
        snapshot = self._producers.load_snapshot(self._end_offset)
        start = max(snapshot, self.start_offset)
        for seg in self._segments:
            if seg.next_offset <= start:
                continue
            for _pos, h in seg.iter_headers(max(start, seg.base_offset)):
                if h.producer_id >= 0:
                    self._producers.update(h)

    def _open_txns_at(self, offset: int) -> dict[int, int]:
        """Open transactions (pid -> first offset) just before ``offset``: from the newest
        snapshot at or below it plus a replay of the headers in between (from the log start
        when there is no such snapshot)."""
        snapshot, producers = self._producers.read_snapshot(offset)
        state = ProducerStateManager(self.directory, producer_id_expiry_ms=self.config.producer_id_expiry_ms)
        state.set_producers(producers)
        start = max(snapshot, self.start_offset)
        for seg in self._segments:
            if seg.base_offset >= offset:
                break
            if seg.next_offset <= start:
                continue
            for _pos, h in seg.iter_headers(max(start, seg.base_offset)):
                if h.base_offset >= offset:
                    break
                if h.producer_id >= 0:
                    state.update(h)
        return dict(state.ongoing)

    def _write_recovery_point(self, offset: int) -> None:
        write_checkpoint(
            self.directory / RECOVERY_POINT_FILE,
            _RECOVERY_POINT.pack(offset, self._last_append_time_ms),
        )
        self._recovery_point = offset

    # --- properties --------------------------------------------------------------------------

    @property
    def start_offset(self) -> int:
        """First offset still in the log."""
        return self._segments[0].base_offset

    @property
    def end_offset(self) -> int:
        """The next offset to be assigned (one past the last record)."""
        return self._end_offset

    @property
    def durable_offset(self) -> int:
        """End offset covered by the last completed :meth:`flush`."""
        return self._durable_offset

    @property
    def size_bytes(self) -> int:
        """Bytes of all segment files."""
        return sum(seg.size_bytes for seg in self._segments)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def handles(self) -> FileHandles:
        """The descriptor cache of this log's segment files (shared with other logs)."""
        return self._handles

    def _check_open(self) -> None:
        if self._closed:
            raise LogClosedError(f"log {self.directory} is closed")

    @property
    def segment_count(self) -> int:
        """Number of segments (without building :meth:`segments`' list)."""
        return len(self._segments)

    def segments(self) -> list[SegmentInfo]:
        """Base offset, size and newest append time of each segment, oldest first."""
        return [SegmentInfo(s.base_offset, s.size_bytes, s.max_append_time_ms) for s in self._segments]

    # --- appending ---------------------------------------------------------------------------

    def append(self, batch: bytes | bytearray | memoryview, *, now_ms: int) -> AppendResult:
        """Append one batch already validated by the broker, stamping base offset and append
        time into a copy of its header (the body is written as it came).

        Raises:
            ProducerFencedError: the producer epoch is older than the current one.
            OutOfOrderSequenceError: the sequence does not follow the last stored one.
            CorruptRecordError: the buffer is not exactly one batch.
            LogClosedError: the log is closed.
            OSError: the write failed (nothing is acknowledged; the file is cut back).
        """
        self._check_open()
        h = decode_header(batch)
        if h.size != len(batch):
            raise CorruptRecordError(f"buffer of {len(batch)} bytes holds a {h.size}-byte batch")
        if h.attributes & _TXN_BITS:
            return self._append_txn(batch, h, now_ms)
        dup = self._producers.check(h)
        if dup is not None:
            return AppendResult(dup.base_offset, dup.last_offset, dup.append_time_ms, True)
        _active, stamped = self._write(batch, h, now_ms)
        self._producers.update_plain(stamped)
        self._last_append_time_ms = stamped.append_time_ms
        with self._lock:
            self._end_offset = stamped.last_offset + 1
        return AppendResult(stamped.base_offset, stamped.last_offset, stamped.append_time_ms,
                            False)

    def _write(self, batch: bytes | bytearray | memoryview, h: BatchHeader,
               now_ms: int) -> tuple[Segment, BatchHeader]:
        """Stamp ``batch`` with the next offset and the append time and write it to the active
        segment (rolled first if due); the segment and the stamped header."""
        active = self._segments[-1]
        if self._should_roll(active, len(batch), h.record_count, now_ms):
            active = self._roll()
        append_time = max(now_ms, self._last_append_time_ms)
        if h.magic == ENVELOPE_MAGIC:  # its Kafka batch's baseOffset too
            head = bytearray(batch[:STAMPED_HEAD_SIZE])
            stamp(head, self._end_offset, append_time)
        else:
            head = bytearray(batch[:HEADER_SIZE])
            stamp_batch(head, 0, self._end_offset, append_time)
        stamped = h._replace(base_offset=self._end_offset, append_time_ms=append_time)
        active.append(batch, stamped, head)
        return active, stamped

    def _append_txn(self, batch: bytes | bytearray | memoryview, h: BatchHeader, now_ms: int) -> AppendResult:
        """:meth:`append` of a transactional data batch (bit 4) or a control batch (bit 5)."""
        commit = _marker_commit(batch, h)
        dup = self._producers.check(h)
        if dup is not None:
            return AppendResult(dup.base_offset, dup.last_offset, dup.append_time_ms, True)
        active, stamped = self._write(batch, h, now_ms)
        self._stored_txn(active, stamped, commit)
        return AppendResult(stamped.base_offset, stamped.last_offset, stamped.append_time_ms,
                            False)

    def _stored_txn(self, active: Segment, h: BatchHeader, commit: bool | None) -> None:
        """Producer state, end offset and ``.txnindex`` after the transactional data batch
        (``commit`` None) or marker ``h`` was written to ``active``."""
        first = self._producers.ongoing.get(h.producer_id, -1)
        self._producers.update_txn(h)
        self._last_append_time_ms = max(self._last_append_time_ms, h.append_time_ms)
        with self._lock:
            self._end_offset = h.last_offset + 1
        if commit is not None:
            # The marker is in the log: the state above is final. The index follows (one
            # write(2)); its entry stays in memory even if that write fails.
            if active.txnindex.mark():
                with self._lock:
                    self._directory_dirty = True
                self._control_segments.append(active)
            if not commit and first >= 0:
                active.txnindex.append(AbortedTxn(h.producer_id, first, h.base_offset))

    def append_replica(self, batch: bytes | bytearray | memoryview) -> AppendResult:
        """Append one batch copied from the leader exactly as the leader stored it.

        The header and bytes are written unchanged (the leader's base offset and append time:
        no stamping; both CRCs are checked), the producer state is updated as the leader's
        :meth:`append` updated it (so a follower that becomes leader answers a retry of a batch
        it copied as a duplicate) and a marker goes into the ``.txnindex`` as there. Nothing
        is checked against the producer state: the leader did that, and the copy must not
        differ. A time-based roll uses the batch's append time as the clock.

        The caller records the batch's leader epoch first (``self.epochs.assign(epoch,
        base_offset)``), so that no data is ever stored without its epoch.

        Raises:
            UnexpectedAppendOffsetError: the batch does not start at :attr:`end_offset`.
            CorruptRecordError: the buffer is not exactly one valid batch (CRCs, magic, record
                count), or a control batch is not a marker.
            LogClosedError: the log is closed.
            OSError: the write failed (the file is cut back).

        Nothing is written when it raises one of the first three.
        """
        self._check_open()
        h = check_stored(batch)
        if h.size != len(batch):
            raise CorruptRecordError(f"buffer of {len(batch)} bytes holds a {h.size}-byte batch")
        if h.base_offset != self._end_offset:
            raise UnexpectedAppendOffsetError(h.base_offset, self._end_offset, str(self.directory))
        txn = h.attributes & _TXN_BITS
        commit = _marker_commit(batch, h) if txn else None
        active = self._segments[-1]
        if self._should_roll(active, len(batch), h.record_count, h.append_time_ms):
            active = self._roll()
        active.append(batch, h)
        if txn:
            self._stored_txn(active, h, commit)
        else:
            self._producers.update_plain(h)
            self._last_append_time_ms = max(self._last_append_time_ms, h.append_time_ms)
            with self._lock:
                self._end_offset = h.last_offset + 1
        return AppendResult(h.base_offset, h.last_offset, h.append_time_ms, False)

    def _should_roll(self, active: Segment, batch_bytes: int, records: int, now_ms: int) -> bool:
        if active.size_bytes == 0:
            return False
        if active.size_bytes + batch_bytes > self.config.segment_bytes:
            return True
        if self._end_offset + records - 1 - active.base_offset > MAX_RELATIVE_OFFSET:
            return True
        first = active.first_append_time_ms
        return first is not None and now_ms - first > self.config.segment_ms

    def _roll(self) -> Segment:
        old = self._segments[-1]
        self._producers.take_snapshot(self._end_offset, keep_at_or_below=self._recovery_base())
        new = Segment.create(
            self.directory, self._end_offset, index_interval_bytes=self.config.index_interval_bytes,
            handles=self._handles,
        )
        old.seal()
        with self._lock:
            self._segments = [*self._segments, new]
            self._pending_sealed.append(old)
            self._directory_dirty = True
        return new

    def _recovery_base(self) -> int:
        """Base of the segment holding the recovery point: unclean recovery scans from there."""
        segments = self._segments
        i = bisect_right(segments, self._recovery_point, key=lambda s: s.base_offset) - 1
        return segments[max(i, 0)].base_offset

    # --- reading -----------------------------------------------------------------------------

    def read(self, offset: int, max_bytes: int, *, upto_offset: int | None = None,
             stored: bool = False) -> bytes:
        """Whole batches starting with the one that contains ``offset``, from one segment.

        At least one batch is returned when one is available, even if larger than
        ``max_bytes`` (KIP-74); otherwise batches stop before exceeding ``max_bytes``. No batch
        whose last offset is >= ``upto_offset`` is returned.

        Returns:
            The raw batches; ``b""`` when ``offset`` is the end (or ``upto_offset``).

        Raises:
            OffsetOutOfRangeError: ``offset`` is below the start or above the end.
            LogClosedError: the log is closed.
        """
        data = self.read_view(offset, max_bytes, upto_offset=upto_offset, stored=stored)
        return data if isinstance(data, bytes) else bytes(data)

    def read_view(self, offset: int, max_bytes: int, *, upto_offset: int | None = None,
                  stored: bool = False) -> bytes | memoryview:
        """:meth:`read` without the copy that cuts a partial last batch off: the fetch path
        sends the view as is.

        The batches come as FerryMQ batches: an envelope read (a Kafka batch stored as it came,
        :mod:`ferrymq.protocol.kafka.envelope`) is converted into one, which only reads of
        envelopes pay. ``stored``: as they are stored, envelopes included (the Kafka port's
        fetch, replication).

        Raises:
            CorruptRecordError: an envelope that cannot be converted (see
                :func:`~ferrymq.protocol.kafka.envelope.to_native`).
        """
        self._check_open()
        segments = self._segments
        end = self._end_offset
        start = segments[0].base_offset
        if offset < start or offset > end:
            raise OffsetOutOfRangeError(f"offset {offset} is outside [{start}, {end}]")
        limit = end if upto_offset is None else min(end, upto_offset)
        if offset >= limit:
            return b""
        i = bisect_right(segments, offset, key=lambda s: s.base_offset) - 1
        while offset >= segments[i].next_offset and i + 1 < len(segments):
            i += 1
        data, envelopes = segments[i].read_batches_view(offset, max_bytes, limit)
        if envelopes and not stored:
            return to_native(data, max_batch_bytes=self.config.max_converted_batch_bytes,
                             max_bytes=max_bytes)
        return data

    # --- transactions ------------------------------------------------------------------------

    @property
    def producer_state(self) -> ProducerStateManager:
        """The idempotent/transactional producer state (read it; only :meth:`append` and
        recovery change it)."""
        return self._producers

    def ongoing_txns(self) -> dict[int, int]:
        """Open transactions on this queue: producer id -> first offset (a copy)."""
        return dict(self._producers.ongoing)

    def aborted_txns(self, start: int, upto: int) -> list[tuple[int, int]]:
        """Aborted transactions overlapping ``[start, upto)``, as ``(producer_id, first_offset)``.

        Those with ``first_offset < upto`` and ABORT marker at or after ``start``, from the
        ``.txnindex`` of every segment from the one holding ``start`` to the end of the log (a
        transaction may open in an earlier segment than its marker), in marker order. No file
        I/O unless a segment with a control batch is met for the first time (its entries are
        then loaded once); none at all when the log never held a control batch.
        """
        out: list[tuple[int, int]] = []
        for seg in self._control_segments:
            if seg.next_offset > start:
                seg.txnindex.collect(start, upto, out)
        return out

    def has_control(self, start: int, upto: int) -> bool:
        """Whether a segment overlapping ``[start, upto)`` holds a control batch.

        Per-segment flag (its ``.txnindex`` exists): set when a marker is appended, by unclean
        recovery scans, and read from the directory at open; it may stay True after a
        truncation removed the markers. A segment that never held one says False.
        """
        segments = self._control_segments
        return bool(segments) and any(s.base_offset < upto and s.next_offset > start for s in segments)

    def offset_for_time(self, ts_ms: int) -> int:
        """First offset whose batch was appended at or after ``ts_ms``, else the end offset."""
        self._check_open()
        for seg in self._segments:
            newest = seg.max_append_time_ms
            if newest is None or newest < ts_ms:
                continue
            for _pos, h in seg.iter_headers(seg.timeindex.lookup_before(ts_ms)):
                if h.append_time_ms >= ts_ms:
                    return max(h.base_offset, self.start_offset)
        return self._end_offset

    # --- durability --------------------------------------------------------------------------

    def flush(self) -> int:
        """Fsync everything written so far; return the end offset now durable.

        Safe to call from another thread while the writer thread appends.

        Raises:
            LogClosedError: the log is closed.
            OSError: an fsync failed: the data is not durable (do not retry and assume it is).
        """
        with self._flush_lock:
            self._check_open()
            return self._flush_locked()

    def flush_begin(self) -> tuple[int, int] | None:
        """Begin a flush that is a single fsync, for a caller that fsyncs several logs at once
        (the broker's flusher, :mod:`ferrymq.storage.aio`).

        When no segment was sealed since the last flush and the directory needs no fsync, the
        flush is one fsync of the active segment: this takes the flush lock, pins the
        segment's descriptor (it stays open) and returns it with the end offset its fsync makes
        durable. The caller fsyncs the descriptor and must then call :meth:`flush_end`, whether
        the fsync worked or not. Otherwise (also when the descriptor is closed: nothing to
        fsync) it returns None, holds nothing, and the caller uses :meth:`flush`.

        Raises:
            LogClosedError: the log is closed.
        """
        self._flush_lock.acquire()
        try:
            self._check_open()
            with self._lock:
                plain = not self._pending_sealed and not self._directory_dirty
                file = self._segments[-1].file
                end = self._end_offset
            pinned = file.pin() if plain and file is not None else None
        except BaseException:
            self._flush_lock.release()
            raise
        if pinned is None:
            self._flush_lock.release()
            return None
        assert file is not None
        fd, writes = pinned
        self._pinned = (file, writes)
        return fd, end

    def flush_end(self, end: int, fsynced: bool) -> None:
        """Finish a flush begun by :meth:`flush_begin`: when ``fsynced``, offsets below ``end``
        are durable. Unpins the descriptor and releases the flush lock."""
        try:
            pinned, self._pinned = self._pinned, None
            if pinned is not None:
                pinned[0].unpin(pinned[1] if fsynced else None)
            if fsynced:
                with self._lock:
                    self._durable_offset = max(self._durable_offset, end)
        finally:
            self._flush_lock.release()

    def _flush_locked(self) -> int:
        with self._lock:
            active = self._segments[-1]
            end = self._end_offset
            sealed = list(self._pending_sealed)
            directory_dirty, self._directory_dirty = self._directory_dirty, False
        try:
            for seg in sealed:
                seg.flush()
                seg.write_index_files()
            if directory_dirty:
                fsync_directory(self.directory)
        except BaseException:  # e.g. EMFILE opening a file: the next flush does it all again
            if directory_dirty:
                with self._lock:
                    self._directory_dirty = True
            raise
        active.flush()
        with self._lock:
            for seg in sealed:
                if seg in self._pending_sealed:
                    self._pending_sealed.remove(seg)
            self._durable_offset = max(self._durable_offset, end)
        if sealed:
            self._write_recovery_point(end)
        return end

    def rewrite_tail(self, from_offset: int) -> int:
        """After a failed fsync (ENOSPC): write offsets ``from_offset`` .. end again and fsync
        them (:meth:`Segment.rewrite_from`, in every segment holding some of them: a roll may
        have happened since the last good flush), then flush as usual (sealed segments'
        indexes, the directory, the recovery point); return the end offset now durable.

        Raises:
            CorruptRecordError: the bytes read back are not whole, valid batches (the page
                cache lost them: only a restart's recovery can cut them).
            OSError: the write or fsync failed again.
            LogClosedError: the log is closed.
        """
        with self._flush_lock:
            self._check_open()
            with self._lock:
                segments = self._segments
            for seg in segments:
                if seg.next_offset <= from_offset:
                    continue
                seg.rewrite_from(seg.position_of_offset(max(from_offset, seg.base_offset)))
            fsync_directory(self.directory)  # a segment or .txnindex created in the tail
            return self._flush_locked()

    # --- retention and truncation --------------------------------------------------------------

    def delete_old_segments(self, now_ms: int, *, keep_from: int | None = None) -> int:
        """Apply retention by age and by size to sealed segments; return how many were deleted.

        The active segment is never deleted, nor any segment holding offsets at or above
        ``keep_from`` (the broker's floor: the lowest pending scheduled message of the queue).
        Files are renamed to ``.deleted`` then unlinked.
        """
        with self._flush_lock:
            self._check_open()
            segments = self._segments
            doomed = 0
            retention_ms = self.config.retention_ms
            if retention_ms is not None:
                while doomed < len(segments) - 1:
                    newest = segments[doomed].max_append_time_ms
                    if newest is None or now_ms - newest <= retention_ms:
                        break
                    doomed += 1
            retention_bytes = self.config.retention_bytes
            if retention_bytes is not None:
                total = sum(s.size_bytes for s in segments[doomed:])
                while doomed < len(segments) - 1:
                    size = segments[doomed].size_bytes
                    if total - size < retention_bytes:
                        break
                    total -= size
                    doomed += 1
            if keep_from is not None:
                while doomed > 0 and segments[doomed - 1].next_offset > keep_from:
                    doomed -= 1
            return self._drop_first(doomed, now_ms, "retention")

    def delete_before(self, offset: int, *, now_ms: int) -> int:
        """Delete the sealed segments that hold only offsets below ``offset`` (the log start
        moves up to, never past, ``offset``); return how many were deleted. A compacted
        internal log drops what a snapshot replaced; a follower follows its leader's start."""
        with self._flush_lock:
            self._check_open()
            segments = self._segments
            doomed = 0
            while doomed < len(segments) - 1 and segments[doomed].next_offset <= offset:
                doomed += 1
            return self._drop_first(doomed, now_ms, "a log start moved up")

    def _drop_first(self, doomed: int, now_ms: int, why: str) -> int:
        """Delete the first ``doomed`` segments (sealed ones: the caller checked), under the
        flush lock."""
        segments = self._segments
        victims = segments[:doomed]
        with self._lock:
            self._segments = segments[doomed:]
            self._pending_sealed = [s for s in self._pending_sealed if s not in victims]
        if victims and self._control_segments:
            self._control_segments = [s for s in self._control_segments if s not in victims]
        for seg in victims:
            seg.delete()
        self.epochs.truncate_from_start(self.start_offset)
        self._producers.remove_expired(now_ms)
        if victims:
            _log.debug("%s: %s: deleted %d segments, start offset now %d", self.directory,
                       why, len(victims), self.start_offset)
        return len(victims)

    def truncate_to(self, offset: int) -> None:
        """Remove every batch whose last offset is >= ``offset``.

        When ``offset`` falls inside a batch the whole batch goes, so the end offset becomes
        that batch's base offset. Offsets at or past the end leave the batches. Either way
        :attr:`epochs` then holds no entry at or past the end (a leader epoch that wrote
        nothing here must not outlive a truncation: Kafka does the same).

        Raises:
            OffsetOutOfRangeError: ``offset`` is below the start offset.
        """
        with self._flush_lock:
            self._check_open()
            if offset >= self._end_offset:
                self.epochs.truncate_from_end(self._end_offset)
                return
            if offset < self.start_offset:
                raise OffsetOutOfRangeError(
                    f"cannot truncate to {offset}, below the start {self.start_offset}"
                )
            segments = self._segments
            keep = bisect_right(segments, offset, key=lambda s: s.base_offset)
            target = segments[keep - 1]
            dropped = segments[keep:]
            target.truncate_to(target.position_of_offset(offset))
            with self._lock:
                self._segments = segments[:keep]
                self._pending_sealed = [
                    s for s in self._pending_sealed if s in self._segments and s is not target
                ]
                self._end_offset = target.next_offset
                self._durable_offset = min(self._durable_offset, self._end_offset)
            for seg in dropped:
                seg.delete()
            self._control_segments = [s for s in self._control_segments if s not in dropped]
            self._write_recovery_point(min(self._recovery_point, self._end_offset))
            self._reload_producer_state()
            self.epochs.truncate_from_end(self._end_offset)  # after the log: see epochs.py

    def truncate_fully_and_start_at(self, offset: int) -> None:
        """Empty the log and make ``offset`` its start and end (Kafka's
        ``truncateFullyAndStartAt``): how a follower whose log ends before the leader's start
        (retention on the leader) begins again where the leader's log begins.

        Every segment, producer snapshot and leader epoch goes. The epoch cache is emptied
        first and the new segment's name made durable before the recovery point moves, so a
        crash part way leaves a log that is empty or holds nothing with a wrong epoch.

        Raises:
            OffsetOutOfRangeError: ``offset`` is negative.
            OSError: a file could not be written or removed (call again).
        """
        if offset < 0:
            raise OffsetOutOfRangeError(f"cannot start a log at {offset}")
        with self._flush_lock:
            self._check_open()
            self.epochs.truncate_from_end(0)
            self._producers.set_producers({})
            self._producers.delete_snapshots_after(-1)
            for seg in self._segments:
                seg.delete()
            new = Segment.create(self.directory, offset,
                                 index_interval_bytes=self.config.index_interval_bytes,
                                 handles=self._handles)
            with self._lock:
                self._segments = [new]
                self._pending_sealed = []
                self._end_offset = self._durable_offset = offset
            self._control_segments = []
            fsync_directory(self.directory)
            self._write_recovery_point(offset)

    # --- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Flush, write indexes, a producer snapshot and the recovery point; close files.

        Idempotent.
        """
        with self._flush_lock:
            if self._closed:
                return
            self._flush_locked()
            active = self._segments[-1]
            active.seal()
            active.write_index_files()
            self._producers.take_snapshot(self._end_offset)
            self._write_recovery_point(self._end_offset)
            self._closed = True
            for seg in self._segments:
                seg.close()


def _marker_commit(batch: bytes | bytearray | memoryview, h: BatchHeader) -> bool | None:
    """Whether the control batch ``h`` commits (False: aborts); None for a data batch.

    Raises:
        CorruptRecordError: a control batch without a producer id, or not a marker.
    """
    if not h.attributes & ATTR_CONTROL:
        return None
    if h.producer_id < 0:
        raise CorruptRecordError("a control batch needs a producer id")
    return marker_of(batch, 0, h).commit


def _read_recovery_point(path: Path) -> tuple[int, int]:
    """``(recovery_point, last_append_time_ms)``, or zeros when missing or unreadable."""
    try:
        payload = read_checkpoint(path)
    except CorruptRecordError as exc:
        _log.warning("ignoring %s (%s): recovering from the first segment", path, exc)
        return 0, 0
    if payload is None:
        return 0, 0
    if len(payload) != _RECOVERY_POINT.size:
        _log.warning("ignoring %s: payload of %d bytes", path, len(payload))
        return 0, 0
    point, last_time = _RECOVERY_POINT.unpack(payload)
    return max(point, 0), last_time
