"""The leader epoch cache of one queue: which leader epoch wrote which offsets.

Theory of operation (Kafka's ``LeaderEpochFileCache`` and KIP-101 / KIP-279). Each time a
queue gets a new leader, the controller bumps the queue's *leader epoch*. Followers copy the
leader's batches unchanged, but FerryMQ's batch header has no epoch field (and the on-disk
format does not change for one), so every replica keeps, beside its log, the ordered list of
``(epoch, start_offset)``: epoch ``e`` wrote the offsets from its start offset up to the start
of the next entry (or the log end, for the latest). Both columns strictly increase.

This list is **authoritative**, not a cache that recovery could rebuild: nothing in the
batches says which epoch wrote them. So it is written before the data it describes and cut
with the log:

- a leader calls :meth:`LeaderEpochCache.assign` with its new epoch and its log end when it
  takes over; a follower calls it with the epoch of the next batch it copies *before*
  appending that batch (``Log.append_replica``), so a crash never leaves data whose epoch is
  unknown;
- ``Log.truncate_to`` cuts it after cutting the log (:meth:`~LeaderEpochCache.truncate_from_end`:
  no entry is left at or past the log end), retention moves its first entry's start up
  (:meth:`~LeaderEpochCache.truncate_from_start`), and ``Log.open`` does both against the
  recovered log, since a power loss can leave the file ahead of the log (an epoch that wrote
  nothing goes too: a leader records its epoch again each time it takes over).

After a leader change a follower truncates by epoch, never to its high watermark: it asks the
leader :meth:`~LeaderEpochCache.end_offset_for` its own latest epoch (OFFSET_FOR_EPOCH) and
cuts its log where :meth:`~LeaderEpochCache.truncation_point` says; when the leader does not
know that epoch the answer names an older one and the follower asks again (KIP-279), until its
log is a prefix of the leader's.

File ``leader-epochs`` in the queue directory: a checkpoint (:mod:`ferrymq.storage.checkpoint`:
magic, CRC, written with ``atomic_write``: ``.tmp``, fsync, rename, fsync of the directory)
whose payload is, little-endian::

    off  size  field
    0    4     version        u32, 1
    4    16*n  entries        (epoch i64, start_offset i64), both strictly increasing

A missing file is an empty cache (a queue that never had a replicated leader: a single broker
never writes one). An unreadable one (CRC, length, order) is refused with
:class:`~ferrymq.errors.CorruptRecordError` naming the file, and ``Log.open`` fails with it,
changing nothing: an empty or guessed cache could make this replica keep diverged data or
make others truncate theirs. The operator may delete the file: the replica then knows no
epoch for its data, and as a follower it truncates its whole log and copies the leader's.

Single writer: like the log's truncation and retention, every method runs on the log's
writer thread. Changes are rare (a leader change, a follower seeing a new epoch, a truncation,
retention), so each one rewrites the whole file before it returns, and an ``OSError`` leaves
the cache in memory as it was.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from pathlib import Path

from ferrymq.errors import CorruptRecordError, LeaderEpochOrderError
from ferrymq.storage.checkpoint import read_checkpoint, write_checkpoint
from ferrymq.storage.files import LEADER_EPOCHS_FILE

__all__ = [
    "EPOCHS_VERSION",
    "NO_EPOCH",
    "NO_OFFSET",
    "LeaderEpochCache",
    "epoch_in",
]

NO_EPOCH = -1  # no epoch known (Kafka's UNDEFINED_EPOCH)
NO_OFFSET = -1  # no offset known (Kafka's UNDEFINED_EPOCH_OFFSET)
EPOCHS_VERSION = 1
_VERSION = struct.Struct("<I")
_ENTRY = struct.Struct("<qq")


def epoch_in(entries: list[tuple[int, int]], offset: int) -> int:
    """The epoch that wrote ``offset`` according to ``entries`` (``(epoch, start_offset)`` in
    order, e.g. what a leader sent with a replica fetch: :meth:`LeaderEpochCache.entries_from`);
    :data:`NO_EPOCH` when ``offset`` is below the first start."""
    i = bisect_right(entries, offset, key=lambda e: e[1]) - 1
    return entries[i][0] if i >= 0 else NO_EPOCH


class LeaderEpochCache:
    """The ``(leader_epoch, start_offset)`` list of one queue's log, kept in ``leader-epochs``."""

    def __init__(self, path: Path, entries: list[tuple[int, int]]) -> None:
        """Use :meth:`open`."""
        self.path = path
        self._entries = entries

    @classmethod
    def open(cls, directory: Path) -> LeaderEpochCache:
        """Load the cache of the log in ``directory`` (empty when the file does not exist).

        Raises:
            CorruptRecordError: the file is unreadable (checkpoint header or CRC, payload
                length, version, negative values, entries out of order); it names the file.
            OSError: the file exists but cannot be read.
        """
        path = directory / LEADER_EPOCHS_FILE
        payload = read_checkpoint(path)
        if payload is None:
            return cls(path, [])
        return cls(path, _decode(path, payload))

    # --- queries -------------------------------------------------------------------------------

    def entries(self) -> list[tuple[int, int]]:
        """Every ``(epoch, start_offset)``, oldest first (a copy)."""
        return list(self._entries)

    def latest(self) -> tuple[int, int] | None:
        """The newest ``(epoch, start_offset)``, or None when the cache is empty."""
        return self._entries[-1] if self._entries else None

    def latest_epoch(self) -> int:
        """The newest epoch, or :data:`NO_EPOCH` when the cache is empty (what a follower
        asks the leader about: :meth:`end_offset_for`)."""
        return self._entries[-1][0] if self._entries else NO_EPOCH

    def epoch_at(self, offset: int) -> int:
        """The epoch of the batch at ``offset`` (an offset below the log end): that of the last
        entry starting at or before it; :data:`NO_EPOCH` when none does (data written before
        any epoch was recorded, e.g. by a single broker)."""
        return epoch_in(self._entries, offset)

    def end_offset_for(self, epoch: int, log_end: int) -> tuple[int, int]:
        """The OFFSET_FOR_EPOCH answer (Kafka's OffsetsForLeaderEpoch) for ``epoch``.

        Args:
            epoch: the epoch a follower asks about (its latest).
            log_end: this log's end offset: where the latest epoch ends.

        Returns:
            ``(e, end)``: ``e`` the largest epoch known here that is <= ``epoch``, ``end`` the
            offset where it ends (the start of the next entry, or ``log_end`` when ``e`` is the
            latest); ``(NO_EPOCH, NO_OFFSET)`` when no known epoch is <= ``epoch`` (also for
            ``epoch < 0`` and an empty cache): nothing of the asker's log is known to match.
        """
        entries = self._entries
        i = bisect_right(entries, epoch, key=lambda e: e[0]) - 1
        if epoch < 0 or i < 0:
            return NO_EPOCH, NO_OFFSET
        end = entries[i + 1][1] if i + 1 < len(entries) else log_end
        return entries[i][0], end

    def entries_from(self, offset: int) -> list[tuple[int, int]]:
        """The entry covering ``offset`` and every later one (all entries when ``offset`` is
        below the first start): what a leader sends to a follower fetching from ``offset``, so
        that it knows the epoch of every batch it copies (:func:`epoch_in`)."""
        entries = self._entries
        i = bisect_right(entries, offset, key=lambda e: e[1]) - 1
        return entries[max(i, 0) :]

    def truncation_point(self, answer: tuple[int, int], log_start: int,
                         log_end: int) -> tuple[int, bool]:
        """Where a follower with this cache truncates its log, given the leader's
        :meth:`end_offset_for` answer to the follower's :meth:`latest_epoch` (KIP-101, KIP-279).

        - The leader knows no epoch up to ours (``answer`` is ``(NO_EPOCH, NO_OFFSET)``), or we
          know none up to the leader's: nothing is known to match: the whole log goes
          (``log_start``), final.
        - The leader answered an epoch we know: our log matches the leader's up to where that
          epoch ends on both sides: truncate to the smaller end (and at most ``log_end``),
          final.
        - The leader answered an older epoch we do not know: truncate to the end of our largest
          epoch below it, not final: the caller asks again with its new latest epoch (which
          is smaller each time, so this ends).

        Returns:
            ``(offset, final)``: pass ``offset`` to ``Log.truncate_to`` (which also cuts this
            cache); when ``final`` is False, ask the leader again.
        """
        leader_epoch, leader_end = answer
        if leader_epoch < 0:
            return log_start, True
        own_epoch, own_end = self.end_offset_for(leader_epoch, log_end)
        if own_epoch < 0:
            return log_start, True
        if own_epoch == leader_epoch:
            return max(log_start, min(own_end, leader_end, log_end)), True
        return max(log_start, min(own_end, log_end)), False

    # --- changes -------------------------------------------------------------------------------

    def assign(self, epoch: int, start_offset: int) -> bool:
        """Record that ``epoch`` starts at ``start_offset``, durably before returning.

        A leader calls it when it takes over (with its log end); a follower before it appends
        the first batch it copies of an epoch newer than its latest. Rules: a no-op when the
        latest entry has this epoch already (at or before ``start_offset``); a newer epoch at
        the latest entry's start offset replaces that entry (the older epoch wrote nothing:
        Kafka's rule); otherwise the entry is appended.

        Returns:
            Whether the cache changed.

        Raises:
            LeaderEpochOrderError: a negative epoch or offset, an epoch below the latest, a
                start offset below the latest entry's, or the latest epoch given a start
                offset earlier than it has (nothing changes).
            OSError: the file could not be written (the cache is unchanged).
        """
        latest = self.latest()
        if epoch < 0 or start_offset < 0:
            raise LeaderEpochOrderError(epoch, start_offset, latest, "negative epoch or offset")
        entries = self._entries
        if latest is not None:
            last_epoch, last_start = latest
            if epoch < last_epoch:
                raise LeaderEpochOrderError(epoch, start_offset, latest,
                                            "epochs only grow")
            if start_offset < last_start:
                raise LeaderEpochOrderError(epoch, start_offset, latest,
                                            "start offsets only grow")
            if epoch == last_epoch:
                return False
            if start_offset == last_start:
                entries = entries[:-1]
        self._replace([*entries, (epoch, start_offset)])
        return True

    def truncate_from_end(self, end_offset: int) -> bool:
        """Drop the entries starting at or after ``end_offset`` (the log was cut there, or
        found to end there at open); return whether any was dropped.

        Raises:
            OSError: the file could not be written (the cache is unchanged).
        """
        entries = self._entries
        keep = bisect_right(entries, end_offset - 1, key=lambda e: e[1])
        if keep == len(entries):
            return False
        self._replace(entries[:keep])
        return True

    def truncate_from_start(self, start_offset: int) -> bool:
        """The log now starts at ``start_offset`` (retention): drop the entries wholly before
        it and move the start of the one covering it up to it; return whether anything
        changed.

        Raises:
            OSError: the file could not be written (the cache is unchanged).
        """
        entries = self._entries
        i = bisect_right(entries, start_offset, key=lambda e: e[1]) - 1
        if i < 0 or (i == 0 and entries[0][1] == start_offset):
            return False
        self._replace([(entries[i][0], start_offset), *entries[i + 1 :]])
        return True

    def _replace(self, entries: list[tuple[int, int]]) -> None:
        """Write ``entries`` to the file, then make them the cache's."""
        payload = b"".join([_VERSION.pack(EPOCHS_VERSION), *(_ENTRY.pack(*e) for e in entries)])
        write_checkpoint(self.path, payload)
        self._entries = entries


def _decode(path: Path, payload: bytes) -> list[tuple[int, int]]:
    """The entries of a ``leader-epochs`` payload, checked.

    Raises:
        CorruptRecordError: bad length, version, value or order; names ``path``.
    """
    if len(payload) < _VERSION.size or (len(payload) - _VERSION.size) % _ENTRY.size:
        raise CorruptRecordError(f"{path}: payload of {len(payload)} bytes is not a version "
                                 f"and whole {_ENTRY.size}-byte entries")
    (version,) = _VERSION.unpack_from(payload)
    if version != EPOCHS_VERSION:
        raise CorruptRecordError(f"{path}: unknown version {version}")
    entries = [(int(e), int(s)) for e, s in _ENTRY.iter_unpack(payload[_VERSION.size :])]
    previous = (NO_EPOCH, NO_OFFSET)
    for epoch, start in entries:
        if epoch < 0 or start < 0 or epoch <= previous[0] or start <= previous[1]:
            raise CorruptRecordError(
                f"{path}: entry (epoch {epoch}, start {start}) after (epoch {previous[0]}, "
                f"start {previous[1]}): epochs and start offsets must be >= 0 and increase"
            )
        previous = (epoch, start)
    return entries
