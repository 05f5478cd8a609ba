"""How a benchmark measures: the broker under test, its CPU time and memory, a sender paced
at a rate, percentiles.

The broker is either started here (a subprocess on a free port of 127.0.0.1 with a temporary
data directory, stopped and deleted afterwards: :class:`ferrymq.testing.BrokerProcess`, the
tests' launcher) or a running one (``--server``). Its CPU time is ``/proc/<pid>/stat``
utime+stime (before and after the timed part, :class:`CpuTime`) and its resident memory
``/proc/<pid>/status`` VmRSS.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferrymq._launcher import BrokerProcess

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# -- broker process ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchedBroker:
    """The broker a bench runs against."""

    address: str
    pid: int | None
    """Its process id (None: unknown, an external broker without ``--broker-pid``)."""
    started_by: str
    """``module``: the bench started it (``python -m ferrymq.broker``); ``external``."""


def cpu_seconds(pid: int | None) -> float | None:
    """utime+stime of a process in seconds (None: unknown)."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    parts = stat[stat.rindex(")") + 2 :].split()
    return (int(parts[11]) + int(parts[12])) / _CLK_TCK  # fields 14 and 15 of stat(5)


def rss_mb(pid: int | None) -> float | None:
    """Resident set size of a process in MiB (VmRSS)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@contextlib.contextmanager
def broker_for(server: str | None, flush: str,
               broker_pid: int | None = None) -> Iterator[BenchedBroker]:
    """The broker to benchmark: ``server`` if given, else a fresh subprocess (stopped
    gracefully afterwards, its data deleted)."""
    if server:
        yield BenchedBroker(server, broker_pid, "external")
        return
    b = BrokerProcess(flush=flush, new_session=True).start()
    try:
        yield BenchedBroker(b.address, b.pid, "module")
    finally:
        b.stop()


# -- the bench's own process --------------------------------------------------------------------


def install_uvloop() -> None:
    """Use uvloop for the bench's own event loop when it is installed."""
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


TIMER_RESOLUTION_S = 0.001
"""libuv's timers count whole milliseconds: uvloop runs a shorter ``asyncio.sleep`` as a
zero-delay timer, so a rate loop sleeping ``1 / rate`` (0.5 ms at 2,000 msg/s) spins and burns a
whole core, which on a 2-core machine is taken from the broker under test."""


async def paced(rate: float, total: int, send_one: Callable[[int], Any], *,
                spin: bool = False) -> float:
    """Call ``send_one(i)`` for i in 0..total-1 at ``rate`` per second (a coroutine result is
    awaited); the seconds taken. The loop wakes when the next message is due, at most every
    :data:`TIMER_RESOLUTION_S`, and sends every message due by then (2 per wake-up at 2,000
    msg/s), so latency measurements do not compete with a spinning sender for the CPU.
    ``spin``: yield to the event loop between checks instead of sleeping (a busy loop)."""
    sent = 0
    t0 = time.perf_counter()
    while sent < total:
        due = min(total, int((time.perf_counter() - t0) * rate) + 1)
        while sent < due:
            r = send_one(sent)
            if asyncio.iscoroutine(r):
                await r
            sent += 1
        if spin:
            await asyncio.sleep(0)
            continue
        wait = sent / rate - (time.perf_counter() - t0)
        await asyncio.sleep(max(wait, TIMER_RESOLUTION_S))
    return time.perf_counter() - t0


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, math.ceil(p / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


@dataclass
class CpuTime:
    """CPU seconds a process used between :meth:`begin` and :meth:`end` (None: unknown)."""

    pid: int | None
    start: float | None = None
    used: float | None = None
    samples: list[float] = field(default_factory=list)

    def begin(self) -> None:
        """Start counting (the timed part begins)."""
        self.start = cpu_seconds(self.pid)

    def end(self) -> None:
        """Stop counting: :attr:`used` is the CPU seconds since :meth:`begin`."""
        now = cpu_seconds(self.pid)
        if now is not None and self.start is not None:
            self.used = now - self.start
