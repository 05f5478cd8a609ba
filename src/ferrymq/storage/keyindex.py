"""The key index of one queue: which offsets carry a given message key (RocketMQ's query by key).

Theory of operation
-------------------
The index is a *cache* built from the log after the fact, never on the produce path: a
background indexer reads batches past :attr:`KeyIndex.next_offset`, hashes every key of every
record (``crc32c`` of the key's UTF-8 bytes) and appends one *block* of ``(hash, offset)``
entries. A lookup scans the blocks for the key's hash and returns candidate offsets, newest
first; the caller must read the records and compare the keys (hashes collide).

Files, in ``<queue dir>/keyindex/``, named after the first offset they cover (20 digits, so
``ls`` lists them in offset order; the log's own recovery ignores the subdirectory)::

    00000000000000000000.kix
    00000000000000052311.kix      rolled once the previous file reached ``file_bytes``

File layout (little-endian)::

    off  size  field
    0    4     magic          b"FKIX"
    4    2     version        u16, 1
    6    2     reserved       u16, 0
    8    8     first_offset   i64, equal to the file name
    16   4     header_crc     u32, CRC32C of bytes [0, 16)
    20         blocks, back to back

Block layout (40-byte header, then ``count`` 12-byte entries)::

    off  size  field
    0    4     magic          b"KBLK"
    4    4     count          u32  entries in the block
    8    8     start          i64  first offset the block covers (the previous block's ``next``)
    16   8     next           i64  every record in [start, next) is indexed
    24   8     anchor_base    i64  base offset of the batch that ends at next - 1 (-1: none)
    32   4     anchor_crc     u32  that batch's body CRC (proves the log still holds it)
    36   4     crc            u32  CRC32C of bytes [0, 36) and of the entries
    40         entries: key_hash u32, offset i64; offsets never decrease

A block is written with one ``write(2)`` and never fsynced: a torn or damaged block fails its
CRC. Opening checks every file header and walks the newest file: the first bad block (magic,
CRC, a count that does not fit, a ``start`` that does not follow the previous ``next``) and
everything after it is cut. The newest surviving block's *anchor* must name a batch the log
still holds with the same CRC; when it does not (the log lost a torn tail after a crash, so
offsets may have been reused), older anchors are tried and, failing those, the whole index is
dropped and rebuilt from the log start. A damaged block met later by a lookup cuts the index
there too; the indexer then re-reads the log from the cut. Either way the index never claims
an offset it has not seen, and lookups only miss entries until the indexer catches up.

Retention: a file whose successor starts at or below the log start holds only deleted
offsets and is unlinked (:meth:`KeyIndex.delete_below`); lookups skip entries below the start.
Deleting the topic deletes the directory with the queue's log.

Single-threaded: every method runs on the broker's event-loop thread (like :meth:`Log.read`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ferrymq.errors import BrokerError, CorruptRecordError, OffsetOutOfRangeError
from ferrymq.protocol.kafka.envelope import ENVELOPE_MAGIC, native_batch
from ferrymq.protocol.records import (
    ATTR_HAS_KEYS,
    crc32c,
    decode_header,
    iter_batches,
    record_fields,
    walk_records,
)
from ferrymq.storage.files import OFFSET_DIGITS, TMP_SUFFIX
from ferrymq.storage.log import DEFAULT_MAX_CONVERTED_BATCH_BYTES as DEFAULT_MAX_CONVERTED
from ferrymq.storage.log import Log

__all__ = [
    "DEFAULT_KEY_INDEX_FILE_BYTES",
    "KEY_INDEX_DIR",
    "KEY_INDEX_SUFFIX",
    "KeyIndex",
    "KeyIndexReport",
    "key_hash",
    "scan_keys",
]

_log = logging.getLogger("ferrymq.storage")

KEY_INDEX_DIR = "keyindex"
KEY_INDEX_SUFFIX = ".kix"
FILE_MAGIC = b"FKIX"
BLOCK_MAGIC = b"KBLK"
VERSION = 1
FILE_HEADER = struct.Struct("<4sHHq")  # magic, version, reserved, first offset; then the crc
FILE_HEADER_SIZE = FILE_HEADER.size + 4  # 20
BLOCK_HEADER = struct.Struct("<4sIqqqI")  # magic, count, start, next, anchor base, anchor crc
BLOCK_HEADER_SIZE = BLOCK_HEADER.size + 4  # 40
ENTRY = struct.Struct("<Iq")  # key hash, offset
ENTRY_SIZE = ENTRY.size  # 12
_CRC = struct.Struct("<I")
_OFFSET = struct.Struct("<q")
assert FILE_HEADER_SIZE == 20
assert BLOCK_HEADER_SIZE == 40
assert ENTRY_SIZE == 12

DEFAULT_KEY_INDEX_FILE_BYTES = 16 * 1024 * 1024
"""Roll to a new index file past this size: about 1.4 million keys per file, and retention
frees index space a file at a time."""
MAX_ANCHOR_CHECKS = 16
"""Blocks tried from the newest when their anchors do not match the log before giving up and
rebuilding the index: a torn log tail after a crash loses only the last few batches."""
MAX_BLOCK_ENTRIES = 1 << 24
"""Sanity bound on a block's entry count (a larger count is damage, not data)."""
PROGRESS_BLOCK_OFFSETS = 1 << 16
"""A block without entries (keyless records) is written only once this many offsets were
indexed without one: the progress is cheap to redo after a restart."""
READ_CHUNK_BYTES = 1 << 20
"""Log bytes per read while indexing."""

