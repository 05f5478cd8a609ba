"""Running out of file descriptors or disk space: which failures are that, and one warning per
episode of time-driven work that waits for them.

A request that meets EMFILE, ENFILE or ENOSPC is answered BUSY or STORAGE_FULL with a
retry-after (:meth:`Shortage.classify`). Time-driven work (expired leases, departed members'
leases, deferred journal records, compaction, removing deleted groups' files) that meets one
stays where it is and is tried again at every tick; :meth:`Shortage.note` warns once when such
an episode starts, and :meth:`Shortage.end_tick` says when it is over.
"""

from __future__ import annotations

import logging

from ferrymq.broker.flusher import Flusher, flush_postponed
from ferrymq.errors import BrokerError

log = logging.getLogger("ferrymq.broker")


class Shortage:
    """Classifies failures for lack of descriptors or space, and tracks episodes of waiting."""

    def __init__(self, flusher: Flusher) -> None:
        self.flusher = flusher
        self.current: BrokerError | None = None
        """What made time-driven work wait in the current episode: warned once when it
        starts, told when it is over."""
        self.seen = False  # a shortage met since the last tick

    def classify(self, exc: BaseException, what: str) -> BrokerError | None:
        """The retriable answer for a failure for lack of descriptors or disk space (BUSY or
        STORAGE_FULL with the retry-after: ``exc`` itself when it is one already), None for any
        other failure."""
        if flush_postponed(exc):
            return exc
        if isinstance(exc, OSError):
            return self.flusher.shortage_error(exc, what)
        return None

    def note(self, err: BrokerError) -> None:
        """Time-driven work waits for descriptors or space: warn once per episode."""
        self.seen = True
        if self.current is None:
            self.current = err
            log.warning("delivery groups: %s; expired leases, departed members' leases and "
                        "journal records wait and are retried at every tick", err)

    def start_tick(self) -> None:
        """A tick starts: whether it meets a shortage is known at its end."""
        self.seen = False

    def end_tick(self) -> None:
        """A tick is over: an episode whose work all got done ends."""
        if self.current is not None and not self.seen:
            log.warning("delivery groups: the work that waited (%s) is done", self.current)
            self.current = None
