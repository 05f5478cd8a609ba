"""Cancelling a scheduled message, and looking up the scheduling state of one.

Both read the original (:mod:`.originals`) for its due time, then find its entry in the bucket of
its fire time (:meth:`~ferrymq.broker.scheduler.buckets.BucketIndex.find`). ``cancel`` writes a
*cancelled* entry there; a message already due (fired or firing) or cancelled cannot be
cancelled. Runs on the event-loop thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ferrymq.broker.scheduler.buckets import (
    CANCELLED_ENTRY,
    FIRED_ENTRY,
    PENDING_ENTRY,
    BucketIndex,
)
from ferrymq.broker.scheduler.clock import SchedulerClock
from ferrymq.broker.scheduler.originals import Originals
from ferrymq.errors import InvalidRequestError, NotScheduledError
from ferrymq.protocol.records import decode_msg_id

if TYPE_CHECKING:
    from ferrymq.broker.topics import QueueState

PENDING = "PENDING"
FIRED_STATE = "FIRED"
CANCELLED_STATE = "CANCELLED"
DONE = "DONE"
NOT_SCHEDULED = "NOT_SCHEDULED"

_STATE_NAMES = {PENDING_ENTRY: PENDING, FIRED_ENTRY: FIRED_STATE, CANCELLED_ENTRY: CANCELLED_STATE}


def cancel_entry(index: BucketIndex, originals: Originals, clock: SchedulerClock,
                 msg_id: str, record: Callable[[QueueState, int], int | None],
                 ) -> tuple[QueueState, int, int | None]:
    """Cancel the scheduled message ``msg_id`` if it is not yet due: its queue, due time and
    what ``record`` returned. ``record(queue, offset)`` is called once the message is found
    pending, before its cancelled entry is written: it stores the cancel in the queue (a
    cluster's) and returns the end offset to wait for, or raises to refuse the cancel.

    Raises:
        InvalidRequestError: not a message id.
        NotScheduledError: not a pending scheduled message.
        OSError: the cancelled entry could not be written (nothing changed).
        BrokerError: what ``record`` raised (nothing changed).
    """
    try:
        tid, q, off = decode_msg_id(msg_id)
    except ValueError:
        raise InvalidRequestError(f"not a message id: {msg_id[:64]!r}") from None
    qs, due = originals.original_due(tid, q, off)
    pos = (tid, q, off)
    b, state = index.find(pos, due, clock.skew_lo, clock.skew_hi)
    if b is None:  # a scheduled original whose bucket is done: fired or cancelled, cleaned up
        raise NotScheduledError(f"message {msg_id} is already due or cancelled (its time "
                                f"bucket is done)")
    if state != PENDING_ENTRY:
        what = {FIRED_ENTRY: "already due (delivered or being delivered)",
                CANCELLED_ENTRY: "already cancelled"}.get(state, "not scheduled")
        raise NotScheduledError(f"message {msg_id} is {what}")
    end = record(qs, off)
    index.cancel(b, pos, due)
    return qs, due, end


def lookup_state(index: BucketIndex, originals: Originals, clock: SchedulerClock,
                 topic_id: int, queue: int, offset: int) -> tuple[str, int]:
    """The scheduling state of the message at a position: ``(state, due ms)`` with state
    ``PENDING``, ``FIRED`` (its copy was appended), ``CANCELLED``, ``DONE`` (fired or
    cancelled; its bucket was cleaned up) or ``NOT_SCHEDULED`` (due -1)."""
    try:
        _qs, due = originals.original_due(topic_id, queue, offset)
    except NotScheduledError:
        return NOT_SCHEDULED, -1
    b, state = index.find((topic_id, queue, offset), due, clock.skew_lo, clock.skew_hi)
    if b is None:
        return DONE, due
    return _STATE_NAMES[state], due
