"""Loading a log directory at open: clean-shutdown fast path, crash recovery, cleanup.

Theory of operation. The broker knows whether it shut down cleanly (its marker file existed).

*Clean*: the files are trusted. Sealed segments load their small time index (the offset index
loads lazily on first read); the last segment loads its offset index and walks batch headers
only from the last index entry to find the end, checking header CRCs and offset continuity. Any
inconsistency there drops this segment to the unclean path. Cost: independent of data size.

*Unclean*: the recovery point (a checkpoint written when a flush made whole segments durable,
and at close) says which offsets were fsynced. Every segment that may hold an offset at or
above it is fully scanned with both CRCs and gets fresh indexes. At the first invalid batch the
scan must tell a torn tail (the crash cut the last write: truncate and report) from mid-log
corruption (valid data follows: refuse to start, never drop it):

- the invalid batch's header CRC is good, so its length is trustworthy: mid-log iff a valid
  batch follows at the position the length gives;
- otherwise the length is garbage: mid-log iff a forward search of the rest of the segment
  finds a header with a good header CRC and a base offset above the last good offset;
- and in both cases, mid-log iff a later segment starts with a valid batch.

A torn tail is truncated at the last valid batch, logged as a WARNING on ``ferrymq.storage``
and described in the :class:`RecoveryReport`. Later segments that hold nothing valid (they
should not exist) are deleted and counted. Stray ``.tmp`` files are deleted and ``.deleted``
files finish being unlinked.

*Aborted-transaction indexes.* Every segment scanned fully gets its ``.txnindex`` rebuilt from
the scan (:func:`rebuild_txn_indexes`, called by ``Log.open`` once producer snapshots are at
hand): the file exists iff the segment holds a control batch, with one entry per ABORT marker
of a producer whose transaction was open. First offsets are tracked per producer id along the
scanned segments (which are always the last ones of the log); for a producer whose
transaction may have opened before the first scanned segment, the producer state as of that
segment's base (snapshot plus header replay) supplies it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ferrymq.errors import CorruptRecordError
from ferrymq.protocol.kafka.envelope import STORED_MAGICS, check_stored
from ferrymq.protocol.markers import marker_of
from ferrymq.protocol.records import (
    ATTR_CONTROL,
    HEADER_SIZE,
    LENGTH_PREFIX,
    BatchHeader,
    decode_header,
)
from ferrymq.storage.files import (
    DELETED_SUFFIX,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    TIMEINDEX_SUFFIX,
    TMP_SUFFIX,
    TXNINDEX_SUFFIX,
    fsync_directory,
    parse_base_offset,
)
from ferrymq.storage.handles import FileHandles
from ferrymq.storage.segment import SCAN_CHUNK_BYTES, Segment, SegmentScan, header_crc_ok
from ferrymq.storage.txnindex import AbortedTxn

__all__ = ["RecoveryReport", "load_segments", "rebuild_txn_indexes"]

_log = logging.getLogger("ferrymq.storage")
_MAGIC_POSITION = 28  # byte offset of the magic field inside a batch header


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What :meth:`ferrymq.storage.Log.open` found and did.

    Attributes:
        clean_shutdown: the flag the broker passed.
        segments: segments in the log after recovery.
        segments_scanned: segments walked batch by batch (fully, or from the last index entry).
        indexes_rebuilt: segments whose indexes were rebuilt from the log.
        truncated_bytes: bytes cut from torn tails (including deleted empty-of-data segments).
        lost_offsets: inclusive ``(first, last)`` offsets dropped, when known; ``(first, -1)``
            when only the first is known.
        deleted_segments: segments after a torn one that held no valid batch.
        start_offset: first offset of the log.
        end_offset: next offset to be assigned.
        elapsed_s: wall time spent opening.
    """

    clean_shutdown: bool
    segments: int
    segments_scanned: int
    indexes_rebuilt: int
    truncated_bytes: int
    lost_offsets: tuple[int, int] | None
    deleted_segments: int
    start_offset: int
    end_offset: int
    elapsed_s: float


