"""On-disk vocabulary of a log directory: file names, suffixes and the atomic-write helper.

Theory of operation: every file of a log is named after the first offset it covers, as a
20-digit zero-padded decimal (Kafka ``LogFileUtils``), so ``ls`` lists a log in offset order
and the base offset of a segment is known without opening it::

    00000000000000000000.log        record batches, back to back (the source of truth)
    00000000000000000000.index      sparse offset index of that segment (a cache)
    00000000000000000000.timeindex  sparse time index of that segment (a cache)
    00000000000000000000.txnindex   aborted transactions whose marker is in that segment;
                                    exists iff the segment holds a control batch
    00000000000000004711.snapshot   producer state as of offset 4711 (a cache)
    recovery-point.checkpoint       offsets below this were fsynced (a cache)
    leader-epochs                   which leader epoch starts at which offset (authoritative:
                                    batches carry no epoch; see ferrymq.storage.epochs)

A file being written ends in ``.tmp`` until it is complete and fsynced, then it is renamed
over its final name (:func:`atomic_write`); a crash leaves either the old or the new file,
plus perhaps a stray ``.tmp`` that recovery deletes. A file being deleted is first renamed to
``.deleted`` and then unlinked, so a crash in between leaves a name that recovery finishes
deleting instead of a half-deleted segment that looks live.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "DELETED_SUFFIX",
    "INDEX_SUFFIX",
    "LEADER_EPOCHS_FILE",
    "LOG_SUFFIX",
    "OFFSET_DIGITS",
    "RECOVERY_POINT_FILE",
    "SNAPSHOT_SUFFIX",
    "TIMEINDEX_SUFFIX",
    "TMP_SUFFIX",
    "TXNINDEX_SUFFIX",
    "atomic_write",
    "fsync_directory",
    "fsync_file",
    "parse_base_offset",
    "segment_file_name",
]

OFFSET_DIGITS = 20  # enough for any non-negative i64, keeps names sortable
LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
TIMEINDEX_SUFFIX = ".timeindex"
SNAPSHOT_SUFFIX = ".snapshot"
TXNINDEX_SUFFIX = ".txnindex"
TMP_SUFFIX = ".tmp"
DELETED_SUFFIX = ".deleted"
RECOVERY_POINT_FILE = "recovery-point.checkpoint"
LEADER_EPOCHS_FILE = "leader-epochs"  # Kafka's leader-epoch-checkpoint

_OFFSET_SUFFIXES = (LOG_SUFFIX, INDEX_SUFFIX, TIMEINDEX_SUFFIX, SNAPSHOT_SUFFIX, TXNINDEX_SUFFIX)


def segment_file_name(base_offset: int, suffix: str) -> str:
    """The name of the file for ``base_offset`` with ``suffix`` (e.g. ``".log"``).

    Raises:
        ValueError: a negative offset.
    """
    if base_offset < 0:
        raise ValueError(f"negative base offset {base_offset}")
    return f"{base_offset:0{OFFSET_DIGITS}d}{suffix}"


def parse_base_offset(name: str) -> int | None:
    """The base offset encoded in a file name such as ``00000000000000000042.log``.

    Returns None when the name is not
    ``<20 digits><one of .log .index .timeindex .snapshot .txnindex>``.
    """
    for suffix in _OFFSET_SUFFIXES:
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            if len(stem) == OFFSET_DIGITS and stem.isascii() and stem.isdigit():
                return int(stem)
            return None
    return None


def fsync_directory(directory: Path) -> None:
    """Fsync a directory so that creations, renames and unlinks in it are durable."""
    _fsync_path(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def fsync_file(path: Path) -> None:
    """Fsync the file at ``path`` through a descriptor of its own (its writes went through
    descriptors since closed).

    Raises:
        OSError: the file cannot be opened, or the fsync failed.
    """
    _fsync_path(path, os.O_RDONLY)


def _fsync_path(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rewrite_in_place(path: Path, data: bytes | bytearray | memoryview, at: int) -> None:
    """Write ``data`` at offset ``at`` of ``path`` through a new descriptor and fsync it: how a
    tail whose fsync failed (ENOSPC) is made durable again, since a later fsync of the old
    descriptor proves nothing (fsyncgate).

    Raises:
        OSError: the write or the fsync failed.
    """
    fd = os.open(path, os.O_WRONLY)
    try:
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | bytearray | memoryview, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new content.

    Writes ``<path>.tmp`` (created with ``mode``, less the umask), fsyncs it, renames it over
    ``path`` and fsyncs the directory.

    Raises:
        OSError: the write, fsync or rename failed (the old file is untouched; the ``.tmp`` is
            removed, so a full disk gets its space back).
    """
    tmp = path.with_name(path.name + TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
