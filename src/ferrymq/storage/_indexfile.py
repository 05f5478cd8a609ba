"""The append-only file behind a sparse index: one owner for opening, appending, fsync, close.

:class:`~ferrymq.storage.index.OffsetIndex` and :class:`~ferrymq.storage.timeindex.TimeIndex`
keep their entries in memory and mirror them to a file with this; the file is a cache that
recovery validates and rebuilds.
"""

from __future__ import annotations

import os
from pathlib import Path

from ferrymq.storage.files import atomic_write


class IndexFile:
    """Owns the file descriptor of one index file; subclasses define :meth:`to_bytes`."""

    __slots__ = ("_fd", "base_offset", "path")

    def __init__(self, path: Path, base_offset: int) -> None:
        self.path = path
        self.base_offset = base_offset
        self._fd: int | None = None

    def to_bytes(self) -> bytes:  # pragma: no cover - abstract
        """The whole file's content for the in-memory entries."""
        raise NotImplementedError

    def write_file(self) -> None:
        """Atomically replace the file with the in-memory entries (reopening if open)."""
        was_open = self._fd is not None
        self.close()
        atomic_write(self.path, self.to_bytes())
        if was_open:
            self.open_for_append()

    def open_for_append(self, *, truncate: bool = False) -> None:
        """Open the file so that later appends write through to it.

        Args:
            truncate: start from an empty file (a new segment: no fsync needed, it is a cache).
        """
        if self._fd is None:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_TRUNC if truncate else 0)
            self._fd = os.open(self.path, flags, 0o644)

    def fsync(self) -> None:
        """Fsync the file if it is open for appends."""
        fd = self._fd
        if fd is not None:
            os.fsync(fd)

    def close(self) -> None:
        """Close the append descriptor (the entries stay in memory)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
