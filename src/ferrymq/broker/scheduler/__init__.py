"""Delayed and scheduled messages: the broker's scheduler.

:mod:`ferrymq.broker.scheduler.facade` has the theory of operation and the :class:`Scheduler`
the broker and its handlers call; the other modules of this package are its parts (the clock,
the buckets in memory, firing, the originals, cancellation, recovery). ``docs/scheduled.md``
says what users rely on.
"""

from ferrymq.broker.scheduler.cancellation import (
    CANCELLED_STATE,
    DONE,
    FIRED_STATE,
    NOT_SCHEDULED,
    PENDING,
)
from ferrymq.broker.scheduler.facade import MAINTENANCE_INTERVAL_S, Scheduler
from ferrymq.broker.scheduler.firing import COPY_BATCH_BYTES, MAX_FIRE_PER_ROUND, ROUND_INTERVAL_S
from ferrymq.broker.scheduler.recovery import RESCAN_READ_BYTES

__all__ = [
    "CANCELLED_STATE",
    "COPY_BATCH_BYTES",
    "DONE",
    "FIRED_STATE",
    "MAINTENANCE_INTERVAL_S",
    "MAX_FIRE_PER_ROUND",
    "NOT_SCHEDULED",
    "PENDING",
    "RESCAN_READ_BYTES",
    "ROUND_INTERVAL_S",
    "Scheduler",
]