_FILE_NAME = re.compile(rf"^\d{{{OFFSET_DIGITS}}}{re.escape(KEY_INDEX_SUFFIX)}$")


def key_hash(key: bytes) -> int:
    """The index hash of one key (its UTF-8 bytes)."""
    return int(crc32c(key))


@dataclass(frozen=True, slots=True)
class KeyIndexReport:
    """What :meth:`KeyIndex.open` found.

    Attributes:
        files: index files kept.
        next_offset: offsets below this are indexed (or below the log start).
        dropped_bytes: bytes of damaged or unverifiable blocks cut from the end.
        rebuilt: the index was dropped and starts again from the log start.
    """

    files: int
    next_offset: int
    dropped_bytes: int
    rebuilt: bool


@dataclass(slots=True)
class _File:
    first_offset: int
    path: Path
    size: int


@dataclass(slots=True)
class _Block:
    pos: int
    end: int
    count: int
    start: int
    next: int
    anchor_base: int
    anchor_crc: int


def _file_header(first_offset: int) -> bytes:
    head = FILE_HEADER.pack(FILE_MAGIC, VERSION, 0, first_offset)
    return head + _CRC.pack(crc32c(head))


def _check_file_header(data: bytes | memoryview, first_offset: int) -> bool:
    if len(data) < FILE_HEADER_SIZE:
        return False
    magic, version, _res, first = FILE_HEADER.unpack_from(data, 0)
    crc = _CRC.unpack_from(data, FILE_HEADER.size)[0]
    return bool(
        magic == FILE_MAGIC and version == VERSION and first == first_offset
        and crc == crc32c(memoryview(data)[: FILE_HEADER.size])
    )


def encode_block(entries: list[tuple[int, int]], start: int, nxt: int, anchor_base: int,
                 anchor_crc: int) -> bytes:
    """One block (see the module docstring) holding ``entries`` ``(hash, offset)``."""
    body = b"".join(ENTRY.pack(h, o) for h, o in entries)
    head = BLOCK_HEADER.pack(BLOCK_MAGIC, len(entries), start, nxt, anchor_base, anchor_crc)
    return head + _CRC.pack(crc32c(body, crc32c(head))) + body


def _read_block(data: bytes | memoryview, pos: int, expect_start: int | None) -> _Block | None:
    """The valid block at ``pos``, or None (torn, damaged or out of sequence)."""
    if len(data) - pos < BLOCK_HEADER_SIZE:
        return None
    magic, count, start, nxt, abase, acrc = BLOCK_HEADER.unpack_from(data, pos)
    if magic != BLOCK_MAGIC or count > MAX_BLOCK_ENTRIES or nxt < start or start < 0:
        return None
    if expect_start is not None and start != expect_start:
        return None
    end = pos + BLOCK_HEADER_SIZE + count * ENTRY_SIZE
    if end > len(data):
        return None
    mv = memoryview(data)
    crc = _CRC.unpack_from(data, pos + BLOCK_HEADER.size)[0]
    if crc != crc32c(mv[pos + BLOCK_HEADER_SIZE : end], crc32c(mv[pos : pos + BLOCK_HEADER.size])):
        return None
    return _Block(pos, end, count, start, nxt, abase, acrc)


