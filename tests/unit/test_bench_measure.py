"""The bench's measuring tools (ferrymq.admin.bench_measure) on this very process: no broker."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from ferrymq.admin.bench_measure import CpuTime, cpu_seconds, percentile, rss_mb


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert [percentile(values, p) for p in (0, 1, 50, 90, 99, 100)] == [1, 1, 50, 90, 99, 100]
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0  # ceil(1.5) = rank 2
    assert math.isnan(percentile([], 50))


def _no_such_pid() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # above every possible pid


def test_cpu_time_counts_the_seconds_a_process_ran() -> None:
    cpu = CpuTime(os.getpid())
    cpu.begin()
    deadline = time.monotonic() + 5.0
    spent = 0.0
    while spent < 0.05 and time.monotonic() < deadline:  # clock ticks are 10 ms
        sum(range(10_000))
        now = cpu_seconds(os.getpid())
        assert now is not None and cpu.start is not None
        spent = now - cpu.start
    cpu.end()
    assert cpu.used is not None and cpu.used >= 0.05


def test_unknown_processes_have_no_figures() -> None:
    for pid in (None, _no_such_pid()):
        assert cpu_seconds(pid) is None
        assert rss_mb(pid) is None
        cpu = CpuTime(pid)
        cpu.begin()
        cpu.end()
        assert cpu.used is None


def test_rss_of_this_process() -> None:
    rss = rss_mb(os.getpid())
    assert rss is not None and 1.0 < rss < 100_000.0
