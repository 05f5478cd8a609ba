"""The ``ferrymq broker`` process's heap: short garbage-collector pauses on a broker with many
queues (the recovered state frozen), and large blocks reused rather than mapped per request.

Theory of operation
-------------------
CPython's cyclic collector walks every tracked object of the oldest generation in a full
collection, on the event loop's thread. A broker's long-lived state (topics, queues, their logs,
indexes, groups) is most of the heap and never becomes garbage while its topic exists: on a
broker with 8,000 queues a full collection took 190-250 ms, every few seconds under a busy
``/metrics`` scraper (bench/README.md, issue 21), stalling every produce and fetch meanwhile.

:meth:`HeapFreezer.settle` collects once and then ``gc.freeze()``\\ s what is left: those objects
move to the permanent generation that collections skip (the remedy Python documents for
long-running servers), so later full collections walk only what came after. It runs after the
broker has started (its recovered state), and again when the number of queues has grown by
:data:`REGROW_FACTOR` since (topics created at run time), or shrunk by as much (topics deleted:
``gc.unfreeze()`` first, so their objects can be collected). Each settle is one full collection's
pause, logged; between them a full collection is short.

glibc's malloc serves a block above its mmap threshold (128 KiB at first, raised as such blocks
are freed) with a fresh mapping, and gives free memory at the top of its heap back to the system
beyond its trim threshold. A broker allocates megabytes per request (a Produce frame read in
place, a fetch's read of the log, a Kafka Fetch answer) and frees them a moment later, so each
request's pages were mapped, zero-filled on first touch and unmapped: page faults were the
largest item of a 10 KB Kafka consume's profile, 2.2 of its 2.5 broker CPU seconds system time.
:func:`tune_malloc` sets both thresholds (``malloc_mmap_threshold_bytes``,
``malloc_trim_threshold_bytes``) so those blocks come from the heap and are reused: that consume
went from 12 to 2.5 µs of broker CPU per message and from 63k to 140k messages a second.

Process-wide: only the ``ferrymq broker`` process does either (:func:`ferrymq.broker.server.run`),
never a broker embedded in someone else's process.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger("ferrymq.broker")

REGROW_FACTOR = 1.25
"""Settle again once the queue count moved by this factor (up or down) since the last settle."""
MIN_QUEUE_CHANGE = 256
"""... and by at least this many queues (a broker of 3 topics does not settle at every one)."""
CHECK_INTERVAL_S = 5.0
"""How often the queue count is compared (by :func:`ferrymq.broker.server.serve`)."""
MAX_MALLOC_MMAP_THRESHOLD = 32 * 1024 * 1024
"""glibc's largest mmap threshold on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``)."""
_M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3


def tune_malloc(mmap_threshold_bytes: int, trim_threshold_bytes: int) -> bool:
    """Set glibc malloc's mmap and trim thresholds (0: leave that one as it is); whether both
    asked for were set (False without glibc, as on musl or macOS: nothing changes)."""
    wanted = [(p, v) for p, v in ((_M_MMAP_THRESHOLD, mmap_threshold_bytes),
                                  (_M_TRIM_THRESHOLD, trim_threshold_bytes)) if v > 0]
    if not wanted:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.info("malloc thresholds not set: this C library has no mallopt")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = all([mallopt(param, value) == 1 for param, value in wanted])
    if not done:
        log.warning("glibc refused a malloc threshold (mmap %d, trim %d bytes)",
                    mmap_threshold_bytes, trim_threshold_bytes)
    return done


class HeapFreezer:
    """Freezes the broker's long-lived objects out of the collector's full collections."""

    def __init__(self, queue_count: Callable[[], int]) -> None:
        self._queue_count = queue_count
        self.settled_at = -1
        """The queue count at the last settle (-1: never)."""
        self.settles = 0

    def settle(self) -> None:
        """Collect everything once, then freeze what survived."""
        started = time.perf_counter()
        gc.unfreeze()  # objects of deleted topics frozen earlier can go now
        gc.collect()
        gc.freeze()
        self.settled_at = self._queue_count()
        self.settles += 1
        log.info("garbage collector: %d objects frozen at %d queues in %.0f ms",
                 gc.get_freeze_count(), self.settled_at, 1000 * (time.perf_counter() - started))

    def tick(self) -> bool:
        """Settle again if the queue count moved enough since the last settle; whether it did."""
        n = self._queue_count()
        last = self.settled_at
        if last < 0 or (abs(n - last) >= MIN_QUEUE_CHANGE
                        and (n >= last * REGROW_FACTOR or n * REGROW_FACTOR <= last)):
            self.settle()
            return True
        return False
