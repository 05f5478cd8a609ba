"""The file behind a sparse index: entries live in memory, the file is written whole.

:class:`~ferrymq.storage.index.OffsetIndex` and :class:`~ferrymq.storage.timeindex.TimeIndex`
keep their entries in memory and write them to their file with :meth:`IndexFile.write_file`
(atomically) when their segment is sealed and flushed, and at close, if the entries changed
since the file was last loaded or written (:meth:`IndexFile.save`: an idle queue's close writes
nothing); they hold no descriptor. The file is a cache that recovery validates and rebuilds.
"""

from __future__ import annotations

from pathlib import Path

from ferrymq.storage.files import atomic_write


class IndexFile:
    """The path of one index file; subclasses define :meth:`to_bytes`."""

    __slots__ = ("_unsaved", "base_offset", "path")

    def __init__(self, path: Path, base_offset: int) -> None:
        self.path = path
        self.base_offset = base_offset
        self._unsaved = True
        """Whether the entries may differ from the file (a new index: the file is unknown)."""

    def to_bytes(self) -> bytes:  # pragma: no cover - abstract
        """The whole file's content for the in-memory entries."""
        raise NotImplementedError

    def write_file(self) -> None:
        """Atomically replace the file with the in-memory entries (durable on return).

        Raises:
            OSError: the file cannot be written (the old one is untouched).
        """
        atomic_write(self.path, self.to_bytes())
        self._unsaved = False

    def save(self) -> None:
        """:meth:`write_file` if the entries changed since the file was loaded or written.

        Raises:
            OSError: the file cannot be written.
        """
        if self._unsaved:
            self.write_file()
