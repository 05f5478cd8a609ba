"""Persistence of one delivery group: a snapshot checkpoint plus a journal of changes since.

Files in ``<data_dir>/delivery/<group>/``::

    state         checkpoint (msgpack map): the group's state as of journal generation G
    journal.<G>   every change since that snapshot (see ferrymq.storage.journal)

Loading reads ``state`` (if any), then replays ``journal.<G>``. Compaction creates an empty
``journal.<G+1>``, writes a new snapshot with generation G+1 (atomic) and deletes the old
journal; a crash (or a failure: no descriptor, no space) in between leaves either the old
snapshot with its journal or the new snapshot with an empty journal, both complete. Stray
journals of other generations are deleted.

The journal's descriptor lives in the broker's descriptor cache
(:class:`~ferrymq.storage.handles.FileHandles`, shared with the segment files): an idle group
holds none.

The store is a :class:`~ferrymq.broker.flusher.Flushable`: appends are fsynced by the broker's
group-commit flusher, and :meth:`GroupStore.when_durable` runs a callback once a position is
durable (at once in async flush mode). An fsync that fails for lack of space fails the waiters
with STORAGE_FULL and is recovered without a restart: once space is back the flusher has the
journal's undurable tail written again and fsynced (:meth:`GroupStore.rewrite_undurable`).
Any other fsync failure fails every later append until a restart.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from ferrymq._faults import enospc_point
from ferrymq.broker.flusher import flush_postponed
from ferrymq.errors import CorruptRecordError
from ferrymq.storage import read_checkpoint, write_checkpoint
from ferrymq.storage.handles import FileHandles
from ferrymq.storage.journal import Journal

log = logging.getLogger("ferrymq.broker")

STATE_FILE = "state"
SNAPSHOT_VERSION = 2
"""Written by this broker. Version 2 keeps the retry cursor as a scan (floor, next, ready and
done offsets, leases); version 1 (every pending letter was in memory: floor, next, done, leases)
is still read: the cursor then reads the retry queue again from its floor."""
READABLE_VERSIONS = (1, 2)

Callback = Callable[[BaseException | None], None]

if TYPE_CHECKING:
    from ferrymq.broker.flusher import Flushable


class DeliveryStore(Protocol):
    """Where a delivery group's changes are kept: :class:`GroupStore` (files of a single
    broker) or, in a cluster, :class:`~ferrymq.broker.delivery.logstore.LogGroupStore` (records
    of the group's replicated retry queue). The delivery code sees only this."""

    deferred: list[tuple[list[Any], Callback | None]]
    failed: BaseException | None
    snapshot_on_close: bool
    """Whether a clean shutdown folds the journal into a snapshot."""

    @property
    def flushable(self) -> Flushable:
        """What the broker's flusher fsyncs for this store."""
        ...

    @property
    def size(self) -> int:
        """Bytes journaled since the last snapshot (compaction passes a limit)."""
        ...

    def position(self) -> int:
        """The position to wait for so that everything journaled so far is durable."""
        ...

    def busy(self) -> bool:
        """Whether someone waits for a journaled position (no snapshot then)."""
        ...

    def append(self, record: list[Any]) -> int:
        """Journal one change; the position to wait for."""
        ...

    def hold(self) -> None:
        """Keep what the appends need open until :meth:`release` (see Journaling.writing)."""
        ...

    def release(self) -> None:
        """Undo one :meth:`hold`."""
        ...

    def when_durable(self, pos: int, cb: Callback, *, sync: bool) -> None:
        """Run ``cb`` once ``pos`` is durable."""
        ...

    def rotate(self, snapshot: dict[str, Any]) -> None:
        """Write ``snapshot`` and start an empty journal after it."""
        ...

    def close(self) -> None:
        """Release the store's files (clean shutdown, a deleted or handed-over group)."""
        ...


class GroupStore:
    """The snapshot and journal of one delivery group."""

    def __init__(self, directory: Path, gen: int, journal: Journal,
                 handles: FileHandles | None = None) -> None:
        self.directory = directory
        self.gen = gen
        self.journal = journal
        self.handles = handles
        self.waiters: deque[tuple[int, Callback]] = deque()
        self.failed: BaseException | None = None
        self.snapshot_on_close = True
        self.deferred: list[tuple[list[Any], Callback | None]] = []
        """Records whose change is already in the group's memory but could not be journaled
        (no descriptor, no space), with who waits for them: journaled again at every tick
        (only records that may come after later ones: finishes and DLQ floors)."""

    @classmethod
    def load(cls, directory: Path, handles: FileHandles | None = None
             ) -> tuple[GroupStore, dict[str, Any] | None, list[Any]]:
        """Open the group's files: the store, its snapshot (None: new group), journal records.

        Args:
            directory: the group's directory (created if missing).
            handles: the descriptor cache the journal's descriptor lives in.

        Raises:
            CorruptRecordError: the snapshot is damaged (refused: it is authoritative).
            OSError: a file cannot be read or created (EMFILE, ENOSPC, ...).
        """
        directory.mkdir(parents=True, exist_ok=True)
        raw = read_checkpoint(directory / STATE_FILE)
        snap: dict[str, Any] | None = None
        gen = 0
        if raw is not None:
            try:
                snap = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            except Exception as exc:  # noqa: BLE001
                raise CorruptRecordError(f"{directory / STATE_FILE}: {exc}") from None
            if not isinstance(snap, dict) or snap.get("v") not in READABLE_VERSIONS:
                raise CorruptRecordError(f"{directory / STATE_FILE}: unknown snapshot format")
            gen = int(snap["gen"])
        for p in directory.glob("journal.*"):
            if p.name != f"journal.{gen}":
                p.unlink()
        journal, records = Journal.open(directory / f"journal.{gen}", handles)
        if journal.dropped_bytes:
            log.warning("delivery journal %s: dropped a torn tail of %d bytes", journal.path,
                        journal.dropped_bytes)
        return cls(directory, gen, journal, handles), snap, records

    @property
    def flushable(self) -> GroupStore:
        """The store itself: the flusher fsyncs its journal."""
        return self

    @property
    def size(self) -> int:
        """The journal's size in bytes."""
        return self.journal.size

    def position(self) -> int:
        """The journal's end."""
        return self.journal.size

    def busy(self) -> bool:
        """Whether a callback waits for an fsync."""
        return bool(self.waiters)

    def append(self, record: list[Any]) -> int:
        """Journal one change; the position to wait for."""
        return self.journal.append(record)

    def hold(self) -> None:
        """Keep the journal's descriptor open until :meth:`release`.

        Raises:
            OSError: it cannot be opened (EMFILE, ...).
        """
        self.journal.hold()

    def release(self) -> None:
        """Undo one :meth:`hold`."""
        self.journal.release()

    def when_durable(self, pos: int, cb: Callback, *, sync: bool) -> None:
        """Run ``cb(None)`` once ``pos`` is fsynced (sync mode) or at once (async mode)."""
        if not sync or pos <= self.journal.durable:
            cb(None)
        elif self.failed is not None:
            cb(self.failed)
        else:
            self.waiters.append((pos, cb))

    def rotate(self, snapshot: dict[str, Any]) -> None:
        """Write ``snapshot`` as generation G+1 and start an empty journal for it. The new
        journal is created first: when that or the snapshot fails, nothing changed.

        Raises:
            OSError: a file cannot be created or written (the old generation stays in use).
        """
        new_gen = self.gen + 1
        snapshot = {**snapshot, "v": SNAPSHOT_VERSION, "gen": new_gen}
        path = self.directory / f"journal.{new_gen}"
        path.unlink(missing_ok=True)  # left by a rotation that failed
        new, _ = Journal.open(path, self.handles)
        try:
            write_checkpoint(self.directory / STATE_FILE,
                             msgpack.packb(snapshot, use_bin_type=True))
        except BaseException:
            new.close()
            path.unlink(missing_ok=True)
            raise
        old = self.journal
        self.journal = new
        self.gen = new_gen
        with contextlib.suppress(OSError):  # superseded by the snapshot: its fsync is moot
            old.close()
        old.path.unlink(missing_ok=True)

    def close(self) -> None:
        """fsync and close the journal."""
        self.journal.close()

    # the flusher's side (ferrymq.broker.flusher.Flushable)

    def flush_blocking(self) -> int:
        """fsync the journal (flusher thread)."""
        enospc_point("fsync", f"%delivery/{self.directory.name}")
        return self.journal.flush()

    def rewrite_undurable(self) -> int:
        """After an fsync failed with ENOSPC: write the undurable records again and fsync them
        through a new descriptor (loop thread); the position now durable."""
        enospc_point("rewrite", f"%delivery/{self.directory.name}")
        return self.journal.rewrite_tail()

    def on_flushed(self, durable: int, sync: bool) -> None:
        """Run the callbacks of positions now durable."""
        w = self.waiters
        while w and w[0][0] <= durable:
            w.popleft()[1](None)
        h = self.handles  # the journal may be evictable now: back to the cache's capacity
        if h is not None and h.open_count > h.capacity:
            h.trim()

    def on_flush_failed(self, exc: BaseException) -> None:
        """Fail every waiter; later appends fail too until a restart, unless the disk was
        full or descriptors ran out (then the flusher rewrites the tail once they are back)."""
        if not flush_postponed(exc):
            self.failed = exc
        w = list(self.waiters)
        self.waiters.clear()
        for _pos, cb in w:
            cb(exc)

    def __str__(self) -> str:
        return f"delivery journal {self.directory.name}"
