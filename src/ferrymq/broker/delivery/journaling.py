"""Writing a delivery group's changes to its journal: before they are applied, or deferred when
a change already applied cannot be journaled yet.

Every change is journaled *before* it is applied in memory (:meth:`Journaling.journal`), so a
failure to write it (no descriptor, no space) changes nothing. Around a change of several
records, :meth:`Journaling.writing` refuses it before anything changed when the journal cannot
take writes, and holds the journal's descriptor open so that its appends meet no EMFILE
half-way. A finish that is already in memory (a move whose copy is durable, a DLQ floor) and
could not be journaled waits in its store's ``deferred`` records and is journaled at the next
ticks (:meth:`Journaling.journal_deferred`); who waits for it is told once it is durable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ferrymq.broker.delivery.context import DeliveryContext
from ferrymq.broker.delivery.group import DeliveryGroup
from ferrymq.broker.delivery.shortage import Shortage
from ferrymq.broker.delivery.store import Callback, DeliveryStore
from ferrymq.errors import BrokerError, StorageFailureError


class Journaling:
    """Journal writes of every delivery group (see the module docstring)."""

    def __init__(self, ctx: DeliveryContext, shortage: Shortage) -> None:
        self.ctx = ctx
        self.flusher = ctx.flusher
        self.stores = ctx.stores
        self.shortage = shortage

    def journal(self, g: DeliveryGroup, record: list[Any]) -> int:
        """Append one change to the group's journal (before applying it); the position to
        wait for.

        Raises:
            StorageFailureError: the journal had an fsync failure (restart needed).
            StorageFullError, BusyError: no space or no descriptor (with a retry-after);
                nothing was written.
        """
        store = self.stores[g.name]
        self.check_store(g, store)
        try:
            pos = store.append(record)
        except OSError as exc:
            raise self.flusher.write_error(exc, f"the delivery journal of {g.name}") from exc
        self.flusher.mark_dirty(store.flushable)
        return pos

    def check_store(self, g: DeliveryGroup, store: DeliveryStore) -> None:
        """Raise unless the group's journal takes writes now (see :meth:`journal`)."""
        if store.failed is not None:
            raise StorageFailureError(f"delivery journal of {g.name} had an fsync failure")
        self.flusher.check_writable(store.flushable)

    @contextlib.contextmanager
    def writing(self, g: DeliveryGroup) -> Iterator[None]:
        """Around a change of ``g``: refuse it before anything changed when its journal cannot
        take writes, and hold the journal's descriptor open meanwhile (the cache cannot close
        it between two appends, so they meet no EMFILE).

        Raises:
            StorageFailureError, StorageFullError, BusyError: as :meth:`journal`.
        """
        store = self.stores[g.name]
        self.check_store(g, store)
        try:
            store.hold()
        except OSError as exc:
            raise self.flusher.write_error(exc, f"the delivery journal of {g.name}") from exc
        try:
            yield
        finally:
            store.release()

    def journal_or_defer(self, g: DeliveryGroup, record: list[Any],
                         cb: Callback | None = None) -> int:
        """Journal a change already applied in memory that may come after later records (a
        finish, a DLQ floor). When no descriptor or space is there, keep it in the store's
        ``deferred`` records (journaled again at every tick) and return -1; ``cb`` is told
        once it is durable (or failed for good).

        Raises:
            StorageFailureError: the journal failed for good (``cb`` was not told).
        """
        store = self.stores[g.name]
        if store.deferred:  # keep their order
            store.deferred.append((record, cb))
            return -1
        try:
            pos = self.journal(g, record)
        except BrokerError as exc:
            if self.shortage.classify(exc, "") is None:
                raise
            self.shortage.note(exc)
            store.deferred.append((record, cb))
            return -1
        if cb is not None:
            store.when_durable(pos, cb, sync=self.ctx.sync)
        return pos

    def journal_deferred(self, g: DeliveryGroup) -> None:
        """Journal the deferred records of ``g`` (tick).

        Raises:
            BrokerError: still no descriptor or space (the rest stay deferred), or the
                journal failed for good (their waiters are told).
        """
        store = self.stores[g.name]
        while store.deferred:
            record, cb = store.deferred[0]
            try:
                pos = self.journal(g, record)
            except BrokerError as exc:
                if self.shortage.classify(exc, "") is None:
                    failed, store.deferred = store.deferred, []
                    for _rec, c in failed:
                        if c is not None:
                            c(exc)
                raise
            store.deferred.pop(0)
            if cb is not None:
                store.when_durable(pos, cb, sync=self.ctx.sync)

    def when_durable(self, group: str, pos: int, cb: Callable[[BaseException | None], None]) -> None:
        """Run ``cb`` once journal position ``pos`` of ``group`` is durable."""
        self.stores[group].when_durable(pos, cb, sync=self.ctx.sync)