@dataclass(slots=True)
class LoadFindings:
    """Mutable tally filled by :func:`load_segments`."""

    segments_scanned: int = 0
    indexes_rebuilt: int = 0
    truncated_bytes: int = 0
    lost_offsets: tuple[int, int] | None = None
    deleted_segments: int = 0
    scanned: list[Segment] = field(default_factory=list)
    txn_batches: dict[int, tuple[tuple[int, BatchHeader], ...]] = field(default_factory=dict)
    """Per fully scanned segment (by base offset): its bit-4/5 batches (``SegmentScan``)."""


def clean_directory(directory: Path) -> list[int]:
    """Delete ``.tmp``/``.deleted`` leftovers and orphan indexes; return segment bases."""
    return _clean_directory(directory)[0]


def _clean_directory(directory: Path) -> tuple[list[int], set[int]]:
    """:func:`clean_directory`, plus the bases of the segments that have a ``.txnindex``."""
    bases: set[int] = set()
    txn_bases: set[int] = set()
    indexes: list[tuple[int, Path]] = []
    for path in directory.iterdir():
        name = path.name
        if name.endswith((TMP_SUFFIX, DELETED_SUFFIX)):
            path.unlink(missing_ok=True)
            continue
        base = parse_base_offset(name)
        if base is None:
            continue
        if name.endswith(LOG_SUFFIX):
            bases.add(base)
        elif name.endswith((INDEX_SUFFIX, TIMEINDEX_SUFFIX, TXNINDEX_SUFFIX)):
            indexes.append((base, path))
            if name.endswith(TXNINDEX_SUFFIX):
                txn_bases.add(base)
    for base, path in indexes:
        if base not in bases:
            path.unlink(missing_ok=True)
    return sorted(bases), txn_bases & bases


def load_segments(
    directory: Path,
    *,
    index_interval_bytes: int,
    clean_shutdown: bool,
    recovery_point: int,
    handles: FileHandles | None = None,
) -> tuple[list[Segment], LoadFindings]:
    """Open, check and repair the segments of ``directory`` (see the module docstring).

    ``handles``: the descriptor cache of the segments' files (None: one of their own).

    Returns:
        The segments in offset order (the last one is active) and what was found.

    Raises:
        CorruptRecordError: mid-log corruption (the message names file, position, offsets).
        OSError: the directory cannot be read or repaired.
    """
    findings = LoadFindings()
    bases, txn_bases = _clean_directory(directory)
    handles = handles or FileHandles()
    if not bases:
        seg = Segment.create(directory, max(recovery_point, 0),
                             index_interval_bytes=index_interval_bytes, handles=handles)
        return [seg], findings
    segments = [
        Segment.open(directory, b, index_interval_bytes=index_interval_bytes,
                     has_txnindex=b in txn_bases, handles=handles)
        for b in bases
    ]
    try:
        _check_segments(segments, findings, clean_shutdown=clean_shutdown, recovery_point=recovery_point)
    except BaseException:
        for seg in segments:
            seg.close()
        raise
    return [s for s in segments if not s.closed], findings


def _check_segments(
    segments: list[Segment], findings: LoadFindings, *, clean_shutdown: bool, recovery_point: int
) -> None:
    i = 0
    while i < len(segments):
        seg = segments[i]
        last = i == len(segments) - 1
        next_base = None if last else segments[i + 1].base_offset
        must_scan = not clean_shutdown and (next_base is None or next_base > recovery_point)
        if not must_scan and not last:
            assert next_base is not None
            if not seg.load_sealed(next_base):
                findings.indexes_rebuilt += 1
            i += 1
            continue
        scan: SegmentScan | None = None
        if not must_scan:  # clean shutdown, last segment: walk headers from the last entry
            scan = seg.recover(check_crc=False, resume=True)
            findings.segments_scanned += 1
            if scan.error is None:
                i += 1
                continue
            _log.warning("%s: clean shutdown but %s; scanning it fully", seg.log_path, scan.error)
        file = seg.file
        if file is not None:  # what a crashed broker wrote may be in the page cache only:
            file.mark_unsynced()  # keep the descriptor until fsync_segments covered it
        scan = seg.recover(check_crc=True)
        findings.segments_scanned += 1
        findings.indexes_rebuilt += 1
        findings.scanned.append(seg)
        findings.txn_batches[seg.base_offset] = scan.txn_batches
        if scan.error is None and (next_base is None or scan.next_offset == next_base):
            if not last:
                seg.seal()
                seg.write_index_files()
            i += 1
            continue
        if scan.error is None and next_base is not None and scan.next_offset > next_base:
            raise CorruptRecordError(
                f"{seg.log_path}: offsets run to {scan.next_offset - 1} but the next segment "
                f"starts at {next_base}"
            )
        _handle_torn(seg, scan, segments[i + 1 :], findings)
        del segments[i + 1 :]
        i += 1


