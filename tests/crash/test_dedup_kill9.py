"""kill -9 in the middle of dedup-keyed produces: after the restart the window is rebuilt from the
log, every acknowledged key is still a duplicate of the message it was stored as, and sending
every key again leaves each key stored exactly once."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest

from ferrymq import AdminClient, Message, Producer
from ferrymq.errors import FerryMQError
from tests.helpers import BrokerProcess, read_topic, wait_for

pytestmark = pytest.mark.crash

KEYS = [f"order-{i}" for i in range(3000)]
BATCH = 50


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_kill9_mid_produce_keeps_every_acknowledged_key(tmp_path: Path, flush: str) -> None:
    with BrokerProcess(tmp_path / "data", flush=flush) as bp:
        with AdminClient(bp.address) as admin:
            admin.create_topic("orders", 3, {"dedup_window_ms": "600000"})
        acked: dict[str, str] = {}
        stop = threading.Event()

        def produce() -> None:
            try:
                with Producer(bp.address, delivery_timeout_s=2.0, request_timeout_s=1.0) as p:
                    for i in range(0, len(KEYS), BATCH):
                        if stop.is_set():
                            return
                        keys = KEYS[i : i + BATCH]
                        res = p.send_batch([Message("orders", k.encode(), dedup_key=k)
                                            for k in keys])
                        for k, r in zip(keys, res, strict=True):
                            assert not r.duplicate
                            acked[k] = r.msg_id
            except FerryMQError:
                return  # the broker died under us

        t = threading.Thread(target=produce)
        t.start()
        wait_for(lambda: len(acked) >= 600, timeout=30)
        bp.kill9()
        stop.set()
        t.join(30)
        assert not t.is_alive()
        n_acked = len(acked)
        assert 600 <= n_acked < len(KEYS)

        bp.start()
        assert "rebuilt the dedup windows of 1 topics" in bp.log_text()
        with Producer(bp.address) as p:
            again = [r for i in range(0, len(KEYS), 500)
                     for r in p.send_batch([Message("orders", b"again", dedup_key=k)
                                            for k in KEYS[i : i + 500]])]
        for k, r in zip(KEYS, again, strict=True):
            if k in acked:
                assert r.duplicate, k
                assert r.msg_id == acked[k], k
        got = read_topic(bp.address, "orders", len(KEYS), timeout=20.0)
        counts = Counter(x.dedup_key for x in got)
        assert set(counts) == set(KEYS)
        assert max(counts.values()) == 1
        assert {x.dedup_key: x.msg_id for x in got if x.dedup_key in acked} == acked
        # stored before the kill: the original body, not the resend's
        assert all(x.body == x.dedup_key.encode() for x in got if x.dedup_key in acked)