def _keys_of(ctx: tuple[list[tuple[int, int]], bytes], buf: bytes, p: int, offset: int) -> None:
    """walk_records callback: append ``(hash, offset)`` for each distinct key of a record."""
    _t0, _t1, s1, k1, _p1, _rend = record_fields(buf, p)
    if k1 > s1:
        out = ctx[0]
        raw = buf[s1:k1]
        keys = raw.split(b"\x00") if b"\x00" in raw else (raw,)
        for i, k in enumerate(keys):
            if k and k not in keys[:i]:
                out.append((key_hash(k), offset))


def scan_keys(data: bytes, start: int, *, max_converted_bytes: int = DEFAULT_MAX_CONVERTED
              ) -> tuple[list[tuple[int, int]], int, int, int]:
    """Key entries of the records at or above ``start`` in the whole batches of ``data``, as
    stored: an envelope (a Kafka batch as it came) that may hold keys is converted to read them
    (at most ``max_converted_bytes``), any other is not.

    Returns:
        ``(entries, next offset, anchor base, anchor crc)``: the entries ``(hash, offset)`` in
        offset order, the offset after the last batch and that batch's base offset and body
        CRC (``start, -1, 0`` when ``data`` holds no complete batch). A batch whose records do
        not add up (valid by CRC, malformed inside: consumers skip it too) adds no entries.
    """
    entries: list[tuple[int, int]] = []
    nxt, abase, acrc = start, -1, 0
    ctx = (entries, data)
    for pos, h in iter_batches(data):
        if h.last_offset >= start and h.attributes & ATTR_HAS_KEYS:
            try:
                if h.magic == ENVELOPE_MAGIC:
                    native = bytes(native_batch(data, pos, h,
                                                max_batch_bytes=max_converted_bytes))
                    walk_records(native, 0, decode_header(native), start, _keys_of,
                                 (entries, native))
                else:
                    walk_records(data, pos, h, start, _keys_of, ctx)
            except CorruptRecordError:
                pass  # fields run past their record: nothing to index in it
            except BrokerError as exc:  # an envelope that cannot be converted
                _log.warning("key index: batch at offset %d not indexed: %s", h.base_offset, exc)
        nxt = max(nxt, h.last_offset + 1)
        abase, acrc = h.base_offset, h.crc
    return entries, nxt, abase, acrc


def _anchor_holds(log: Log, block: _Block) -> bool:
    """Whether the log still holds the batch the block's anchor names, ending at its next."""
    if block.anchor_base < 0:
        return block.next <= log.start_offset
    if block.anchor_base < log.start_offset or block.next > log.end_offset:
        return False
    try:
        h = decode_header(log.read(block.anchor_base, 1, stored=True), 0)
    except (OffsetOutOfRangeError, CorruptRecordError):
        return False
    return bool(h.base_offset == block.anchor_base and h.crc == block.anchor_crc
                and h.last_offset + 1 == block.next)


