"""The scheduler's clock: monotonic time from an anchor, deaf to wall-clock jumps while the broker runs.

Theory of operation
-------------------
``S = anchor + monotonic time elapsed``: it never follows a wall-clock jump while the broker
runs, so a delay is measured in monotonic time. An entry stores the message's *due* time (append
time + delay, or the ``deliver_at`` time: wall-clock ms that the log record determines, so
entries are checked against their originals) and a *skew*: the scheduler's clock minus the wall
clock when it was indexed (see :meth:`SchedulerClock.skew`). It fires when ``S`` reaches ``due +
skew`` (its *fire* time; buckets group entries by it). Without a clock jump ``S`` equals the wall
clock and the skew is 0. After a jump of J, ``S`` differs from the wall clock by J for good and
new entries carry skew J: every wait is still counted from the moment the message was stored.
The anchor is checkpointed with the watermarks as ``(S, wall)``; a start resumes ``S = S_saved +
max(0, wall - wall_saved)`` (time while the broker was down counts as elapsed; a backward jump
while down counts as none), or the wall clock itself when that is within ``SKEW_SNAP_MS`` of it
(the two readings' rounding, which must not put ``S`` ahead: entries would fire early).

Pure apart from the injected :class:`~ferrymq._time.Clock`: the checkpoint is read and written
by the scheduler (:mod:`ferrymq.broker.scheduler.facade`), which hands the reading in here.
"""

from __future__ import annotations

import logging
import math

from ferrymq._time import Clock

log = logging.getLogger("ferrymq.broker")

SKEW_SNAP_MS = 2
"""A skew this small (rounding between the clocks) is written as 0."""
CLOCK_SAVE_MS = 50
"""The clock anchor is checkpointed again when ``S - wall`` moved by more than this."""
JUMP_LOG_MS = 1000
"""A change of ``S - wall`` by more than this is logged as a wall-clock jump."""

ClockMeta = tuple[int, int, int, int]
"""``(S ms, wall ms, lowest skew, highest skew)``: what the checkpoint stores of the clock."""


class SchedulerClock:
    """``S``, the clock entries fire by, and the range of skews written. See the module
    docstring."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.anchor_ms = float(clock.wall_ms())
        self.anchor_mono = clock.monotonic()
        self.offset_saved = 0  # S - wall when the anchor was last checkpointed
        self.skew_lo = 0  # the range of skews written (bounds where an entry is looked for)
        self.skew_hi = 0
        self.skew_saved: tuple[int, ...] = (0, 0)

    def now_ms(self) -> float:
        """The scheduler's clock in ms: ``anchor + monotonic time elapsed`` (module docstring)."""
        return self.anchor_ms + (self.clock.monotonic() - self.anchor_mono) * 1000.0

    def offset_ms(self) -> int:
        """``S - wall``: 0 until the wall clock jumps while the broker runs."""
        return round(self.now_ms()) - self.clock.wall_ms()

    def to_wall(self, fire_ms: int) -> int:
        """When (wall-clock ms, as the wall clock runs now) the scheduler's clock reaches
        ``fire_ms``."""
        offset = self.offset_ms()
        return fire_ms if -SKEW_SNAP_MS <= offset <= SKEW_SNAP_MS else fire_ms - offset

    def skew(self, append_time_ms: int) -> int:
        """The skew of an entry indexed now for a message stored at ``append_time_ms``: ``S -
        wall`` now (rounded up: never early), less how far the append time is ahead of the wall
        clock (a queue's append times do not go back after a backward jump). Not ``S - append
        time``: the wall clock has moved on while the request was handled, and that must not
        make the message late. Small skews are snapped to 0."""
        wall = self.clock.wall_ms()
        skew = math.ceil(self.now_ms()) - wall
        if append_time_ms > wall:
            skew -= append_time_ms - wall
        if -SKEW_SNAP_MS <= skew <= SKEW_SNAP_MS:
            return 0
        self.note_skew(skew)
        return skew

    def note_skew(self, skew: int) -> None:
        """Widen the range of skews written to hold ``skew`` (an entry read back at a start)."""
        if skew < self.skew_lo:
            self.skew_lo = skew
        elif skew > self.skew_hi:
            self.skew_hi = skew

    def meta(self) -> ClockMeta:
        """The reading the checkpoint stores: ``S`` and the wall clock taken together, and the
        range of skews."""
        wall = self.clock.wall_ms()
        return round(self.now_ms()), wall, self.skew_lo, self.skew_hi

    def resume(self, saved: ClockMeta | None) -> None:
        """Continue the clock of the last run from its checkpointed reading (module docstring)."""
        if saved is None:
            return
        s_ms, w_ms, lo, hi = saved
        wall = self.clock.wall_ms()
        resumed = s_ms + max(0, wall - w_ms)
        # the saved S (rounded) and wall (truncated) were read one after the other: a small
        # difference is that rounding, not a jump, and S must not run ahead of the wall clock
        # by it (entries would fire early): resume on the wall clock
        self.anchor_ms = float(wall if abs(resumed - wall) <= SKEW_SNAP_MS else resumed)
        self.anchor_mono = self.clock.monotonic()
        self.offset_saved = round(self.anchor_ms) - wall
        self.skew_lo = min(self.skew_lo, lo)
        self.skew_hi = max(self.skew_hi, hi)
        self.skew_saved = (lo, hi)
        if abs(self.offset_saved) > JUMP_LOG_MS:
            log.warning("scheduler: its clock runs %+d ms from the wall clock (wall-clock jumps "
                        "while the broker ran); delays keep counting in monotonic time",
                        self.offset_saved)

    def moved(self, meta: ClockMeta) -> bool:
        """Whether ``S - wall`` or the range of skews moved enough since the last checkpoint
        that the reading ``meta`` must be checkpointed (a large move is logged as a jump); if
        so it counts as saved from now on."""
        offset = meta[0] - meta[1]
        clock_moved = (abs(offset - self.offset_saved) > CLOCK_SAVE_MS
                       or meta[2:] != self.skew_saved)
        if clock_moved:
            if abs(offset - self.offset_saved) > JUMP_LOG_MS:
                log.warning("scheduler: the wall clock jumped by %+d ms; delays keep counting in "
                            "monotonic time", self.offset_saved - offset)
            self.offset_saved = offset
            self.skew_saved = meta[2:]
        return clock_moved

    def saved(self, meta: ClockMeta) -> None:
        """The reading ``meta`` was checkpointed."""
        self.offset_saved = meta[0] - meta[1]
        self.skew_saved = meta[2:]
