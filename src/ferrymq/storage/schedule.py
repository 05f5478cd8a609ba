"""The scheduler's time index on disk: one append-only file of fixed-size entries per bucket of
due time, plus a checkpoint of per-queue watermarks.

Theory of operation
-------------------
A scheduled message is stored in its queue's log like any message (that is the source of
truth). This index says *when* each one is due, grouped so that only the near future has to be
read into memory: the broker's scheduler (:mod:`ferrymq.broker.scheduler`) loads a bucket when
its start comes within a look-ahead of now, and never holds the far future. The index is derived
data: what a crash loses of it is found again by rescanning the logs from the watermarks.

Directory layout::

    <data-dir>/schedule/
      00000001763683200000.bucket   entries of the bucket starting at that wall ms (20 digits)
      00000001763683260000.bucket   the next bucket (bucket width: schedule_bucket_ms)
      scheduler.checkpoint          per-queue watermarks (a checkpoint file, see storage.md)

Entry (32 bytes, little-endian); a file is entries back to back, written with ``os.write``::

    off  size  field
    0    1     kind       u8   0 scheduled, 1 fired, 2 cancelled
    1    1     skew_hi    i8   skew (below): bits 32..39, signed
    2    2     skew_mid   u16  bits 16..31
    4    8     due_ms     i64  wall-clock ms when the message is due (append time + delay)
    12   4     topic_id   u32  the original's position: topic id,
    16   2     queue      u16  queue,
    18   2     skew_lo    u16  bits 0..15
    20   8     offset     i64  and offset
    28   4     crc        u32  CRC32C of bytes [0, 28)

The *skew* (a signed 40-bit ms count) maps the due time to the scheduler's own clock: the entry
fires when that clock reaches ``due_ms + skew`` (see :mod:`ferrymq.broker.scheduler`); it is 0
unless the wall clock jumped. Buckets group entries by that fire time. Files written before the
skew existed have zeros there. A *fired* or *cancelled* entry settles the scheduled entry before
it with the same position and due time. The pending messages of a bucket are its scheduled
entries minus the settled ones. A file whose length is not a multiple of 32 has a torn tail (a
crash in the middle of a write): the partial entry is ignored and cut before the next append. An
entry whose CRC fails is skipped and counted (at the end of the file: torn; elsewhere:
corruption, reported by the caller).

Threads: appends, reads and deletes run on the broker's event-loop thread; :meth:`ScheduleStore.sync`
runs on the flusher thread. File descriptors are only closed by ``sync`` (or by ``close`` once
the flusher has stopped), so none is closed while it is being fsynced.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import msgpack

from ferrymq.errors import CorruptRecordError
from ferrymq.protocol.records import crc32c
from ferrymq.storage.checkpoint import read_checkpoint, write_checkpoint
from ferrymq.storage.files import OFFSET_DIGITS, TMP_SUFFIX, fsync_directory, rewrite_in_place
from ferrymq.storage.handles import FileHandle, FileHandles

__all__ = [
    "BUCKET_SUFFIX",
    "CANCELLED",
    "ENTRY_SIZE",
    "FIRED",
    "SCHEDULED",
    "WATERMARKS_FILE",
    "BucketScan",
    "Entry",
    "Position",
    "RawEntry",
    "ScheduleStore",
    "decode_entries",
    "encode_entries",
    "pending_entries",
]

_log = logging.getLogger("ferrymq.storage")

SCHEDULED = 0
FIRED = 1
CANCELLED = 2
BUCKET_SUFFIX = ".bucket"
WATERMARKS_FILE = "scheduler.checkpoint"
MAX_OPEN_BUCKETS = 64
"""Capacity of the descriptor cache of a store made without the broker's shared one (tools,
tests); in the broker, bucket files share :class:`~ferrymq.storage.handles.FileHandles` with the
segments and journals."""

_BODY = struct.Struct("<BbHqIHHq")
_ENTRY = struct.Struct("<BbHqIHHqI")
ENTRY_SIZE = _ENTRY.size
assert _BODY.size == 28
assert ENTRY_SIZE == 32
MAX_SKEW_MS = (1 << 39) - 1
"""Largest skew an entry holds (about 17 years); larger ones are clamped."""

Position = tuple[int, int, int]
"""(topic id, queue, offset) of a scheduled original."""


class Entry(NamedTuple):
    """One index entry."""

    kind: int
    due_ms: int
    topic_id: int
    queue: int
    offset: int
    skew_ms: int = 0


RawEntry = tuple[int, int, int, int, int, int]
"""An :class:`Entry` as a plain tuple (what :func:`decode_entries` returns: cheaper)."""


class BucketScan(NamedTuple):
    """What reading one bucket file found."""

    entries: list[RawEntry]
    corrupt: int  # entries with a bad CRC followed by good ones
    torn_bytes: int  # bytes of the torn tail (a partial entry, or bad-CRC entries at the end)


def encode_entries(entries: Iterable[tuple[int, int, int, int, int, int]]) -> bytes:
    """Entries ``(kind, due_ms, topic_id, queue, offset, skew_ms)`` as file bytes, each with its
    CRC (a skew beyond :data:`MAX_SKEW_MS` is clamped)."""
    out = bytearray()
    pack = _BODY.pack
    for kind, due, tid, q, off, skew in entries:
        if skew:
            skew = max(-MAX_SKEW_MS, min(MAX_SKEW_MS, skew))
            body = pack(kind, skew >> 32, (skew >> 16) & 0xFFFF, due, tid, q, skew & 0xFFFF, off)
        else:
            body = pack(kind, 0, 0, due, tid, q, 0, off)
        out += body
        out += crc32c(body).to_bytes(4, "little")
    return bytes(out)


def decode_entries(data: bytes | bytearray | memoryview) -> BucketScan:
    """The valid entries of a bucket file's content, as ``(kind, due_ms, topic_id, queue,
    offset, skew_ms)`` tuples."""
    size = len(data)
    whole = size - size % ENTRY_SIZE
    raw = bytes(data[:whole])
    entries: list[RawEntry] = []
    append = entries.append
    bad_run = 0  # consecutive bad entries not yet known to be mid-file
    corrupt = 0
    crc = crc32c
    p = 0
    for fields in _ENTRY.iter_unpack(raw):  # the hot loop of a start: keep it lean
        kind, hi, mid, due, tid, q, lo, off, c = fields
        if crc(raw[p : p + 28]) != c or kind > CANCELLED:
            bad_run += 1
        else:
            if bad_run:
                corrupt += bad_run
                bad_run = 0
            append((kind, due, tid, q, off, (hi << 32) | (mid << 16) | lo if hi or mid or lo else 0))
        p += ENTRY_SIZE
    return BucketScan(entries, corrupt, size - whole + bad_run * ENTRY_SIZE)


def pending_entries(entries: Iterable[RawEntry]) -> dict[Position, tuple[int, int]]:
    """``position -> (due_ms, skew_ms)`` of the scheduled entries not settled by a later fired
    or cancelled entry (same position and due time)."""
    pending: dict[Position, tuple[int, int]] = {}
    for kind, due, tid, q, off, skew in entries:
        pos = (tid, q, off)
        if kind == SCHEDULED:
            pending[pos] = (due, skew)
        else:
            p = pending.get(pos)
            if p is not None and p[0] == due:
                del pending[pos]
    return pending


def bucket_file_name(start_ms: int) -> str:
    """``<start ms, 20 digits>.bucket``."""
    if start_ms < 0:
        raise ValueError(f"negative bucket start {start_ms}")
    return f"{start_ms:0{OFFSET_DIGITS}d}{BUCKET_SUFFIX}"


class ScheduleStore:
    """The bucket files and the watermark checkpoint of one broker.

    Bucket files are opened through a :class:`~ferrymq.storage.handles.FileHandles` cache: the
    broker's, shared with its segments and journals, so that descriptors have one budget and one
    eviction rule (a file written since its last fsync stays open until the fsync).

    Args:
        directory: ``<data-dir>/schedule`` (created if missing).
        handles: the descriptor cache (default: a private one of ``max_open``).
        max_open: capacity of the private cache.
    """

    def __init__(self, directory: Path, *, handles: FileHandles | None = None,
                 max_open: int = MAX_OPEN_BUCKETS) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        for p in directory.iterdir():
            if p.name.endswith(TMP_SUFFIX):
                p.unlink(missing_ok=True)
        self.handles = handles if handles is not None else FileHandles(max_open)
        self._lock = threading.Lock()
        self._files: dict[int, FileHandle] = {}  # bucket start -> its file (loop thread)
        self._dirty: set[FileHandle] = set()  # written since the last sync
        self._dir_dirty = False
        self.bytes_written = 0

    # -- buckets -------------------------------------------------------------------------------

    def bucket_starts(self) -> list[int]:
        """Start (wall ms) of every bucket file, ascending."""
        out = []
        for p in self.directory.iterdir():
            name = p.name
            stem = name[: -len(BUCKET_SUFFIX)]
            if name.endswith(BUCKET_SUFFIX) and len(stem) == OFFSET_DIGITS and stem.isdigit():
                out.append(int(stem))
        return sorted(out)

    def path(self, start_ms: int) -> Path:
        """The file of the bucket starting at ``start_ms``."""
        return self.directory / bucket_file_name(start_ms)

    def read(self, start_ms: int) -> BucketScan:
        """Every valid entry of a bucket (empty when the file does not exist).

        Raises:
            OSError: the file exists but cannot be read.
        """
        try:
            data = self.path(start_ms).read_bytes()
        except FileNotFoundError:
            return BucketScan([], 0, 0)
        return decode_entries(data)

    def append(self, start_ms: int, data: bytes) -> None:
        """Append encoded entries to a bucket file (creating it): one ``write(2)``, so they
        survive a process crash at once and a power loss after the next :meth:`sync`.

        Raises:
            OSError: the write failed (or the file could not be opened).
        """
        handle = self._files.get(start_ms)
        if handle is None:
            handle = self._open(start_ms)
        fd = handle.get()
        view = memoryview(data)
        try:
            while view:
                n = os.write(fd, view)
                view = view[n:]
        except OSError:  # ENOSPC part way: cut the entries of this call (stay aligned)
            written = len(data) - len(view)
            if written:
                try:
                    os.ftruncate(fd, os.fstat(fd).st_size - written)
                except OSError:
                    pass
                self._wrote(handle)
            raise
        self.bytes_written += len(data)
        self._wrote(handle)

    def _wrote(self, handle: FileHandle) -> None:
        handle.wrote()
        with self._lock:
            self._dirty.add(handle)

    def _open(self, start_ms: int) -> FileHandle:
        path = self.path(start_ms)
        existed = path.exists()
        handle = self.handles.register(path, os.O_RDWR | os.O_APPEND,
                                       create_flags=os.O_RDWR | os.O_APPEND | os.O_CREAT)
        self._files[start_ms] = handle
        if not existed:
            with self._lock:
                self._dir_dirty = True
        fd = handle.get()
        size = os.fstat(fd).st_size
        torn = size % ENTRY_SIZE
        if size - torn >= ENTRY_SIZE:  # entries with a bad CRC at the end are torn too
            last = os.pread(fd, ENTRY_SIZE, size - torn - ENTRY_SIZE)
            if crc32c(last[:28]) != int.from_bytes(last[28:], "little"):
                torn = decode_entries(path.read_bytes()).torn_bytes
        if torn:  # a torn tail (a crash in mid-write): cut it so later entries stay aligned
            _log.warning("%s: cutting a torn tail of %d bytes", path, torn)
            os.ftruncate(fd, size - torn)
            self._wrote(handle)
        return handle

    def delete(self, start_ms: int) -> None:
        """Delete a bucket file (its descriptor is closed, after an fsync in progress)."""
        handle = self._files.pop(start_ms, None)
        with self._lock:
            if handle is not None:
                self._dirty.discard(handle)
            self._dir_dirty = True
        if handle is not None:
            handle.close()
        self.path(start_ms).unlink(missing_ok=True)

    # -- durability ----------------------------------------------------------------------------

    def sync(self) -> None:
        """fsync every bucket file written since the last call (flusher thread), then the
        directory if files came or went.

        Raises:
            OSError: an fsync failed (the entries are not durable).
        """
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            dir_dirty, self._dir_dirty = self._dir_dirty, False
        for handle in dirty:
            handle.fsync()  # a handle closed since (deleted) needs none
        if dir_dirty:
            fsync_directory(self.directory)

    def rewrite_all(self) -> None:
        """After an fsync failed (ENOSPC): read every bucket file back, check that its entries
        are whole and their CRCs hold, write the same bytes again in place through a new
        descriptor and fsync it (the failed fsync may have left pages clean but unwritten,
        and its error is not reported twice); then fsync the directory. Loop thread, while
        the flusher leaves the store alone.

        Raises:
            OSError: a write or fsync failed (still no space).
            CorruptRecordError: a file does not read back intact.
        """
        for start in self.bucket_starts():
            path = self.path(start)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            scan = decode_entries(data)
            if scan.corrupt or scan.torn_bytes:
                raise CorruptRecordError(f"{path}: {scan.corrupt} entries fail their CRC, "
                                         f"{scan.torn_bytes} torn bytes after a failed fsync")
            rewrite_in_place(path, data, 0)
        with self._lock:
            self._dirty.clear()
            self._dir_dirty = False
        fsync_directory(self.directory)
        for handle in self._files.values():  # durable now: their descriptors may be evicted
            handle.fsync()

    @property
    def has_unsynced(self) -> bool:
        """Whether anything was written (or a file created or deleted) since the last
        :meth:`sync`."""
        return bool(self._dirty or self._dir_dirty)

    def close(self) -> None:
        """fsync and close every file (the flusher must have stopped)."""
        self.sync()
        files, self._files = list(self._files.values()), {}
        for handle in files:
            try:
                handle.fsync()
            finally:
                handle.close()

    # -- watermarks ----------------------------------------------------------------------------

    def _read_checkpoint(self) -> dict[str, Any] | None:
        path = self.directory / WATERMARKS_FILE
        try:
            raw = read_checkpoint(path)
        except CorruptRecordError as exc:
            _log.warning("ignoring %s (%s): every queue will be rescanned", path, exc)
            return None
        if raw is None:
            return None
        try:
            data = msgpack.unpackb(raw, raw=False)
        except ValueError as exc:
            _log.warning("ignoring %s (%s): every queue will be rescanned", path, exc)
            return None
        return data if isinstance(data, dict) else None

    def read_watermarks(self) -> dict[tuple[int, int], int] | None:
        """``(topic id, queue) -> offset`` from the checkpoint; None when missing or unreadable
        (then every log must be rescanned)."""
        data = self._read_checkpoint()
        if data is None:
            return None
        try:
            return {(int(t), int(q)): int(o) for t, q, o in data["watermarks"]}
        except (ValueError, KeyError, TypeError, OverflowError) as exc:  # int(inf): Overflow
            _log.warning("ignoring %s (%s): every queue will be rescanned",
                         self.directory / WATERMARKS_FILE, exc)
            return None

    def read_clock(self) -> tuple[int, int, int, int] | None:
        """``(scheduler clock ms, wall ms, lowest skew, highest skew)`` from the checkpoint
        (see :meth:`write_watermarks`); None when missing."""
        data = self._read_checkpoint()
        if data is None:
            return None
        try:
            s, w, lo, hi = data["clock"]
            return int(s), int(w), int(lo), int(hi)
        except (ValueError, KeyError, TypeError, OverflowError):
            return None

    def write_watermarks(self, marks: dict[tuple[int, int], int],
                         clock: tuple[int, int, int, int] | None = None) -> None:
        """Atomically replace the watermark checkpoint; ``clock`` is the scheduler's clock
        reading ``(scheduler ms, wall ms)`` taken together, and the range of skews its entries
        were written with (see :mod:`ferrymq.broker.scheduler`).

        Raises:
            OSError: the write failed (the previous checkpoint is untouched).
        """
        doc: dict[str, object] = {
            "version": 1, "watermarks": [[t, q, o] for (t, q), o in sorted(marks.items())]}
        if clock is not None:
            doc["clock"] = list(clock)
        payload = msgpack.packb(doc, use_bin_type=True)
        write_checkpoint(self.directory / WATERMARKS_FILE, payload)
