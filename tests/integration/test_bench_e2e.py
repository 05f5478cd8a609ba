"""``ferrymq bench e2e`` against a real broker, and its sender's pacing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

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


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The delays of every ``asyncio.sleep`` call (which still sleeps)."""
    delays: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay: float) -> None:
        delays.append(delay)
        await real_sleep(delay)

    monkeypatch.setattr(asyncio, "sleep", recording_sleep)
    return delays


def test_paced_sleeping_sender_sleeps_whole_timer_ticks(sleeps: list[float]) -> None:
    """Every sleep is at least the loop's timer resolution (a shorter one is a zero timer under
    uvloop: the sender would spin), and the 400 sends share far fewer wake-ups."""
    sends: list[int] = []
    seconds = asyncio.run(paced(2000, 400, sends.append))
    assert sends == list(range(400))
    assert 0.19 <= seconds < 2.0  # 400 at 2,000/s
    assert sleeps and min(sleeps) >= TIMER_RESOLUTION_S
    assert len(sleeps) <= 400 * 0.75


def test_paced_spin_never_sleeps(sleeps: list[float]) -> None:
    asyncio.run(paced(20_000, 200, lambda i: None, spin=True))
    assert sleeps and set(sleeps) == {0}


def test_paced_awaits_coroutines() -> None:
    done: list[int] = []

    async def send(i: int) -> None:
        await asyncio.sleep(0)
        done.append(i)

    async def main() -> None:
        await paced(10_000, 50, send, spin=True)

    asyncio.run(main())
    assert done == list(range(50))
