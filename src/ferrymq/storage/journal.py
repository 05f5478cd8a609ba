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

__all__ = ["MAX_JOURNAL_RECORD_BYTES", "Journal"]

MAX_JOURNAL_RECORD_BYTES = 16 << 20
"""Largest record accepted (and believed on replay: a larger length is a torn tail)."""

_HEAD = struct.Struct("<II")


class Journal:
    """One journal file. ``append`` on one thread, ``flush`` from any."""

    def __init__(self, path: Path, fd: int, size: int) -> None:
        self.path = path
        self._fd = fd
        self._size = size
        self._durable = size
        self._lock = threading.Lock()  # size, durable, closed
        self._fsync_lock = threading.Lock()  # close waits for an fsync in progress
        self._closed = False
        self.dropped_bytes = 0

    @classmethod
    def open(cls, path: Path) -> tuple[Journal, list[Any]]:
        """Open (or create) the journal at ``path``; return it and its records in order.

        A torn tail is truncated (see :attr:`dropped_bytes`).
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
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        j = cls(path, fd, pos)
        if pos < n:
            os.ftruncate(fd, pos)
            os.fsync(fd)
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
            OSError: the write failed.
        """
        if self._closed:
            raise LogClosedError(f"journal {self.path} is closed")
        payload = msgpack.packb(record, use_bin_type=True)
        if len(payload) > MAX_JOURNAL_RECORD_BYTES:
            raise ValueError(f"journal record of {len(payload)} bytes")
        buf = _HEAD.pack(len(payload), crc32c(payload)) + payload
        with self._lock:
            written = os.write(self._fd, buf)
            if written != len(buf):  # a short write (no space for the rest): cut it back
                try:
                    os.ftruncate(self._fd, self._size)
                except OSError:  # a torn tail that cannot be cut: refuse to go on
                    self._closed = True
                raise OSError(errno.ENOSPC, f"short write to {self.path} (no space left)")
            self._size += len(buf)
            return self._size

    def flush(self) -> int:
        """fsync; return the byte position now durable."""
        with self._fsync_lock:
            with self._lock:
                if self._closed:
                    return self._durable
                target = self._size
            os.fsync(self._fd)
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
            data = os.pread(self._fd, end - start, start)
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
                os.fsync(self._fd)
                self._durable = self._size
            finally:
                os.close(self._fd)
