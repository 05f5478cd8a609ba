"""RELIABILITY.md T15: delayed messages and wall-clock jumps, through the broker's clock seam
(``Faults(clock_file=...)``). Delays count in monotonic time: a forward jump fires nothing
early, a backward jump holds nothing back, and both hold across a kill -9 and restart."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from ferrymq import AdminClient, Message, Producer, PullConsumer
from ferrymq.errors import FerryMQError
from ferrymq.protocol.schedule import SCHEDULED_ID
from ferrymq.testing import Faults
from tests.helpers import BrokerProcess

pytestmark = pytest.mark.crash

HOUR_MS = 3_600_000
EARLY_EPS_S = 0.003  # delays are whole ms; the clocks are read on different sides
LATE_MAX_S = 1.0


@pytest.mark.parametrize("restart", [False, True], ids=["running", "kill9"])
@pytest.mark.parametrize("jump_ms", [HOUR_MS, -HOUR_MS], ids=["forward", "back"])
def test_delays_count_in_monotonic_time_across_wall_clock_jumps(
    tmp_path: Path, jump_ms: int, restart: bool
) -> None:
    clock_file = tmp_path / "clock-offset"
    clock_file.write_text("0")
    rng = random.Random(jump_ms + restart)
    sent: dict[str, tuple[float, float, float]] = {}  # msg id -> (invoked, returned, delay s)
    got: dict[str, float] = {}  # msg id of the original -> when its copy arrived
    stop = threading.Event()
    with BrokerProcess(tmp_path / "data", flush="async",
                       faults=Faults(clock_file=str(clock_file))) as bp:
        with AdminClient(bp.address) as admin:
            admin.create_topic("t", 2)

        def consume() -> None:  # from before the first send: an early delivery is seen early
            with PullConsumer(bp.address, "g", auto_offset_reset="earliest") as c:
                c.subscribe("t")
                while not stop.is_set():
                    try:
                        batch = c.poll(timeout=0.1)
                    except FerryMQError:
                        time.sleep(0.05)  # the broker is restarting
                        continue
                    now = time.monotonic()
                    for msg in batch:
                        got.setdefault(msg.properties.get(SCHEDULED_ID, "warm-up"), now)

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()

        def send(p: Producer, n: int, lo: float, hi: float) -> None:
            for i in range(n):
                delay = round(rng.uniform(lo, hi), 3)
                t0 = time.monotonic()
                r = p.send(Message("t", f"m{i}".encode(), delay=delay))
                sent[r.msg_id] = (t0, time.monotonic(), delay)

        try:
            with Producer(bp.address) as p:
                p.send(Message("t", b"warm-up"))
                deadline = time.monotonic() + 20
                while "warm-up" not in got and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert "warm-up" in got, "the consumer never started"
                send(p, 150, 0.3, 6.0)  # scheduled before the jump
                clock_file.write_text(str(jump_ms))
                time.sleep(0.2)  # the broker reads its clock file at most every 50 ms
                send(p, 100, 0.3, 6.0)  # and after it
            if restart:
                time.sleep(1.2)  # the scheduler checkpoints its clock about once a second
                bp.kill9()
                bp.start()
            deadline = time.monotonic() + 20
            while len(got) < len(sent) + 1 and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            stop.set()
            consumer.join(10)
    missing = set(sent) - set(got)
    assert not missing, f"{len(missing)} scheduled messages never delivered"
    early = {i: sent[i][0] + sent[i][2] - got[i] for i in sent
             if got[i] < sent[i][0] + sent[i][2] - EARLY_EPS_S}
    assert not early, f"{len(early)} delivered early, by up to {max(early.values()):.3f} s"
    if not restart:
        late = max(got[i] - (sent[i][1] + sent[i][2]) for i in sent)
        assert late <= LATE_MAX_S, f"delivered up to {late:.3f} s late"