class KeyIndex:
    """The key index of one queue (see the module docstring). Build with :meth:`open`."""

    def __init__(self, directory: Path, files: list[_File], next_offset: int,
                 file_bytes: int) -> None:
        """Use :meth:`open`."""
        self.directory = directory
        self.file_bytes = file_bytes
        self._files = files
        self._persisted_next = next_offset
        self.next_offset = next_offset
        self._anchor = (-1, 0)

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, queue_dir: Path, log: Log, *,
             file_bytes: int = DEFAULT_KEY_INDEX_FILE_BYTES) -> tuple[KeyIndex, KeyIndexReport]:
        """Open (or start) the key index of the queue whose log lives in ``queue_dir``.

        Checks and repairs the files as described in the module docstring; never raises for
        damage (the index is rebuilt instead).

        Raises:
            OSError: the directory cannot be read or written.
        """
        directory = queue_dir / KEY_INDEX_DIR
        directory.mkdir(parents=True, exist_ok=True)
        files: list[_File] = []
        for p in directory.iterdir():
            if p.name.endswith(TMP_SUFFIX):
                p.unlink(missing_ok=True)
            elif _FILE_NAME.fullmatch(p.name):
                files.append(_File(int(p.name[:OFFSET_DIGITS]), p, p.stat().st_size))
        files.sort(key=lambda f: f.first_offset)
        dropped = 0
        # every header must be good; a bad one ends the index there
        for i, f in enumerate(files):
            with open(f.path, "rb") as fh:
                head = fh.read(FILE_HEADER_SIZE)
            if not _check_file_header(head, f.first_offset):
                for bad in files[i:]:
                    dropped += bad.size
                    bad.path.unlink(missing_ok=True)
                files = files[:i]
                break
        blocks: list[_Block] = []
        while files:
            last = files[-1]
            data = last.path.read_bytes()
            blocks = _walk(data, last.first_offset)
            end = blocks[-1].end if blocks else FILE_HEADER_SIZE
            if end < len(data):
                dropped += len(data) - end
            if blocks:
                last.size = end
                if end < len(data):
                    os.truncate(last.path, end)
                break
            dropped += len(data)
            last.path.unlink(missing_ok=True)
            files.pop()
        # the newest block must still match the log (a crash may have cut the log's tail)
        keep: _Block | None = None
        for b in reversed(blocks[-MAX_ANCHOR_CHECKS:]):
            if _anchor_holds(log, b):
                keep = b
                break
        rebuilt = False
        if blocks and keep is None:
            rebuilt = True
            for f in files:
                dropped += f.size
                f.path.unlink(missing_ok=True)
            files = []
        elif keep is not None and keep is not blocks[-1]:
            last = files[-1]
            dropped += last.size - keep.end
            os.truncate(last.path, keep.end)
            last.size = keep.end
        nxt = keep.next if keep is not None else log.start_offset
        index = cls(directory, files, max(nxt, log.start_offset), file_bytes)
        index._persisted_next = nxt
        if keep is not None:
            index._anchor = (keep.anchor_base, keep.anchor_crc)
        if dropped:
            _log.warning("key index %s: dropped %d damaged or stale bytes%s", directory, dropped,
                         "; rebuilding from the log" if rebuilt else "")
        return index, KeyIndexReport(len(files), index.next_offset, dropped, rebuilt)

    # -- indexing ------------------------------------------------------------------------------

    def index(self, log: Log, upto: int, max_bytes: int) -> int:
        """Index the log from :attr:`next_offset` up to ``upto`` (exclusive), reading about
        ``max_bytes`` of it (at least one batch); return the bytes read.

        Raises:
            OSError: the index file cannot be written.
        """
        start = log.start_offset
        if self.next_offset < start:  # retention went past what was indexed
            self.next_offset = start
        pos = self.next_offset
        anchor = self._anchor
        used = 0
        entries: list[tuple[int, int]] = []
        while pos < upto and used < max_bytes:
            try:
                data = log.read(pos, min(READ_CHUNK_BYTES, max_bytes - used), upto_offset=upto,
                                stored=True)
            except OffsetOutOfRangeError:
                break
            if not data:
                break
            used += len(data)
            found, nxt, abase, acrc = scan_keys(
                data, pos, max_converted_bytes=log.config.max_converted_batch_bytes)
            if nxt <= pos:
                break
            entries.extend(found)
            pos = nxt
            anchor = (abase, acrc)
        if entries or pos - self._persisted_next >= PROGRESS_BLOCK_OFFSETS:
            self._append_block(entries, pos, anchor)  # on failure nothing moves: redone later
        self.next_offset = pos
        self._anchor = anchor
        return used

    def _append_block(self, entries: list[tuple[int, int]], nxt: int,
                      anchor: tuple[int, int]) -> None:
        block = encode_block(entries, self._persisted_next, nxt, *anchor)
        cur = self._files[-1] if self._files else None
        if cur is None or (cur.size + len(block) > self.file_bytes
                           and cur.size > FILE_HEADER_SIZE):
            first = self._persisted_next
            path = self.directory / f"{first:0{OFFSET_DIGITS}d}{KEY_INDEX_SUFFIX}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, _file_header(first) + block)
            except OSError:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
            os.close(fd)
            self._files.append(_File(first, path, FILE_HEADER_SIZE + len(block)))
        else:
            fd = os.open(cur.path, os.O_WRONLY | os.O_APPEND)
            try:
                _write_all(fd, block)
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, cur.size)  # no half block left behind
                raise
            finally:
                os.close(fd)
            cur.size += len(block)
        self._persisted_next = nxt

    # -- retention -----------------------------------------------------------------------------

    def delete_below(self, start_offset: int) -> int:
        """Unlink the files that hold only offsets below ``start_offset``; return how many."""
        n = 0
        while len(self._files) > 1 and self._files[1].first_offset <= start_offset:
            self._files.pop(0).path.unlink(missing_ok=True)
            n += 1
        return n

    @property
    def size_bytes(self) -> int:
        """Bytes of index files."""
        return sum(f.size for f in self._files)

    @property
    def file_count(self) -> int:
        """Index files."""
        return len(self._files)

    # -- lookups -------------------------------------------------------------------------------

    def lookup(self, key: bytes, start_offset: int = 0) -> Iterator[list[int]]:
        """Candidate offsets of ``key`` at or above ``start_offset``, newest first: one list per
        index file (newest file first), each in descending order. Hashes collide: read the
        records to confirm.

        A damaged block ends the index there (see the module docstring); the lookup goes on
        with the older files.
        """
        wanted = ENTRY.pack(key_hash(key), 0)[:4]
        for f in reversed(list(self._files)):
            if f not in self._files:
                continue
            try:
                with open(f.path, "rb") as fh:
                    data = fh.read(f.size)
            except FileNotFoundError:
                continue
            found: list[int] = []
            pos = FILE_HEADER_SIZE
            expect: int | None = f.first_offset
            ok = _check_file_header(data, f.first_offset)
            while ok and pos < len(data):
                b = _read_block(data, pos, expect)
                if b is None:
                    ok = False
                    break
                region = memoryview(data)[pos + BLOCK_HEADER_SIZE : b.end]
                raw = region.tobytes()
                i = raw.find(wanted)
                while i >= 0:
                    if i % ENTRY_SIZE == 0:
                        off = _OFFSET.unpack_from(raw, i + 4)[0]
                        if off >= start_offset:
                            found.append(off)
                        i = raw.find(wanted, i + ENTRY_SIZE)
                    else:
                        i = raw.find(wanted, i + 1)
                pos = b.end
                expect = b.next
            if not ok:
                self._cut(f, pos, expect if expect is not None else f.first_offset)
            if found:
                found.sort(reverse=True)
                yield found

    def _cut(self, f: _File, pos: int, nxt: int) -> None:
        """A lookup met damage at ``pos`` of ``f``: drop it and everything after it."""
        idx = self._files.index(f)
        _log.warning("key index %s: damaged block at position %d; re-indexing from offset %d",
                     f.path, pos, nxt)
        for later in self._files[idx + 1 :]:
            later.path.unlink(missing_ok=True)
        del self._files[idx + 1 :]
        if pos <= FILE_HEADER_SIZE:
            f.path.unlink(missing_ok=True)
            self._files.pop()
            nxt = f.first_offset
        else:
            with contextlib.suppress(FileNotFoundError):
                os.truncate(f.path, pos)
            f.size = pos
        self.next_offset = self._persisted_next = nxt
        self._anchor = (-1, 0)


def _walk(data: bytes, first_offset: int) -> list[_Block]:
    """The valid blocks of one file, up to the first bad one."""
    if not _check_file_header(data, first_offset):
        return []
    blocks: list[_Block] = []
    pos = FILE_HEADER_SIZE
    expect = first_offset
    while pos < len(data):
        b = _read_block(data, pos, expect)
        if b is None:
            break
        blocks.append(b)
        pos = b.end
        expect = b.next
    return blocks


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
