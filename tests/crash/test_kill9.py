"""kill -9 the broker under a produce load; every acknowledged message must survive, in order.

A broker subprocess is SIGKILLed at random moments while a producer sends; after each restart
the test reads every queue from the start and checks that each acknowledged (queue, offset) holds
exactly the body that was acknowledged there, and that offsets are contiguous (no holes, no
reuse). In sync mode an ack means fsynced; in async mode it means written, which a process crash
cannot lose either (the page cache survives).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from ferrymq import Message, Producer, PullConsumer
from ferrymq.errors import FerryMQError
from tests.helpers import BrokerProcess

pytestmark = [pytest.mark.crash, pytest.mark.integration]


def _load(address: str, stop: threading.Event, acked: dict[tuple[int, int], bytes],
          prefix: str) -> None:
    try:
        p = Producer(address, delivery_timeout_s=3, request_timeout_s=2, linger_ms=1)
    except FerryMQError:
        return
    n = 0
    try:
        while not stop.is_set():
            msgs = [Message("crash", f"{prefix}-{n + i}") for i in range(20)]
            n += 20
            try:
                for m, r in zip(msgs, p.send_batch(msgs), strict=True):
                    acked[(r.queue, r.offset)] = m.body
            except FerryMQError:
                time.sleep(0.05)
    finally:
        try:
            p.close()
        except FerryMQError:
            pass


def _read_all(address: str) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {q: [] for q in range(4)}
    with PullConsumer(address, "checker", auto_offset_reset="earliest", auto_commit=False) as c:
        c.assign([("crash", q) for q in range(4)])
        idle = 0
        while idle < 3:
            got = c.poll(0.5, max_messages=5000)
            idle = 0 if got else idle + 1
            for m in got:
                assert m.offset == len(out[m.queue]), "offsets must be contiguous"
                out[m.queue].append(m.body)
    return out


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_no_acknowledged_message_is_lost_across_kill9(tmp_path: Path, flush: str) -> None:
    rng = random.Random(7)
    acked: dict[tuple[int, int], bytes] = {}
    with BrokerProcess(tmp_path / "data", flush=flush) as bp:
        for cycle in range(3):
            stop = threading.Event()
            th = threading.Thread(target=_load, args=(bp.address, stop, acked, f"c{cycle}"))
            th.start()
            time.sleep(rng.uniform(0.8, 2.0))
            bp.kill9()
            stop.set()
            th.join(30)
            assert not th.is_alive()
            bp.start()
        assert len(acked) > 100, "the load should have produced something"
        stored = _read_all(bp.address)
    for (q, off), body in acked.items():
        assert off < len(stored[q]), f"acked {q}/{off} lost"
        assert stored[q][off] == body, f"acked {q}/{off} holds another message"
