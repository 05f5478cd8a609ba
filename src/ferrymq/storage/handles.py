"""An LRU of open file descriptors, so that idle files cost none and open files stay bounded.

Theory of operation
-------------------
A broker serves any number of queues, each with one or more segment files, but a process may
hold only ``RLIMIT_NOFILE`` descriptors. So a segment's ``.log`` is a :class:`FileHandle`
registered with the broker's one :class:`FileHandles`, which keeps at most ``capacity`` of
them open: a closed handle is opened again on use, after the least recently used evictable
handles were closed to make room (Kafka and RocketMQ deployments with many queues need the
same; Kafka answers it with huge descriptor limits, this bounds the count by design). An idle
queue then costs no descriptor, and an active one's hot path pays a dictionary move, no system
call.

Two threads use handles, with different rights:

* The **owner** thread (the log's single writer: the broker's event loop) calls
  :meth:`FileHandle.get`, which returns the open descriptor or opens it, and is the only thread
  that opens or evicts. A descriptor it got stays valid until it itself closes or evicts it,
  so it may use it without a lock.
* **Other** threads (the flusher) never open or close: :meth:`FileHandle.pin` returns the
  descriptor and keeps it open until :meth:`FileHandle.unpin`, or returns None when the
  handle is closed.

A handle is evictable when nobody pins it and it holds no write since its last successful
fsync. The owner counts writes (:meth:`FileHandle.wrote`, after each write or truncation
completed, and :meth:`FileHandle.mark_unsynced` for a file that a crashed process may have
left in the page cache only); an fsync records the count it covers (taken when it pinned,
before the fsync started). So a closed handle is always clean: an fsync of it has nothing to do and returns at
once (:meth:`FileHandle.fsync`), and no fsync ever goes through a descriptor other than the
one the writes went through (an fsync after reopening would not report a writeback error that
the old descriptor's file saw; fsyncgate). After a failed fsync the handle stays dirty, hence
open.

Lock order: the cache's :attr:`FileHandles.lock` is a leaf, taken under a log's ``_flush_lock``
(pins) and never while waiting for anything else; a close under it is one ``close(2)``.

The capacity is soft: when every open handle is dirty or pinned (more queues written than
``capacity`` before the next flush), a handle is opened anyway; once they were flushed, the
owner's :meth:`FileHandles.trim` (the broker calls it after each flush round) or its next open
brings the cache back under its capacity. An open that fails with EMFILE or ENFILE (the
process or the system is out of descriptors: connections took them) closes up to
:data:`EMFILE_SHED` evictable handles and tries once more; if that fails too the ``OSError``
reaches the caller (the broker answers it with a retriable BUSY) and nothing was changed.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict
from itertools import islice
from pathlib import Path

from ferrymq import _faults
from ferrymq.errors import LogClosedError

__all__ = ["DEFAULT_CAPACITY", "EMFILE_SHED", "EVICTION_SCAN", "FileHandle", "FileHandles"]

DEFAULT_CAPACITY = 1024
"""Capacity of a cache made for a log opened without one (tools, tests): the broker passes its
own, sized from its descriptor budget."""
EVICTION_SCAN = 64
"""Most handles looked at, from the least recently used, to find one to evict (the unsynced and
pinned ones met move to the other end, so searches do not meet them again and again)."""
EMFILE_SHED = 64
"""On EMFILE/ENFILE, at most this many evictable handles are closed before the one retry."""
_NO_DESCRIPTOR = frozenset((errno.EMFILE, errno.ENFILE))


class FileHandle:
    """One file that may be open or closed: its path, its flags and its descriptor when open.

    Attributes:
        path: the file.
        flags: the ``os.open`` flags to (re)open it with.
        fd: the descriptor while open (read it through :meth:`get` or :meth:`pin`).
        writes: writes counted by :meth:`wrote`.
    """

    __slots__ = ("_cache", "_pins", "_released", "_synced", "fd", "flags", "path", "writes")

    def __init__(self, cache: FileHandles, path: Path, flags: int) -> None:
        """Use :meth:`FileHandles.register`."""
        self._cache = cache
        self.path = path
        self.flags = flags
        self.fd: int | None = None
        self.writes = 0
        self._synced = 0
        self._pins = 0
        self._released = False

    @property
    def dirty(self) -> bool:
        """Whether a write counted by :meth:`wrote` is not yet covered by a successful fsync."""
        return self.writes != self._synced

    def get(self) -> int:
        """The open descriptor, opened first if closed (owner thread only); marks the handle
        most recently used.

        Raises:
            LogClosedError: the handle was closed for good (:meth:`close`).
            OSError: the file cannot be opened (EMFILE/ENFILE after shedding, ENOENT, ...).
        """
        fd = self.fd
        if fd is not None:
            self._cache.touch(self)
            return fd
        return self._cache.open(self)

    def wrote(self) -> None:
        """Count a write or truncation through the descriptor (owner thread, after it
        completed): the handle is not evicted until an fsync covered it."""
        self.writes += 1

    def mark_unsynced(self) -> None:
        """Note that the file may hold data that is not durable although nothing was written
        through this handle (a crashed process wrote it; recovery then fsyncs it): open it
        (owner thread) and keep it open until an fsync covered it.

        Raises:
            LogClosedError, OSError: as :meth:`get`.
        """
        self.get()
        self.writes += 1

    def pin(self) -> tuple[int, int] | None:
        """Keep the descriptor open until :meth:`unpin` (any thread).

        Returns:
            ``(descriptor, writes so far)``, or None when the handle is closed (it is clean
            then: nothing to fsync).
        """
        with self._cache.lock:
            fd = self.fd
            if fd is None:
                return None
            self._pins += 1
            writes = self.writes
        if _faults.FSYNC_JOURNAL:
            _faults.note_fsync_begin(str(self.path), fd, writes)
        return fd, writes

    def unpin(self, synced_writes: int | None = None) -> None:
        """End a :meth:`pin`; ``synced_writes``: the write count it returned, when an fsync
        started after the pin succeeded (None: no fsync, or it failed)."""
        with self._cache.lock:
            self._pins -= 1
            if synced_writes is not None and synced_writes > self._synced:
                self._synced = synced_writes
            if synced_writes is not None and _faults.FSYNC_JOURNAL:
                _faults.note_fsynced(str(self.path), synced_writes)
            if self._released and not self._pins:
                self._cache.close_locked(self)

    def fsync(self) -> None:
        """Fsync the file if open (any thread); a closed handle is clean and needs none.

        Raises:
            OSError: the fsync failed (the handle stays dirty).
        """
        pinned = self.pin()
        if pinned is None:
            return
        fd, writes = pinned
        synced: int | None = None
        try:
            os.fsync(fd)
            synced = writes
        finally:
            self.unpin(synced)

    def close(self) -> None:
        """Close the descriptor for good (owner thread; idempotent). A pinned descriptor is
        closed by the last :meth:`unpin`."""
        with self._cache.lock:
            self._released = True
            if not self._pins:
                self._cache.close_locked(self)

    def __repr__(self) -> str:
        state = "released" if self._released else "open" if self.fd is not None else "closed"
        return f"FileHandle({str(self.path)!r}, {state}, writes={self.writes})"


class FileHandles:
    """The open descriptors of many files, at most ``capacity`` of them (soft, see the module
    docstring), evicting the least recently used.

    Attributes:
        capacity: how many descriptors to keep open at most.
        opens: descriptors opened so far (first opens and reopens).
        evictions: descriptors closed to make room or to shed after EMFILE.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        """An empty cache.

        Raises:
            ValueError: ``capacity`` below 1.
        """
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, not {capacity}")
        self.capacity = capacity
        self.lock = threading.Lock()
        """Guards descriptors against pin/close races (pins, closes, evictions take it)."""
        self._open: OrderedDict[FileHandle, None] = OrderedDict()
        self.opens = 0
        self.evictions = 0

    @property
    def open_count(self) -> int:
        """Descriptors open now."""
        return len(self._open)

    def register(self, path: Path, flags: int, *, create_flags: int | None = None) -> FileHandle:
        """A handle for ``path``, opened with ``flags`` whenever it is used.

        Args:
            path: the file.
            flags: ``os.open`` flags for every open (no ``O_CREAT``/``O_TRUNC`` for a file
                that must exist).
            create_flags: open it now with these flags (creating the file) instead of on
                first use.

        Raises:
            OSError: opening with ``create_flags`` failed.
        """
        handle = FileHandle(self, path, flags)
        if create_flags is not None:
            self.open(handle, create_flags)
        return handle

    def trim(self) -> int:
        """Close the least recently used evictable handles while more than ``capacity`` are
        open (owner thread): after a burst of writes to more files than ``capacity`` was
        flushed, the cache shrinks back without waiting for the next open. How many closed."""
        excess = len(self._open) - self.capacity
        return self._evict(excess, len(self._open)) if excess > 0 else 0

    def touch(self, handle: FileHandle) -> None:
        """Mark an open handle most recently used (owner thread)."""
        self._open.move_to_end(handle)

    def open(self, handle: FileHandle, flags: int | None = None) -> int:
        """Open a closed handle (owner thread), evicting first if at capacity; its descriptor.

        Raises:
            LogClosedError: the handle was closed for good.
            OSError: the open failed, also after shedding on EMFILE/ENFILE.
        """
        if handle._released:
            raise LogClosedError(f"{handle.path} is closed")
        self._evict(len(self._open) - self.capacity + 1, EVICTION_SCAN)
        flags = handle.flags if flags is None else flags
        try:
            fd = os.open(handle.path, flags, 0o644)
        except OSError as exc:
            if exc.errno not in _NO_DESCRIPTOR or not self._evict(EMFILE_SHED, len(self._open)):
                raise
            fd = os.open(handle.path, flags, 0o644)
        with self.lock:
            handle.fd = fd
            self._open[handle] = None
        self.opens += 1
        return fd

    def _evict(self, wanted: int, scan: int) -> int:
        """Close up to ``wanted`` evictable handles among the ``scan`` least recently used;
        how many were closed. The unsynced or pinned ones looked at move to the most recently
        used end (they are in use), so the next search starts past them."""
        if wanted <= 0:
            return 0
        closed = 0
        with self.lock:
            for h in list(islice(self._open, scan)):
                if h._pins or h.writes != h._synced:
                    self._open.move_to_end(h)
                    continue
                self.close_locked(h)
                closed += 1
                if closed >= wanted:
                    break
        self.evictions += closed
        return closed

    def close_locked(self, handle: FileHandle) -> None:
        """Close ``handle``'s descriptor now (the caller holds :attr:`lock`, nobody pins it)."""
        fd, handle.fd = handle.fd, None
        if fd is not None:
            self._open.pop(handle, None)
            os.close(fd)
