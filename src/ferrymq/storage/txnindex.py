"""The aborted-transaction index of one segment (``<base>.txnindex``, Kafka's ``.txnindex``).

Theory of operation. When an ABORT marker is appended for a producer whose transaction on the
queue opened at ``first_offset``, one 24-byte entry is appended (one ``write(2)``) to the index
of the segment that holds the marker::

    off  size  field
    0    8     producer_id    i64
    8    8     first_offset   i64  first offset of the aborted transaction (maybe in an older segment)
    16   8     marker_offset  i64  offset of the ABORT marker (inside this segment)

Little-endian, entries in marker order. The file also says something by existing: it is
created (empty) by the first control batch, COMMIT or ABORT, appended to its segment, so *a
segment has a ``.txnindex`` file iff it holds a control batch* (``Segment.has_control``). A
segment that never saw a marker has no file and costs nothing.

Durability: the file is fsynced with the segment's other index files (when the segment is sealed
and flushed, and at close); a segment above the recovery point is rescanned by unclean recovery,
which rebuilds its file from the log (``Log.open``), so the active segment's entries need no
fsync of their own. No descriptor is held: each append opens, writes and closes (aborts are
rare), and the fsync opens the file again (an fsync covers the file, whatever descriptor wrote
it; a failed append rewrites the whole file instead). A torn last entry (a size that is not a
multiple of 24) is cut when the file is loaded. Entries are kept in memory, loaded lazily on
first use: aborts are rare and the lists are short.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import NamedTuple

from ferrymq.storage.files import atomic_write, fsync_file

__all__ = ["TXN_ENTRY", "TXN_ENTRY_SIZE", "AbortedTxn", "TxnIndex"]

_log = logging.getLogger("ferrymq.storage")

TXN_ENTRY = struct.Struct("<qqq")
TXN_ENTRY_SIZE = TXN_ENTRY.size  # 24
assert TXN_ENTRY_SIZE == 24


class AbortedTxn(NamedTuple):
    """One aborted transaction on a queue."""

    producer_id: int
    first_offset: int
    marker_offset: int


class TxnIndex:
    """The ``.txnindex`` file of one segment and its entries in memory.

    Single writer (the log's writer thread), like the segment. :meth:`fsync` may run on the
    flusher thread.
    """

    __slots__ = ("_dirty", "_entries", "_present", "_unsynced", "base_offset", "path")

    def __init__(self, path: Path, base_offset: int, *, present: bool) -> None:
        """Describe the index of the segment at ``base_offset``; ``present``: the file exists
        (its entries are read on first use)."""
        self.path = path
        self.base_offset = base_offset
        self._present = present
        self._entries: list[AbortedTxn] | None = None if present else []
        self._unsynced = False
        self._dirty = False

    @property
    def present(self) -> bool:
        """Whether the file exists, i.e. the segment holds a control batch."""
        return self._present

    def entries(self) -> list[AbortedTxn]:
        """The entries, in marker order (loaded from the file on first use; do not mutate)."""
        entries = self._entries
        if entries is None:
            entries = self._entries = self._load()
        return entries

    def _load(self) -> list[AbortedTxn]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            self._present = False
            return []
        whole = len(data) - len(data) % TXN_ENTRY_SIZE
        if whole != len(data):
            _log.warning(
                "%s: cutting a torn entry (%d bytes) at position %d",
                self.path, len(data) - whole, whole,
            )
            os.truncate(self.path, whole)
        out: list[AbortedTxn] = []
        for pid, first, marker in TXN_ENTRY.iter_unpack(memoryview(data)[:whole]):
            if marker < self.base_offset or first > marker or pid < 0:
                _log.warning("%s: ignoring an impossible entry %s", self.path, (pid, first, marker))
                continue
            out.append(AbortedTxn(pid, first, marker))
        return out

    # --- writing -------------------------------------------------------------------------------

    def mark(self) -> bool:
        """Note that the segment holds a control batch: create the file if it does not exist.

        Returns:
            True when the file was created (the caller fsyncs the directory with its next
            flush).

        Raises:
            OSError: the file cannot be created.
        """
        if self._present:
            return False
        os.close(self._open_for_append())
        self._present = True
        return True

    def _open_for_append(self) -> int:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._unsynced = True
        return fd

    def append(self, entry: AbortedTxn) -> None:
        """Add an entry (one ``write(2)``; the file is created if needed).

        The entry is in memory even when the write fails; the whole file is then rewritten by
        the next :meth:`fsync`.

        Raises:
            OSError: the write failed.
        """
        self.entries().append(entry)
        self._present = True
        try:
            fd = self._open_for_append()
            try:
                written = os.write(fd, TXN_ENTRY.pack(*entry))
            finally:
                os.close(fd)
            if written != TXN_ENTRY_SIZE:
                raise OSError(f"{self.path}: short write of {written} bytes")
        except OSError:
            self._dirty = True
            raise

    def replace(self, entries: list[AbortedTxn], *, present: bool) -> None:
        """Rewrite the file from ``entries`` (recovery, truncation): atomically when ``present``,
        else delete it (the segment holds no control batch).

        Raises:
            OSError: the file cannot be written or deleted.
        """
        self._entries = list(entries)
        self._dirty = False
        self._unsynced = False
        if present:
            atomic_write(self.path, b"".join(TXN_ENTRY.pack(*e) for e in entries))
        else:
            self.path.unlink(missing_ok=True)
        self._present = present

    def truncate_to(self, offset: int) -> None:
        """Drop the entries whose marker is at or above ``offset`` (the log was truncated).

        The file stays (``has_control`` may then be conservatively true).
        """
        if not self._present:
            return
        entries = self.entries()
        kept = [e for e in entries if e.marker_offset < offset]
        if len(kept) != len(entries):
            self.replace(kept, present=True)

    def fsync(self) -> None:
        """Make the file durable if it was appended to since the last fsync (rewriting it
        whole if an append failed).

        Raises:
            OSError: the file cannot be opened, written or fsynced.
        """
        if self._dirty and self._entries is not None:
            self.replace(self._entries, present=True)
            return
        if not self._unsynced:
            return
        fsync_file(self.path)
        self._unsynced = False

    def collect(self, start: int, upto: int, out: list[tuple[int, int]]) -> None:
        """Add ``(producer_id, first_offset)`` of entries with ``first_offset < upto`` and
        ``marker_offset >= start`` to ``out``."""
        for pid, first, marker in self.entries():
            if first < upto and marker >= start:
                out.append((pid, first))
