"""Sparse offset index of one segment: offset -> file position.

Theory of operation: one entry is added every ``index_interval_bytes`` of log (for the batch
that starts after at least that many bytes since the previous entry), so a lookup lands at most
about one interval before the wanted batch and the reader walks batch headers from there. An
entry is two little-endian u32: the batch's base offset relative to the segment's base offset
and the batch's byte position in the ``.log`` file (8 bytes per entry)::

    off  size  field
    0    4     relative_offset   u32  base_offset - segment base_offset
    4    4     position          u32  byte position of that batch in the .log file

Entries are kept in memory in two ``array.array("I")`` (8 bytes per entry, no per-entry Python
objects: 10 GB of log at 4 KiB intervals is about 20 MB); the ``.index`` file is written whole
when the segment is sealed and flushed, and at close (no descriptor is held meanwhile). The
index is a cache, never the truth: on load it is validated (size a multiple of 8, strictly
increasing offsets and positions, positions inside the segment) and any failure makes the caller
rebuild it from the log. A reader also checks that the batch found at an entry's position has
the entry's offset, which catches damage the load check cannot see.
"""

from __future__ import annotations

import itertools
import sys
from array import array
from bisect import bisect_right
from pathlib import Path

from ferrymq.storage._indexfile import IndexFile

__all__ = ["MAX_RELATIVE_OFFSET", "OffsetIndex"]

MAX_RELATIVE_OFFSET = 0xFFFFFFFF  # u32 field: a segment rolls before its offsets span more
_ENTRY_BYTES = 8


def _u32_pairs(data: bytes) -> tuple[array[int], array[int]]:
    flat = array("I")
    flat.frombytes(data)
    if sys.byteorder == "big":
        flat.byteswap()
    return array("I", flat[0::2]), array("I", flat[1::2])


def _strictly_increasing(values: array[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(values))


class OffsetIndex(IndexFile):
    """The in-memory and on-disk sparse offset index of one segment.

    Not thread-safe: owned by the log's writer thread (the flusher only calls :meth:`fsync`).
    """

    __slots__ = ("_positions", "_relative_offsets")

    def __init__(self, path: Path, base_offset: int) -> None:
        """An empty index for the segment at ``base_offset``; nothing is written yet."""
        super().__init__(path, base_offset)
        self._relative_offsets: array[int] = array("I")
        self._positions: array[int] = array("I")

    @classmethod
    def load(
        cls, path: Path, base_offset: int, *, size_bytes: int, max_relative_offset: int
    ) -> OffsetIndex | None:
        """Load and validate an index file; None when it is missing or not consistent.

        Args:
            path: the ``.index`` file.
            base_offset: the segment's base offset.
            size_bytes: the segment's log size: every position must be below it.
            max_relative_offset: largest relative offset the segment can hold.
        """
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if len(data) % _ENTRY_BYTES:
            return None
        rel, pos = _u32_pairs(data)
        if rel and (rel[-1] > max_relative_offset or pos[-1] >= size_bytes):
            return None
        if not (_strictly_increasing(rel) and _strictly_increasing(pos)):
            return None
        index = cls(path, base_offset)
        index._relative_offsets = rel
        index._positions = pos
        index._unsaved = False
        return index

    def __len__(self) -> int:
        return len(self._positions)

    @property
    def last_entry(self) -> tuple[int, int] | None:
        """``(offset, position)`` of the last entry, or None when empty."""
        if not self._positions:
            return None
        return self.base_offset + self._relative_offsets[-1], self._positions[-1]

    def lookup(self, offset: int) -> tuple[int, int]:
        """``(offset, position)`` of the largest entry whose offset is <= ``offset``.

        Returns ``(base_offset, 0)`` when there is no such entry (the segment's first batch).
        """
        i = bisect_right(self._relative_offsets, offset - self.base_offset)
        if i == 0:
            return self.base_offset, 0
        return self.base_offset + self._relative_offsets[i - 1], self._positions[i - 1]

    def append(self, offset: int, position: int) -> None:
        """Add an entry (offset and position above the last entry's), in memory."""
        rel = offset - self.base_offset
        if self._positions and (rel <= self._relative_offsets[-1] or position <= self._positions[-1]):
            raise ValueError(f"index entry ({offset}, {position}) is not after the last one")
        self._relative_offsets.append(rel)
        self._positions.append(position)
        self._unsaved = True

    def truncate_to_position(self, position: int) -> None:
        """Drop every entry whose position is >= ``position`` (in memory)."""
        keep = bisect_right(self._positions, position - 1)
        if keep < len(self._positions):
            del self._relative_offsets[keep:]
            del self._positions[keep:]
            self._unsaved = True

    def to_bytes(self) -> bytes:
        """The file image of the index."""
        flat = array("I", bytes(_ENTRY_BYTES * len(self._positions)))
        flat[0::2] = self._relative_offsets
        flat[1::2] = self._positions
        if sys.byteorder == "big":
            flat.byteswap()
        return flat.tobytes()