def _handle_torn(seg: Segment, scan: SegmentScan, later: list[Segment], findings: LoadFindings) -> None:
    """Refuse mid-log corruption, else truncate ``seg`` and delete ``later`` (no valid data)."""
    fd_path = seg.log_path
    last_good = scan.next_offset - 1
    where = (
        f"{fd_path}: invalid batch at position {scan.valid_bytes} after offset {last_good} "
        f"({scan.error or 'offsets stop before the next segment'})"
    )
    lost_last = -1
    if scan.error is not None:
        evidence, lost_last = _valid_data_after(seg, scan)
        if evidence is not None:
            raise CorruptRecordError(f"mid-log corruption: {where}; {evidence}; refusing to drop it")
    for other in later:
        found = _first_valid_batch(other)
        if found is not None:
            raise CorruptRecordError(
                f"mid-log corruption: {where}; segment {other.log_path} holds valid offsets "
                f"from {found}; refusing to drop them"
            )
    truncated = scan.file_bytes - scan.valid_bytes
    seg.truncate_to(scan.valid_bytes)
    seg.write_index_files()
    for other in later:
        truncated += other.size_bytes
        other.delete()
        findings.deleted_segments += 1
    findings.truncated_bytes += truncated
    if truncated:
        findings.lost_offsets = (last_good + 1, lost_last)
    _log.warning(
        "recovered torn tail: %s; truncated %d bytes%s, next offset %d",
        where,
        truncated,
        f", {len(later)} empty later segments deleted" if later else "",
        last_good + 1,
    )


def _valid_data_after(seg: Segment, scan: SegmentScan) -> tuple[str | None, int]:
    """Evidence of valid data after the invalid batch, and the last lost offset if known."""
    pos = scan.valid_bytes
    size = scan.file_bytes
    head = seg.read(pos, HEADER_SIZE)
    last_good = scan.next_offset - 1
    lost_last = -1
    if len(head) == HEADER_SIZE:
        h = decode_header(head)
        if header_crc_ok(head, 0, h) and h.batch_length >= HEADER_SIZE - LENGTH_PREFIX:
            if h.base_offset == scan.next_offset and h.record_count >= 1:
                lost_last = h.last_offset
            after = pos + h.size
            if after < size and _batch_valid_at(seg, after):
                return f"a valid batch follows at position {after}", lost_last
            return None, lost_last
    found = _search_header(seg, pos + 1, size, last_good)
    if found is not None:
        return f"a valid batch header for offset {found[1]} at position {found[0]}", lost_last
    return None, lost_last


def _batch_valid_at(seg: Segment, pos: int) -> bool:
    head = seg.read(pos, HEADER_SIZE)
    if len(head) < HEADER_SIZE:
        return False
    size = decode_header(head).size
    if size < HEADER_SIZE:
        return False
    try:
        check_stored(seg.read(pos, size))
    except CorruptRecordError:
        return False
    return True


