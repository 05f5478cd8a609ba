"""An append-only journal of small CRC-checked records (the delivery groups' state changes).

Theory of operation
-------------------
A journal is one file of records back to back::

    off  size  field
    0    4     length   u32  payload bytes
    4    4     crc      u32  CRC32C of the payload
    8          payload  msgpack (the caller's record, a list)

The event loop appends with one ``write(2)`` per record (the file is opened ``O_APPEND``); the
flusher thread calls :meth:`Journal.flush`, which fsyncs and returns the byte position now
durable. Appends and fsyncs may interleave: the position returned is the one read before the
fsync started, so it never claims more than was covered.

The descriptor is a :class:`~ferrymq.storage.handles.FileHandle` of a cache the owner passes
(the broker's one cache, shared with every segment file), so a journal nobody writes to holds
no descriptor: the cache closes it once an fsync covered its writes, and the next append opens
it again. A broker with many delivery groups therefore holds at most the cache's capacity of
descriptors for them, not one per group. An append that cannot get a descriptor (EMFILE,
ENFILE) raises ``OSError`` before writing anything.

:func:`Journal.open` replays the file. A record whose length or CRC does not check, and
everything after it, is a torn tail from a crash during an append: it is truncated and reported
(``dropped_bytes``). Records are only ever appended after earlier ones were written, so the
first bad record is the end of what was written; nothing valid is silently skipped past.
The owner keeps the journal short by writing a snapshot of its state elsewhere and starting a
new journal (see :mod:`ferrymq.broker.delivery.store`).
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from pathlib import Path
from typing import Any

import msgpack

from ferrymq.errors import CorruptRecordError, LogClosedError
from ferrymq.protocol.records import crc32c
from ferrymq.storage.files import rewrite_in_place
from ferrymq.storage.handles import FileHandle, FileHandles

__all__ = ["MAX_JOURNAL_RECORD_BYTES", "Journal"]

MAX_JOURNAL_RECORD_BYTES = 16 << 20
"""Largest record accepted (and believed on replay: a larger length is a torn tail)."""

_HEAD = struct.Struct("<II")
_FLAGS = os.O_RDWR | os.O_APPEND


class Journal:
    """One journal file. ``append`` on one thread (the owner of its descriptor cache), ``flush``
    from any."""

    def __init__(self, path: Path, handle: FileHandle, size: int) -> None:
        self.path = path
        self._handle = handle
        self._size = size
        self._durable = size
        self._lock = threading.Lock()  # size, durable, closed
        self._fsync_lock = threading.Lock()  # close waits for an fsync in progress
        self._closed = False
        self.dropped_bytes = 0

    @classmethod
    def open(cls, path: Path, handles: FileHandles | None = None) -> tuple[Journal, list[Any]]:
        """Open (or create) the journal at ``path``; return it and its records in order.

        A torn tail is truncated (see :attr:`dropped_bytes`).

        Args:
            path: the journal file.
            handles: the descriptor cache its descriptor lives in (None: a cache of its own).

        Raises:
            OSError: the file cannot be read, created or repaired (EMFILE, ENOSPC, ...).
        """
        data = path.read_bytes() if path.exists() else b""
        records: list[Any] = []
        pos = 0
        n = len(data)
        while pos + _HEAD.size <= n:
            length, crc = _HEAD.unpack_from(data, pos)
            end = pos + _HEAD.size + length
            if length > MAX_JOURNAL_RECORD_BYTES or end > n:
                break
            payload = data[pos + _HEAD.size : end]
            if crc32c(payload) != crc:
                break
            try:
                records.append(msgpack.unpackb(payload, raw=False, strict_map_key=False))
            except Exception:  # noqa: BLE001 - a CRC-valid but undecodable record: stop here
                break
            pos = end
        handle = (handles or FileHandles()).register(path, _FLAGS,
                                                     create_flags=_FLAGS | os.O_CREAT)
        j = cls(path, handle, pos)
        if pos < n:
            try:
                fd = handle.get()
                os.ftruncate(fd, pos)
                os.fsync(fd)  # before the handle may be evicted: it holds no unsynced write
            except BaseException:
                handle.close()
                raise
            j.dropped_bytes = n - pos
        return j, records

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._size

    @property
    def durable(self) -> int:
        """Bytes known to be fsynced."""
        return self._durable

    def append(self, record: Any) -> int:
        """Write one record; return the journal's end position after it.

        Raises:
            LogClosedError: the journal is closed.
            ValueError: the record is larger than MAX_JOURNAL_RECORD_BYTES.
            OSError: the write failed, or no descriptor could be opened for it (nothing
                written).
        """
        if self._closed:
            raise LogClosedError(f"journal {self.path} is closed")
        payload = msgpack.packb(record, use_bin_type=True)
        if len(payload) > MAX_JOURNAL_RECORD_BYTES:
            raise ValueError(f"journal record of {len(payload)} bytes")
        buf = _HEAD.pack(len(payload), crc32c(payload)) + payload
        handle = self._handle
        fd = handle.get()
        with self._lock:
            try:
                written = os.write(fd, buf)
            except OSError:
                handle.wrote()  # it may have written part of it: keep it open until fsynced
                raise
            handle.wrote()
            if written != len(buf):  # a short write (no space for the rest): cut it back
                try:
                    os.ftruncate(fd, self._size)
                except OSError:  # a torn tail that cannot be cut: refuse to go on
                    self._closed = True
                raise OSError(errno.ENOSPC, f"short write to {self.path} (no space left)")
            self._size += len(buf)
            return self._size

    def hold(self) -> None:
        """Open the descriptor now if it is closed, and keep it open until :meth:`release`
        (owner thread): a caller about to change state and journal it checks this way, before
        changing anything, that the appends will have a descriptor.

        Raises:
            LogClosedError: the journal is closed.
            OSError: no descriptor (EMFILE, ENFILE) or the file is gone.
        """
        if self._closed:
            raise LogClosedError(f"journal {self.path} is closed")
        self._handle.get()
        if self._handle.pin() is None:  # cannot be: get() opened it on this thread
            raise LogClosedError(f"journal {self.path} is closed")

    def release(self) -> None:
        """End a :meth:`hold`."""
        self._handle.unpin()

    @property
    def is_open(self) -> bool:
        """Whether its descriptor is open now (an idle journal's is closed by the cache)."""
        return self._handle.fd is not None

    def flush(self) -> int:
        """fsync; return the byte position now durable."""
        with self._fsync_lock:
            with self._lock:
                if self._closed:
                    return self._durable
                target = self._size
            self._handle.fsync()  # closed: every write was fsynced before it was closed
            with self._lock:
                if target > self._durable:
                    self._durable = target
                return self._durable

    def rewrite_tail(self) -> int:
        """After a failed fsync (ENOSPC): read the records past the durable position back,
        check their lengths and CRCs, write the same bytes again in place through a new
        descriptor and fsync it; return the position now durable.

        Raises:
            CorruptRecordError: the bytes read back are not whole records (the page cache
                lost them: a restart's replay cuts them).
            OSError: the write or fsync failed (still no space).
            LogClosedError: the journal is closed.
        """
        with self._fsync_lock:
            with self._lock:
                if self._closed:
                    raise LogClosedError(f"journal {self.path} is closed")
                start, end = self._durable, self._size
            data = os.pread(self._handle.get(), end - start, start)
            pos = 0
            while pos + _HEAD.size <= len(data):
                length, crc = _HEAD.unpack_from(data, pos)
                nxt = pos + _HEAD.size + length
                if nxt > len(data) or crc32c(data[pos + _HEAD.size : nxt]) != crc:
                    break
                pos = nxt
            if pos != end - start:
                raise CorruptRecordError(f"{self.path}: records from {start} not readable")
            rewrite_in_place(self.path, data, start)
            with self._lock:
                self._durable = max(self._durable, end)
                return self._durable

    def close(self) -> None:
        """fsync and close (idempotent)."""
        with self._fsync_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._handle.fsync()
                self._durable = self._size
            finally:
                self._handle.close()
