"""Sends of one sharding key from one producer keep their order across retries, reconnects and
broker kill -9 (no reordering by in-flight retries, no duplicates from retried batches)."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import pytest

from ferrymq import Message, Producer, PullConsumer
from ferrymq.errors import FerryMQError
from tests.helpers import BrokerProcess

pytestmark = [pytest.mark.crash, pytest.mark.integration]

KEYS = 8


@pytest.mark.parametrize("in_flight", [1, 5])
def test_per_key_send_order_survives_kill9_and_retries(tmp_path: Path, in_flight: int) -> None:
    """``in_flight``: batches of one queue on the wire at once; retries must still be stored
    in sequence order (a batch behind a failed one gets OUT_OF_ORDER_SEQUENCE and waits)."""
    with BrokerProcess(tmp_path / "data") as bp:
        sent: list[tuple[int, int, concurrent.futures.Future]] = []  # (key, seq, result)
        with Producer(bp.address, delivery_timeout_s=20, request_timeout_s=2,
                      linger_ms=2, max_in_flight_per_queue=in_flight) as p:
            p.send(Message("ko", b"warm-up", sharding_key="k0"))
            seqs = [0] * KEYS
            t_kill = time.monotonic() + 0.5
            killed = restarted = False
            deadline = time.monotonic() + 4
            i = 0
            while time.monotonic() < deadline:
                k = i % KEYS
                sent.append((k, seqs[k], p.send_async(
                    Message("ko", f"{k}:{seqs[k]}", sharding_key=f"k{k}"))))
                seqs[k] += 1
                i += 1
                if not killed and time.monotonic() > t_kill:
                    bp.kill9()  # sends keep coming: buffered and retried
                    killed = True
                    t_restart = time.monotonic() + 1.0
                if killed and not restarted and time.monotonic() > t_restart:
                    bp.start()
                    restarted = True
                time.sleep(0.0005)
            p.flush()
        acked = {(k, s) for k, s, f in sent if _ok(f)}
        assert killed and restarted
        assert len(acked) > len(sent) * 0.9, f"only {len(acked)} of {len(sent)} acknowledged"
        stored: dict[int, list[int]] = {k: [] for k in range(KEYS)}
        with PullConsumer(bp.address, "check", auto_offset_reset="earliest",
                          auto_commit=False) as c:
            c.subscribe("ko")
            idle = 0
            while idle < 4:
                got = c.poll(0.5, max_messages=5000)
                idle = 0 if got else idle + 1
                for m in got:
                    if m.body != b"warm-up":
                        k, s = m.body.decode().split(":")
                        stored[int(k)].append(int(s))
    for k, got in stored.items():
        assert got == sorted(set(got)), f"key {k}: reordered or duplicated: {got[:50]}"
        assert {(k, s) for s in got} >= {(kk, s) for kk, s in acked if kk == k}, \
            f"key {k}: an acknowledged message is missing"


def _ok(f: concurrent.futures.Future) -> bool:
    try:
        f.result(timeout=30)
        return True
    except FerryMQError:
        return False


@pytest.mark.parametrize("bad", [0, 6])
def test_max_in_flight_per_queue_is_checked(bad: int) -> None:
    from ferrymq.client.producer import AsyncProducer
    from ferrymq.errors import ConfigError

    with pytest.raises(ConfigError, match=r"max_in_flight_per_queue must be 1\.\.5"):
        AsyncProducer("127.0.0.1:1", max_in_flight_per_queue=bad)
