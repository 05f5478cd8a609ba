"""Delivery journals are folded into snapshots; state survives kill -9 across generations."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from ferrymq import AdminClient, Message, Producer, SimpleConsumer
from tests.helpers import BrokerProcess

pytestmark = pytest.mark.crash


def test_compaction_then_kill9_keeps_acks_and_leases(tmp_path: Path) -> None:
    cfg = tmp_path / "broker.toml"
    cfg.write_text("delivery_journal_bytes = 2048\n")
    with BrokerProcess(tmp_path / "data", extra=["--config", str(cfg)]) as bp:
        with AdminClient(bp.address) as admin:
            admin.create_topic("t", 3)
        with Producer(bp.address) as p:
            ids = [r.msg_id for r in p.send_batch([Message("t", b"%d" % i) for i in range(600)])]
        c = SimpleConsumer(bp.address, "g", invisible_duration=1.5)
        c.subscribe("t")
        got = []
        deadline = time.monotonic() + 15
        while len(got) < 600 and time.monotonic() < deadline:
            batch = c.receive(7, wait=0.3)  # small batches: many journal records
            got.extend(batch)
        assert len(got) == 600
        keep = [x for i, x in enumerate(got) if i % 10 == 0]  # leased, never acked
        acked = [x for i, x in enumerate(got) if i % 10]
        for i in range(0, len(acked), 5):
            c.ack_batch(acked[i : i + 5])
        gen_dir = tmp_path / "data" / "delivery" / "g"
        deadline = time.monotonic() + 10  # compaction runs on the delivery tick, not inline
        # rotation creates journal.<G+1> first and writes the snapshot after it: wait for both
        journals = sorted(p.name for p in gen_dir.glob("journal.*"))
        while (journals == ["journal.0"] or not (gen_dir / "state").exists()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
            journals = sorted(p.name for p in gen_dir.glob("journal.*"))
        assert journals and journals != ["journal.0"], "the journal should have been rotated"
        assert (gen_dir / "state").exists()
        bp.kill9()
        bp.start()
        with SimpleConsumer(bp.address, "g") as c2:
            c2.subscribe("t")
            back = []
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and len(back) < len(keep):
                b = c2.receive(100, wait=0.3)
                back.extend(b)
                c2.ack_batch(b)
            assert c2.receive(100, wait=1.0) == []
        assert sorted(x.msg_id for x in back) == sorted(x.msg_id for x in keep)
        assert set(ids) == {x.msg_id for x in got}
        with contextlib.suppress(Exception):  # its broker was killed under it
            c.close()
