"""Half messages in memory: their states, the check-back schedule and recent outcomes.

Pure data and transitions: no I/O, no clock (times are passed in: monotonic seconds for the
check-back schedule, wall-clock ms for what is reported). :mod:`.manager` drives it, writing
the half topic (:mod:`.halflog`) and handing due checks to the producers' long polls
(:mod:`.checkback`).

A half message moves through :data:`TRANSITIONS` (state x event -> state)::

    PREPARED --COMMIT--> COMMITTING --COPY_DURABLE--> COMMITTED
       |  ^                  |
       |  +----COPY_LOST-----+    (the copy's fsync failed: no outcome yet)
       +--ROLLBACK--> ROLLED_BACK
       +--UNKNOWN, CHECK--> PREPARED

COMMITTED and ROLLED_BACK are final: the same answer again (or UNKNOWN) changes nothing, the
other answer is refused with HalfMessageResolvedError, and so is ROLLBACK while COMMITTING (the
commit was taken). A COMMITTING half message is not checked back (:meth:`HalfBook.due` looks
again an interval later).

Check-back schedule: a half message stored at monotonic time ``t`` is first due at
``t + check_after``, then every ``check_interval`` after the check before; each due time counts
one check (RocketMQ counts attempts, not answers). Due after ``max_checks`` checks, it is
rolled back (``max_checks``). :class:`HalfBook` keeps at most ``half_max_pending`` pending half
messages and remembers the outcomes of as many recently resolved ones.
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from ferrymq.errors import BusyError, HalfMessageResolvedError
from ferrymq.protocol.half_messages import (
    COMMITTED,
    HALF_MSGID,
    HALF_OP,
    HALF_REASON,
    HALF_SOURCE,
    OP_COMMIT,
    PREPARED,
    ROLLED_BACK,
)
from ferrymq.protocol.records import decode_msg_id

__all__ = [
    "SOURCES",
    "TRANSITIONS",
    "HalfBook",
    "HalfEvent",
    "HalfPhase",
    "Outcome",
    "PendingHalf",
    "outcome_of",
    "step",
]

SOURCES = ("producer", "check", "max_checks", "broker")
"""Who resolved a half message (an op record's ``%TXN_SOURCE``)."""


class HalfPhase(enum.Enum):
    """Where a half message is (the values are the names ``message status`` reports)."""

    PREPARED = PREPARED
    COMMITTING = "COMMITTING"
    COMMITTED = COMMITTED
    ROLLED_BACK = ROLLED_BACK


class HalfEvent(enum.Enum):
    """What can happen to a half message."""

    COMMIT = "COMMIT"  # a COMMIT answer: the committed copy was appended
    ROLLBACK = "ROLLBACK"  # a ROLLBACK answer, or the broker gives up (max_checks, unreadable)
    UNKNOWN = "UNKNOWN"  # an UNKNOWN answer: ask again later
    CHECK = "CHECK"  # a check-back came due
    COPY_DURABLE = "COPY_DURABLE"  # the committed copy is durable: the COMMIT op is written
    COPY_LOST = "COPY_LOST"  # the committed copy's fsync failed: no outcome yet


_S = HalfPhase
_E = HalfEvent
TRANSITIONS: dict[tuple[HalfPhase, HalfEvent], HalfPhase] = {
    (_S.PREPARED, _E.COMMIT): _S.COMMITTING,
    (_S.PREPARED, _E.ROLLBACK): _S.ROLLED_BACK,
    (_S.PREPARED, _E.UNKNOWN): _S.PREPARED,
    (_S.PREPARED, _E.CHECK): _S.PREPARED,
    (_S.COMMITTING, _E.COMMIT): _S.COMMITTING,  # a retry joins the commit in progress
    (_S.COMMITTING, _E.UNKNOWN): _S.COMMITTING,
    (_S.COMMITTING, _E.COPY_DURABLE): _S.COMMITTED,
    (_S.COMMITTING, _E.COPY_LOST): _S.PREPARED,
    (_S.COMMITTED, _E.COMMIT): _S.COMMITTED,  # the same answer again: the first result
    (_S.COMMITTED, _E.UNKNOWN): _S.COMMITTED,
    (_S.ROLLED_BACK, _E.ROLLBACK): _S.ROLLED_BACK,
    (_S.ROLLED_BACK, _E.UNKNOWN): _S.ROLLED_BACK,
}
"""Every legal move; anything missing is refused (:func:`step`)."""

FINAL = frozenset({HalfPhase.COMMITTED, HalfPhase.ROLLED_BACK})


def step(state: HalfPhase, event: HalfEvent) -> HalfPhase:
    """The state after ``event``.

    Raises:
        HalfMessageResolvedError: the table has no such move (an outcome never changes).
    """
    nxt = TRANSITIONS.get((state, event))
    if nxt is None:
        raise HalfMessageResolvedError(
            f"a {state.value.lower()} half message cannot take {event.value}")
    return nxt


@dataclass(eq=False, slots=True)
class PendingHalf:
    """A pending half message (PREPARED or COMMITTING)."""

    offset: int
    group: str
    client: str
    topic: str
    queue: int
    stored_ms: int
    check_after_ms: int
    check_interval_ms: int
    max_checks: int
    next_check: float  # monotonic seconds
    checks: int = 0
    last_answer: str = ""
    state: HalfPhase = HalfPhase.PREPARED


class Outcome(NamedTuple):
    """How a half message ended."""

    state: str  # COMMITTED / ROLLED_BACK
    group: str
    topic: str
    queue: int
    offset: int  # the committed copy's offset, -1 when rolled back
    msg_id: str  # the committed copy's id, "" when rolled back
    source: str
    reason: str
    at_ms: int


def outcome_of(group: str, topic: str, queue: int, props: dict[str, str], at_ms: int) -> Outcome:
    """The outcome an op record's properties say."""
    msg_id = props.get(HALF_MSGID, "")
    offset = -1
    if msg_id:
        try:
            offset = decode_msg_id(msg_id)[2]
        except ValueError:
            msg_id = ""
    state = COMMITTED if props.get(HALF_OP) == OP_COMMIT else ROLLED_BACK
    return Outcome(state, group, topic, queue, offset, msg_id, props.get(HALF_SOURCE, ""),
                   props.get(HALF_REASON, ""), at_ms)


class HalfBook:
    """The pending half messages by offset, their check-back schedule, and the outcomes of
    the most recently resolved ones (see the module docstring).

    Args:
        max_pending: most pending half messages (``half_max_pending``); also how many outcomes
            are remembered.
    """

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self.pending: dict[int, PendingHalf] = {}
        self._heap: list[tuple[float, int]] = []
        self._resolved: OrderedDict[int, Outcome] = OrderedDict()

    def check_room(self) -> None:
        """Refuse a new half message when ``max_pending`` are pending.

        Raises:
            BusyError: full.
        """
        if len(self.pending) >= self.max_pending:
            raise BusyError(f"{len(self.pending)} half messages pending (half_max_pending "
                            f"{self.max_pending}); retry when some are resolved")

    def add(self, h: PendingHalf) -> None:
        """A new half message, first checked at ``h.next_check``."""
        self.pending[h.offset] = h
        heapq.heappush(self._heap, (h.next_check, h.offset))

    def restore(self, halves: Iterable[PendingHalf]) -> None:
        """Schedule the half messages read back at start (already in :attr:`pending`)."""
        for h in halves:
            heapq.heappush(self._heap, (h.next_check, h.offset))

    def get(self, offset: int) -> PendingHalf | None:
        """The pending half message at ``offset``."""
        return self.pending.get(offset)

    @staticmethod
    def step(h: PendingHalf, event: HalfEvent) -> None:
        """Move ``h`` by ``event`` (:func:`step`)."""
        h.state = step(h.state, event)

    def resolve(self, h: PendingHalf, out: Outcome) -> None:
        """``h`` ended as ``out`` (COMMIT after COPY_DURABLE, or ROLLBACK): it is no longer
        pending and its outcome is remembered."""
        h.state = step(h.state, _E.COPY_DURABLE if out.state == COMMITTED else _E.ROLLBACK)
        self.pending.pop(h.offset, None)
        self.remember(h.offset, out)

    def remember(self, offset: int, out: Outcome) -> None:
        """Keep ``out`` among the most recent outcomes (least recently used out first)."""
        r = self._resolved
        r[offset] = out
        r.move_to_end(offset)
        while len(r) > self.max_pending:
            r.popitem(last=False)

    def outcome(self, offset: int) -> Outcome | None:
        """A remembered outcome (older ones are only in the half topic)."""
        return self._resolved.get(offset)

    def due(self, now: float) -> Iterator[tuple[PendingHalf, bool]]:
        """The half messages due for a check at ``now``, one at a time: ``(h, True)`` when
        ``h`` ran out of checks (the caller rolls it back), else ``(h, False)`` with the check
        counted and the next one scheduled. A COMMITTING half message is looked at again an
        interval later. Lazy: what the caller does with one is seen by the next."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            t, off = heapq.heappop(heap)
            h = self.pending.get(off)
            if h is None:
                continue
            if (h.state, _E.CHECK) not in TRANSITIONS:  # committing: look again later
                h.next_check = now + h.check_interval_ms / 1000
                heapq.heappush(heap, (h.next_check, off))
                continue
            if h.next_check != t:
                continue  # rescheduled since
            if h.checks >= h.max_checks:
                yield h, True
                continue
            h.checks += 1
            h.next_check = now + h.check_interval_ms / 1000
            heapq.heappush(heap, (h.next_check, off))
            yield h, False

    def floor(self, held: Iterable[int], end: int) -> int:
        """The lowest offset still needed: of a pending half message or in ``held``; ``end``
        when there is none."""
        return min([*self.pending, *held], default=end)
