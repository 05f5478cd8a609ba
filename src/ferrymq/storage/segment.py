"""One segment of a log: a ``.log`` file of record batches plus its indexes.

Theory of operation: a segment covers a contiguous offset range starting at its base offset.
Its ``.log`` file is nothing but record batches back to back, exactly as they travel on the
wire (see :mod:`ferrymq.protocol.records`); each batch carries its own length and two CRCs, so
the file alone is the truth and both sparse indexes are rebuildable caches. A segment that
holds a transaction control batch also has a ``.txnindex`` (:mod:`ferrymq.storage.txnindex`):
the aborted transactions whose ABORT marker it holds; its existence is :attr:`Segment.has_control`.

Life cycle: *active* (the last segment of a log; appended to with ``os.write`` on an
``O_APPEND`` descriptor, no user-space buffering, so a batch is in the kernel once
:meth:`Segment.append` returns) -> *sealed* (after a roll; read-only, its indexes get a final
time-index entry and are written to their files by the next flush) -> *deleted* (renamed to
``.deleted`` then unlinked). Reads use ``os.pread`` and never move a file position, so they
need no lock against the appending thread.

Descriptors: the ``.log`` file is a :class:`~ferrymq.storage.handles.FileHandle` of the
broker's descriptor cache: opened on first use (a sealed segment that is never read is never
opened), closed when idle and clean if the cache needs room, opened again on use. The indexes
hold no descriptor at all: their entries live in memory and their files are written whole
(atomically) when the segment is sealed and flushed, and at close; while a segment is active its
index files are stale or missing, which recovery never trusts (an unclean start scans the
active segment; a clean stop wrote them).

:meth:`Segment.recover` walks the batches from the start (or, when the files are trusted, from
the last offset-index entry), checks each one (both CRCs when asked, the header CRC always),
checks offsets are contiguous, rebuilds the indexes as it goes and stops at the first invalid
batch. It reports where it stopped and leaves the decision (truncate a torn tail, or refuse
mid-log corruption) to :mod:`ferrymq.storage.recovery`; the scan also lists the transactional
and control batches it met (``SegmentScan.txn_batches``), from which the log rebuilds the
segment's ``.txnindex``. The file is read in large chunks, never
whole, so recovering a 1 GiB segment needs ``SCAN_CHUNK_BYTES`` of memory, not 1 GiB.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ferrymq import _faults
from ferrymq.errors import CorruptRecordError, LogClosedError
from ferrymq.protocol.kafka.envelope import ENVELOPE_MAGIC, STORED_MAGICS, check_stored
from ferrymq.protocol.records import (
    ATTR_CONTROL,
    ATTR_TRANSACTIONAL,
    HEADER_SIZE,
    LENGTH_PREFIX,
    BatchHeader,
    batch_size_at,
    crc32c,
    decode_header,
)
from ferrymq.storage.files import (
    DELETED_SUFFIX,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    TIMEINDEX_SUFFIX,
    TXNINDEX_SUFFIX,
    rewrite_in_place,
    segment_file_name,
)
from ferrymq.storage.handles import FileHandle, FileHandles
from ferrymq.storage.index import MAX_RELATIVE_OFFSET, OffsetIndex
from ferrymq.storage.timeindex import TimeIndex
from ferrymq.storage.txnindex import TxnIndex

__all__ = ["LOOKUP_CHUNK_BYTES", "MAX_POSITION", "SCAN_CHUNK_BYTES", "Segment", "SegmentScan"]

SCAN_CHUNK_BYTES = 4 << 20  # recovery reads this much at a time: bounded memory, few syscalls
LOOKUP_CHUNK_BYTES = 16 << 10  # a header walk after an index lookup covers ~one index interval
RECENT_BATCHES = 16
"""Positions of the last appended batches a lookup may start its header walk from (in memory
only): a reader at the log's end (a follower's or a consumer's long poll, woken by the append)
finds its batch without walking an index interval of headers."""
MAX_POSITION = 0xFFFFFFFF  # positions are u32 in the offset index
_TXN_BITS = ATTR_TRANSACTIONAL | ATTR_CONTROL
_FLAGS = os.O_RDWR | os.O_APPEND  # how a .log is (re)opened: appends, preads, ftruncate


def header_crc_ok(buf: bytes | bytearray | memoryview, pos: int, h: BatchHeader) -> bool:
    """Whether the header CRC (CRC32C of bytes [0, 20) then [24, 28)) matches ``h``."""
    mv = memoryview(buf)
    return crc32c(mv[pos + 24 : pos + 28], crc32c(mv[pos : pos + 20])) == h.header_crc


@dataclass(frozen=True, slots=True)
class SegmentScan:
    """What :meth:`Segment.recover` found.

    Attributes:
        valid_bytes: position just after the last valid batch.
        file_bytes: size of the file when scanned.
        next_offset: offset after the last valid batch.
        batches: valid batches walked by this scan.
        error: why the scan stopped before ``file_bytes`` (None: the whole file is valid).
        txn_batches: ``(position, header)`` of the valid batches with bit 4 or 5 set, in order.
    """

    valid_bytes: int
    file_bytes: int
    next_offset: int
    batches: int
    error: str | None
    txn_batches: tuple[tuple[int, BatchHeader], ...] = ()


class _Window:
    """A read-ahead window over a file: ``get`` returns a buffer holding the wanted range.

    It asks the handle for the descriptor at each read: a caller may use other files between
    two reads (which may evict this one)."""

    __slots__ = ("_chunk_bytes", "_data", "_file", "_size", "_start")

    def __init__(self, file: FileHandle, size_bytes: int, chunk_bytes: int) -> None:
        self._file = file
        self._size = size_bytes
        self._chunk_bytes = chunk_bytes
        self._start = 0
        self._data = b""

    def get(self, pos: int, n: int) -> tuple[bytes, int]:
        """``(buf, i)`` with ``buf[i : i + n]`` the file's bytes at ``pos`` (shorter at EOF)."""
        start = self._start
        if start <= pos and pos + n <= start + len(self._data):
            return self._data, pos - start
        want = min(max(n, self._chunk_bytes), self._size - pos)
        self._data = os.pread(self._file.get(), want, pos) if want > 0 else b""
        self._start = pos
        return self._data, 0


