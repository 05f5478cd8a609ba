"""``ferrymq bench e2e`` against a real broker, and its sender's pacing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from ferrymq import Broker
from ferrymq.admin.bench import TIMER_RESOLUTION_S, paced

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("pacing", ["sleep", "spin"])
def test_bench_e2e_reports_latency(broker: Broker, pacing: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ferrymq.admin.cli", "bench", "e2e", "--server", broker.address,
         "--rate", "400", "--duration", "1", "--warmup", "0.2", "--pacing", pacing, "--json"],
        capture_output=True, text=True, timeout=120, check=True).stdout
    res = json.loads(out)
    assert res["pacing"] == pacing
    assert res["sent"] == 400 and res["received"] == 400
    assert 0 < res["p50_ms"] <= res["p99_ms"] <= res["max_ms"]
    assert res["p99_born_to_stored_ms"] is not None and res["p99_stored_to_received_ms"] > 0


def test_paced_sleeping_sender_wakes_at_most_once_per_timer_tick() -> None:
    wakeups = []

    async def main() -> float:
        return await paced(2000, 400, lambda i: wakeups.append(time.perf_counter()))

    seconds = asyncio.run(main())
    assert len(wakeups) == 400
    assert 0.19 <= seconds < 2.0  # 400 at 2,000/s
    distinct = len({round(t / TIMER_RESOLUTION_S) for t in wakeups})
    assert distinct <= 400 * 0.75  # two per wake-up, not one per loop iteration


def test_paced_awaits_coroutines() -> None:
    done: list[int] = []

    async def send(i: int) -> None:
        await asyncio.sleep(0)
        done.append(i)

    async def main() -> None:
        await paced(10_000, 50, send, spin=True)

    asyncio.run(main())
    assert done == list(range(50))