def _search_header(seg: Segment, start: int, end: int, last_good: int) -> tuple[int, int] | None:
    """First position in [start, end) holding a header with a good CRC and a later offset."""
    pos = start
    while pos + HEADER_SIZE <= end:
        chunk = seg.read(pos, min(SCAN_CHUNK_BYTES, end - pos))
        limit = len(chunk) - HEADER_SIZE  # last candidate start inside this chunk
        j = _find_magic(chunk, _MAGIC_POSITION)
        while j >= 0 and j - _MAGIC_POSITION <= limit:
            q = j - _MAGIC_POSITION
            h = decode_header(chunk, q)
            if h.base_offset > last_good and header_crc_ok(chunk, q, h):
                return pos + q, h.base_offset
            j = _find_magic(chunk, j + 1)
        if limit < 0:
            break
        pos += limit + 1
    return None


def _find_magic(chunk: bytes, start: int) -> int:
    """Position of the first byte at or after ``start`` that is a stored batch's magic."""
    found = [j for j in (chunk.find(bytes([m]), start) for m in STORED_MAGICS) if j >= 0]
    return min(found) if found else -1


def _first_valid_batch(seg: Segment) -> int | None:
    if seg.size_bytes >= HEADER_SIZE and _batch_valid_at(seg, 0):
        return decode_header(seg.read(0, HEADER_SIZE)).base_offset
    return None


def fsync_segments(segments: list[Segment]) -> None:
    """Fsync recovered segments so that what recovery kept is durable."""
    for seg in segments:
        if not seg.closed:
            seg.flush()


def rebuild_txn_indexes(
    segments: list[Segment],
    findings: LoadFindings,
    open_txns_at: Callable[[int], dict[int, int]],
) -> int:
    """Rebuild the ``.txnindex`` of every segment recovery scanned fully (see the module
    docstring); return the number of aborted-transaction entries written.

    Args:
        segments: the log's segments after :func:`load_segments`.
        findings: what :func:`load_segments` found (its ``txn_batches``).
        open_txns_at: producer id -> first offset of the transactions open just before the
            given offset (called at most once, with the first scanned segment's base, and
            only when a marker's transaction may have opened before that segment).

    Raises:
        OSError: a file cannot be written or deleted.
    """
    rebuilt = [s for s in segments if not s.closed and s.base_offset in findings.txn_batches]
    if not rebuilt:
        return 0
    first_base = rebuilt[0].base_offset
    before: dict[int, int] | None = None
    seen: set[int] = set()  # producers met in the scan so far
    # pid -> (first offset seen in the scan, whether the transaction may have opened earlier)
    open_first: dict[int, tuple[int, bool]] = {}
    written = 0
    unlinked = False
    for seg in rebuilt:
        entries: list[AbortedTxn] = []
        has_control = False
        for pos, h in findings.txn_batches[seg.base_offset]:
            pid = h.producer_id
            if pid < 0:
                continue
            if not h.attributes & ATTR_CONTROL:
                if pid not in open_first:
                    open_first[pid] = (h.base_offset, pid not in seen)
                seen.add(pid)
                continue
            has_control = True
            first, maybe_earlier = open_first.pop(pid, (-1, pid not in seen))
            seen.add(pid)
            if (first < 0 and not maybe_earlier) or _marker_commits(seg, pos, h):
                continue
            if maybe_earlier:
                if before is None:
                    before = open_txns_at(first_base)
                first = before.get(pid, first)
            if first >= 0:
                entries.append(AbortedTxn(pid, first, h.base_offset))
        if has_control or seg.txnindex.present:
            unlinked |= not has_control
            seg.txnindex.replace(entries, present=has_control)
        written += len(entries)
    if unlinked:
        fsync_directory(rebuilt[0].directory)
    return written


def _marker_commits(seg: Segment, pos: int, h: BatchHeader) -> bool:
    """Whether the control batch at ``pos`` is a COMMIT marker (an unreadable one is taken as
    ABORT: its transaction's data then stays hidden rather than wrongly exposed)."""
    try:
        return marker_of(seg.read(pos, h.size), 0, h).commit
    except CorruptRecordError as exc:
        _log.warning("%s: control batch at offset %d is unreadable (%s): taken as ABORT",
                     seg.log_path, h.base_offset, exc)
        return False