class Segment:
    """A ``.log`` file and its offset and time indexes.

    Single writer: :meth:`append`, :meth:`truncate_to` and :meth:`recover` run on the log's
    writer thread; :meth:`flush` may run on another thread (it only fsyncs).
    """

    def __init__(
        self, directory: Path, base_offset: int, *, index_interval_bytes: int, file: FileHandle,
        size_bytes: int, has_txnindex: bool = False,
    ) -> None:
        """Wrap the ``.log`` file's handle; use :meth:`create` or :meth:`open` instead."""
        self.directory = directory
        self.base_offset = base_offset
        self.index_interval_bytes = index_interval_bytes
        self.log_path = directory / segment_file_name(base_offset, LOG_SUFFIX)
        self.index_path = directory / segment_file_name(base_offset, INDEX_SUFFIX)
        self.timeindex_path = directory / segment_file_name(base_offset, TIMEINDEX_SUFFIX)
        self.txnindex_path = directory / segment_file_name(base_offset, TXNINDEX_SUFFIX)
        self.txnindex = TxnIndex(self.txnindex_path, base_offset, present=has_txnindex)
        self._file: FileHandle | None = file
        self._size_bytes = size_bytes
        self.next_offset = base_offset
        self.max_append_time_ms: int | None = None
        self._first_append_time_ms: int | None = None
        self._last_batch_offset = -1
        self._bytes_since_index_entry = 0
        self._recent: deque[tuple[int, int]] = deque(maxlen=RECENT_BATCHES)
        """(base offset, position) of the last batches noted, newest last."""
        self._index: OffsetIndex | None = None
        self._timeindex: TimeIndex | None = None

    # --- opening -----------------------------------------------------------------------------

    @classmethod
    def create(cls, directory: Path, base_offset: int, *, index_interval_bytes: int,
               handles: FileHandles | None = None) -> Segment:
        """Create a new empty active segment (its ``.log`` open, its indexes empty in memory).

        Args:
            directory: the log's directory.
            base_offset: the first offset it will hold.
            index_interval_bytes: bytes of log between two index entries.
            handles: the descriptor cache (None: one of its own).

        Raises:
            OSError: the file cannot be created (nothing was).
        """
        path = directory / segment_file_name(base_offset, LOG_SUFFIX)
        # O_TRUNC, not O_EXCL: a file at the end offset can only be debris of a failed roll.
        file = (handles or FileHandles()).register(
            path, _FLAGS, create_flags=_FLAGS | os.O_CREAT | os.O_TRUNC)
        for suffix in (TXNINDEX_SUFFIX, INDEX_SUFFIX, TIMEINDEX_SUFFIX):  # a failed roll's
            (directory / segment_file_name(base_offset, suffix)).unlink(missing_ok=True)
        seg = cls(directory, base_offset, index_interval_bytes=index_interval_bytes, file=file,
                  size_bytes=0)
        seg._index = OffsetIndex(seg.index_path, base_offset)
        seg._timeindex = TimeIndex(seg.timeindex_path, base_offset)
        return seg

    @classmethod
    def open(
        cls, directory: Path, base_offset: int, *, index_interval_bytes: int,
        has_txnindex: bool | None = None, handles: FileHandles | None = None,
    ) -> Segment:
        """Describe an existing segment without opening or reading it; then recover or load it.

        ``has_txnindex``: whether its ``.txnindex`` exists, when the caller listed the
        directory (None: look). ``handles``: the descriptor cache (None: one of its own).

        Raises:
            OSError: the ``.log`` file cannot be found.
        """
        path = directory / segment_file_name(base_offset, LOG_SUFFIX)
        if has_txnindex is None:
            has_txnindex = (directory / segment_file_name(base_offset, TXNINDEX_SUFFIX)).exists()
        file = (handles or FileHandles()).register(path, _FLAGS)
        return cls(
            directory, base_offset, index_interval_bytes=index_interval_bytes, file=file,
            size_bytes=os.stat(path).st_size, has_txnindex=has_txnindex,
        )

    def load_sealed(self, next_offset: int) -> bool:
        """Trust a sealed segment ending before ``next_offset``: load its time index.

        The offset index is loaded lazily on first lookup. Returns False (and rebuilds both
        indexes from the log) when the time index is missing or inconsistent.
        """
        self.next_offset = next_offset
        self._last_batch_offset = -1
        if self._size_bytes == 0:
            self._index = OffsetIndex(self.index_path, self.base_offset)
            self._timeindex = TimeIndex(self.timeindex_path, self.base_offset)
            return True
        ti = TimeIndex.load(
            self.timeindex_path,
            self.base_offset,
            max_relative_offset=self._max_relative(next_offset),
        )
        if ti is None or not len(ti):
            self._rebuild_indexes()
            return False
        self._timeindex = ti
        last = ti.last_entry
        assert last is not None
        self.max_append_time_ms = last[0]
        return True

    def _max_relative(self, next_offset: int) -> int:
        return min(max(next_offset - 1 - self.base_offset, 0), MAX_RELATIVE_OFFSET)

    def _rebuild_indexes(self) -> None:
        expected_next = self.next_offset
        scan = self._scan(resume=False, check_crc=False)
        if scan.error is not None or scan.next_offset != expected_next:
            raise CorruptRecordError(
                f"{self.log_path}: sealed segment is damaged at position {scan.valid_bytes} "
                f"(offsets {self.base_offset}..{scan.next_offset - 1} readable, next segment "
                f"starts at {expected_next}): {scan.error or 'offsets do not reach it'}"
            )
        self.seal()
        self.write_index_files()

    # --- properties --------------------------------------------------------------------------

    @property
    def size_bytes(self) -> int:
        """Bytes in the ``.log`` file."""
        return self._size_bytes

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._file is None

    @property
    def file(self) -> FileHandle | None:
        """The ``.log`` file's handle (None once closed), for a caller that fsyncs it together
        with other files (:meth:`ferrymq.storage.log.Log.flush_begin`: pin, fsync, unpin)."""
        return self._file

    def _require_file(self) -> FileHandle:
        file = self._file
        if file is None:
            raise LogClosedError(f"segment {self.log_path} is closed")
        return file

    def _require_fd(self) -> int:
        return self._require_file().get()

    @property
    def has_control(self) -> bool:
        """Whether the segment holds a control batch (its ``.txnindex`` exists): set on append,
        by recovery scans, and read from the directory for segments loaded unscanned. It may
        stay True after a truncation removed the control batches (conservative)."""
        return self.txnindex.present

    @property
    def first_append_time_ms(self) -> int | None:
        """Append time of the first batch (None when empty); read from disk once."""
        if self._first_append_time_ms is None and self._size_bytes >= HEADER_SIZE:
            data = os.pread(self._require_fd(), HEADER_SIZE, 0)
            self._first_append_time_ms = decode_header(data).append_time_ms
        return self._first_append_time_ms

    @property
    def index(self) -> OffsetIndex:
        """The offset index, loaded (and validated, else rebuilt) on first use."""
        if self._index is None:
            index = OffsetIndex.load(
                self.index_path,
                self.base_offset,
                size_bytes=self._size_bytes,
                max_relative_offset=self._max_relative(self.next_offset),
            )
            if index is None:
                self._rebuild_indexes()
            else:
                self._index = index
        assert self._index is not None
        return self._index

    @property
    def timeindex(self) -> TimeIndex:
        """The time index."""
        if self._timeindex is None:
            self.index  # noqa: B018 - a rebuild fills both indexes
            if self._timeindex is None:
                self._rebuild_indexes()
        assert self._timeindex is not None
        return self._timeindex

    # --- writing -----------------------------------------------------------------------------

    def append(
        self, batch: bytes | bytearray | memoryview, header: BatchHeader,
        stamped_head: bytes | bytearray | None = None,
    ) -> int:
        """Append one stamped batch (``header`` is its decoded header); return its position.

        ``stamped_head``, when given, replaces the first ``len(stamped_head)`` bytes of
        ``batch`` on disk (the broker stamps a copy of the header instead of the whole batch);
        both parts go down in one ``writev``.

        Raises:
            OSError: the write failed; the file is cut back to its previous size if possible.
        """
        file = self._require_file()
        fd = file.get()
        if _faults.ENOSPC_FAULTS:
            _faults.enospc_point("write", f"{self.directory.parent.name}/{self.directory.name}")
        pos = self._size_bytes
        view = memoryview(batch)
        try:
            if stamped_head is not None:
                head = memoryview(stamped_head)
                rest = view[len(head) :]
                written = os.writev(fd, [head, rest])
                if written < len(head):
                    head = head[written:]
                    while head:
                        head = head[os.write(fd, head) :]
                    written = len(stamped_head)
                view = rest[written - len(stamped_head) :]
            while view:
                written = os.write(fd, view)
                view = view[written:]
        except OSError:
            try:
                os.ftruncate(fd, pos)
            except OSError:
                pass
            raise
        finally:
            file.wrote()  # after the write: the descriptor stays open until an fsync covers it
        self._size_bytes = pos + len(batch)
        self._note_batch(pos, header)
        return pos

    def rewrite_from(self, position: int) -> None:
        """Write the bytes from ``position`` to the end again, in place, and fsync them.

        After an fsync failed (ENOSPC at writeback) the kernel may have marked those pages
        clean without writing them; writing the same bytes again (read back from the page
        cache, both CRCs checked) makes them dirty, and a new descriptor's fsync reports only
        errors that happen from now on. Offsets and sizes do not change.

        Raises:
            CorruptRecordError: the bytes read back are not whole, valid batches (the page
                cache lost them: only recovery at restart can cut them).
            OSError: the write or fsync failed (still no space): nothing changed.
        """
        size = self._size_bytes
        data = os.pread(self._require_fd(), size - position, position)
        pos = 0
        while pos < len(data):
            h = check_stored(data, pos)
            pos += LENGTH_PREFIX + h.batch_length
        if pos != size - position:
            raise CorruptRecordError(f"{self.log_path}: tail from {position} not readable")
        rewrite_in_place(self.log_path, data, position)

    def _note_batch(self, pos: int, h: BatchHeader) -> None:
        """Update indexes and bookkeeping for a valid batch at ``pos`` (append and scan)."""
        index = self.index
        if self._bytes_since_index_entry >= self.index_interval_bytes:
            last = index.last_entry
            if last is None or pos > last[1]:
                index.append(h.base_offset, pos)
                self.timeindex.maybe_append(h.append_time_ms, h.base_offset)
                self._bytes_since_index_entry = 0
        self._bytes_since_index_entry += LENGTH_PREFIX + h.batch_length
        if pos == 0:
            self._first_append_time_ms = h.append_time_ms
        self.max_append_time_ms = h.append_time_ms
        self._last_batch_offset = h.base_offset
        self.next_offset = h.last_offset + 1
        self._recent.append((h.base_offset, pos))

    def seal(self) -> None:
        """Mark the end of appends: add a time-index entry for the last batch."""
        t = self.max_append_time_ms
        if t is not None and self._last_batch_offset >= 0:
            self.timeindex.maybe_append(t, self._last_batch_offset)

    def flush(self) -> None:
        """Fsync the ``.log`` file (nothing when its descriptor is closed: then nothing was
        written since its last fsync, see :mod:`ferrymq.storage.handles`).

        The indexes are caches that recovery validates and rebuilds: the broker's per-round
        flush of the active segment leaves them; sealing and closing write them
        (:meth:`write_index_files`).
        """
        if self._file is not None:
            self._file.fsync()

    def write_index_files(self) -> None:
        """Write both index files from memory, atomically, if their entries changed since
        they were loaded or written (each durable when this returns), and fsync the
        ``.txnindex`` if it was appended to: a sealed segment's flush, a close, recovery."""
        self.index.save()
        self.timeindex.save()
        self.txnindex.fsync()

    def truncate_to(self, position: int) -> None:
        """Cut the log file at ``position`` (a batch boundary) and fix indexes and bookkeeping."""
        file = self._require_file()
        if position >= self._size_bytes:
            return
        try:
            os.ftruncate(file.get(), position)
        finally:
            file.wrote()
        self._size_bytes = position
        self.index.truncate_to_position(position)
        self._scan(resume=True, check_crc=False)
        self.timeindex.truncate_to_offset(self.next_offset)
        self.txnindex.truncate_to(self.next_offset)

    # --- scanning ----------------------------------------------------------------------------

    def recover(self, *, check_crc: bool = True, resume: bool = False) -> SegmentScan:
        """Walk the batches, rebuild the indexes and stop at the first invalid batch.

        Args:
            check_crc: check both CRCs of every batch (unclean shutdown); otherwise only the
                header CRC, length and offsets (the files are trusted).
            resume: start from the last entry of the loaded index instead of from position 0
                (clean shutdown: cheap); falls back to position 0 when the index is unusable.

        The in-memory state describes the valid prefix afterwards; the file is not changed.
        When the scan covered the whole file the index files are rewritten.
        """
        if resume:
            index = OffsetIndex.load(
                self.index_path,
                self.base_offset,
                size_bytes=self._size_bytes,
                max_relative_offset=MAX_RELATIVE_OFFSET,
            )
            ti = TimeIndex.load(
                self.timeindex_path, self.base_offset, max_relative_offset=MAX_RELATIVE_OFFSET
            )
            if index is None or ti is None:
                resume = False
            else:
                self._index, self._timeindex = index, ti
        loaded = None
        if resume and self._index is not None and self._timeindex is not None:
            loaded = (len(self._index), len(self._timeindex))
        scan = self._scan(resume=resume, check_crc=check_crc)
        if scan.error is None:
            self.timeindex.truncate_to_offset(scan.next_offset)
            if loaded != (len(self.index), len(self.timeindex)):
                self.write_index_files()
        return scan

    def _scan(self, *, resume: bool, check_crc: bool) -> SegmentScan:
        file = self._require_file()
        size = self._size_bytes
        pos = 0
        self._recent.clear()  # the scan notes the batches it finds again
        if resume and self._index is not None and self._index.last_entry is not None:
            expected, pos = self._index.last_entry
            self._first_append_time_ms = None
        else:
            if self._index is None:
                self._index = OffsetIndex(self.index_path, self.base_offset)
            else:
                self._index.truncate_to_position(0)
            if self._timeindex is None:
                self._timeindex = TimeIndex(self.timeindex_path, self.base_offset)
            else:
                self._timeindex.truncate_to_offset(self.base_offset)
            expected = self.base_offset
        self.next_offset = expected
        self.max_append_time_ms = None
        self._last_batch_offset = -1
        self._bytes_since_index_entry = 0
        window = _Window(file, size, SCAN_CHUNK_BYTES)
        batches = 0
        error: str | None = None
        txn_batches: list[tuple[int, BatchHeader]] = []
        while pos < size:
            buf, i = window.get(pos, HEADER_SIZE)
            batch_bytes = batch_size_at(buf, i)
            if len(buf) - i < HEADER_SIZE:
                error = f"truncated batch header ({size - pos} bytes left)"
                break
            if batch_bytes < HEADER_SIZE or pos + batch_bytes > size:
                error = f"batch length {batch_bytes} does not fit the {size - pos} bytes left"
                break
            buf, i = window.get(pos, batch_bytes)
            try:
                if check_crc:
                    h = check_stored(buf, i)
                else:
                    h = decode_header(buf, i)
                    if (not header_crc_ok(buf, i, h) or h.magic not in STORED_MAGICS
                            or h.record_count < 1):
                        raise CorruptRecordError("batch header CRC mismatch")
            except CorruptRecordError as exc:
                error = str(exc)
                break
            if h.base_offset != expected:
                error = f"batch has base offset {h.base_offset}, expected {expected}"
                break
            if h.last_offset - self.base_offset > MAX_RELATIVE_OFFSET or pos > MAX_POSITION:
                error = "batch beyond the index range of its segment"
                break
            self._note_batch(pos, h)
            if h.attributes & _TXN_BITS:
                txn_batches.append((pos, h))
            batches += 1
            expected = h.last_offset + 1
            pos += batch_bytes
        self.next_offset = expected
        if resume and self.max_append_time_ms is None:
            # Nothing after the last index entry: fall back to the time index.
            last_t = self.timeindex.last_entry
            self.max_append_time_ms = last_t[0] if last_t is not None else None
        return SegmentScan(pos, size, expected, batches, error, tuple(txn_batches))

    def iter_headers(self, from_offset: int) -> Iterator[tuple[int, BatchHeader]]:
        """Yield ``(position, header)`` of each batch from the one holding ``from_offset``."""
        found = self.find_batch(from_offset)
        if found is None:
            return
        pos = found[0]
        window = _Window(self._require_file(), self._size_bytes, SCAN_CHUNK_BYTES)
        while pos + HEADER_SIZE <= self._size_bytes:
            buf, i = window.get(pos, HEADER_SIZE)
            h = decode_header(buf, i)
            if h.batch_length < HEADER_SIZE - LENGTH_PREFIX:  # would walk backwards or in place
                raise CorruptRecordError(
                    f"{self.log_path}: batch at position {pos} has length {h.batch_length}")
            yield pos, h
            pos += LENGTH_PREFIX + h.batch_length

    # --- reading -----------------------------------------------------------------------------

    def find_batch(self, offset: int) -> tuple[int, BatchHeader] | None:
        """``(position, header)`` of the batch that contains ``offset``; None past the end.

        Raises:
            CorruptRecordError: the batch headers on disk are inconsistent.
        """
        file = self._require_file()
        if offset >= self.next_offset:
            return None
        entry_offset, pos = self.index.lookup(offset)
        for base, at in reversed(self._recent):  # a recent batch nearer than the index entry
            if base <= offset:
                if base > entry_offset:
                    entry_offset, pos = base, at
                break
        window = _Window(file, self._size_bytes, LOOKUP_CHUNK_BYTES)
        expected = entry_offset
        first = True
        while pos + HEADER_SIZE <= self._size_bytes:
            buf, i = window.get(pos, HEADER_SIZE)
            h = decode_header(buf, i)
            if h.base_offset != expected:
                if first and pos > 0:
                    # The index points at something that is not the batch it names: rebuild.
                    self._rebuild_indexes()
                    return self.find_batch(offset)
                raise CorruptRecordError(
                    f"{self.log_path}: batch at position {pos} has base offset {h.base_offset}, "
                    f"expected {expected}"
                )
            first = False
            if h.batch_length < HEADER_SIZE - LENGTH_PREFIX:  # would walk backwards or in place
                raise CorruptRecordError(
                    f"{self.log_path}: batch at position {pos} has length {h.batch_length}")
            if h.last_offset >= offset:
                return pos, h
            expected = h.last_offset + 1
            pos += LENGTH_PREFIX + h.batch_length
        return None

    def read(self, position: int, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` raw bytes from ``position`` (``os.pread``; may cut a batch)."""
        file = self._require_file()
        n = min(max_bytes, self._size_bytes - position)
        return os.pread(file.get(), n, position) if n > 0 else b""

    def read_batches(self, offset: int, max_bytes: int, upto_offset: int) -> bytes:
        """Whole batches from the one containing ``offset``, within ``max_bytes``, as stored
        (envelopes included: :meth:`Log.read` is what converts them).

        The first batch is returned even when larger than ``max_bytes`` (KIP-74); no batch
        whose last offset is >= ``upto_offset`` is returned.
        """
        data = self.read_batches_view(offset, max_bytes, upto_offset)[0]
        return data if isinstance(data, bytes) else bytes(data)

    def read_batches_view(self, offset: int, max_bytes: int,
                          upto_offset: int) -> tuple[bytes | memoryview, bool]:
        """:meth:`read_batches` without copying: a read that cut a batch at its end is returned
        as a view of the whole batches (the fetch path sends it as is); and whether any of
        them is an envelope (a Kafka batch as stored, :mod:`ferrymq.protocol.kafka.envelope`),
        known from the header walk the cut needs anyway."""
        found = self.find_batch(offset)
        if found is None:
            return b"", False
        pos, h = found
        if h.last_offset >= upto_offset:
            return b"", False
        envelopes = h.magic == ENVELOPE_MAGIC
        first_bytes = LENGTH_PREFIX + h.batch_length
        data = self.read(pos, max(first_bytes, max_bytes))
        p = first_bytes
        n = len(data)
        while n - p >= HEADER_SIZE:
            nh = decode_header(data, p)
            end = p + LENGTH_PREFIX + nh.batch_length
            if end > n or end < p + HEADER_SIZE or nh.last_offset >= upto_offset:
                break
            if nh.magic == ENVELOPE_MAGIC:
                envelopes = True
            p = end
        return (data if p == n else memoryview(data)[:p]), envelopes

    def position_of_offset(self, offset: int) -> int:
        """Position of the batch containing ``offset``, or the file size past the end."""
        found = self.find_batch(offset)
        return self._size_bytes if found is None else found[0]

    # --- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the ``.log`` file's descriptor for good (idempotent)."""
        file, self._file = self._file, None
        if file is not None:
            file.close()

    def delete(self) -> None:
        """Close, rename each file to ``.deleted``, then unlink them."""
        self.close()
        doomed = []
        for path in (self.log_path, self.index_path, self.timeindex_path, self.txnindex_path):
            target = path.with_name(path.name + DELETED_SUFFIX)
            try:
                os.replace(path, target)
            except FileNotFoundError:
                continue
            doomed.append(target)
        for target in doomed:
            target.unlink(missing_ok=True)
