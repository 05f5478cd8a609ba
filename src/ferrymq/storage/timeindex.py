"""Sparse time index of one segment: append time -> offset, for seek by time.

Theory of operation: append times are stamped by the broker and never decrease within a log,
so a segment's batches are sorted by append time. An entry ``(append_time_ms, offset)`` says
"the batch starting at ``offset`` was appended at ``append_time_ms``"; entries are added next
to offset-index entries and when a segment is sealed (an entry for its last batch, so the last
entry of a sealed segment holds its largest append time, which retention reads). Entry times
and offsets are strictly increasing. File layout, 12 bytes per entry, little-endian::

    off  size  field
    0    8     append_time_ms    i64
    8    4     relative_offset   u32  offset - segment base_offset

To find the first batch appended at or after ``t``, start from the last entry whose time is
below ``t`` (everything up to it is older) and walk batch headers. Like the offset index it is
a validated cache that recovery rebuilds.
"""

from __future__ import annotations

import struct
from array import array
from bisect import bisect_left
from pathlib import Path

from ferrymq.storage._indexfile import IndexFile

__all__ = ["TimeIndex"]

_ENTRY = struct.Struct("<qI")


class TimeIndex(IndexFile):
    """The in-memory and on-disk sparse time index of one segment."""

    __slots__ = ("_relative_offsets", "_times_ms")

    def __init__(self, path: Path, base_offset: int) -> None:
        """An empty time index for the segment at ``base_offset``; nothing is written yet."""
        super().__init__(path, base_offset)
        self._times_ms: array[int] = array("q")
        self._relative_offsets: array[int] = array("I")

    @classmethod
    def load(cls, path: Path, base_offset: int, *, max_relative_offset: int) -> TimeIndex | None:
        """Load and validate a time index file; None when missing or not consistent."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if len(data) % _ENTRY.size:
            return None
        index = cls(path, base_offset)
        last_t = last_rel = -1
        for t, rel in _ENTRY.iter_unpack(data):
            if t <= last_t or rel <= last_rel or rel > max_relative_offset:
                return None
            index._times_ms.append(t)
            index._relative_offsets.append(rel)
            last_t, last_rel = t, rel
        index._unsaved = False
        return index

    def __len__(self) -> int:
        return len(self._times_ms)

    @property
    def last_entry(self) -> tuple[int, int] | None:
        """``(append_time_ms, offset)`` of the last entry, or None when empty."""
        if not self._times_ms:
            return None
        return self._times_ms[-1], self.base_offset + self._relative_offsets[-1]

    def lookup_before(self, time_ms: int) -> int:
        """Offset of the last entry appended strictly before ``time_ms`` (else the base offset)."""
        i = bisect_left(self._times_ms, time_ms)
        if i == 0:
            return self.base_offset
        return self.base_offset + self._relative_offsets[i - 1]

    def maybe_append(self, time_ms: int, offset: int) -> None:
        """Add ``(time_ms, offset)`` if both are above the last entry's (in memory)."""
        rel = offset - self.base_offset
        if self._times_ms and (time_ms <= self._times_ms[-1] or rel <= self._relative_offsets[-1]):
            return
        self._times_ms.append(time_ms)
        self._relative_offsets.append(rel)
        self._unsaved = True

    def truncate_to_offset(self, offset: int) -> None:
        """Drop every entry whose offset is >= ``offset`` (in memory)."""
        rel = offset - self.base_offset
        keep = len(self._relative_offsets)
        while keep and self._relative_offsets[keep - 1] >= rel:
            keep -= 1
        if keep < len(self._times_ms):
            del self._times_ms[keep:]
            del self._relative_offsets[keep:]
            self._unsaved = True

    def to_bytes(self) -> bytes:
        """The file image of the index."""
        return b"".join(
            _ENTRY.pack(t, rel) for t, rel in zip(self._times_ms, self._relative_offsets, strict=True)
        )
