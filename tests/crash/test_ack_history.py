"""``message status`` keeps when a message was acknowledged, across kill -9 and compaction."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from ferrymq import AdminClient, Message, Producer, SimpleConsumer
from tests.helpers import BrokerProcess

pytestmark = pytest.mark.crash


def consumed_at(admin: AdminClient, msg_id: str, group: str) -> tuple[str, int]:
    st = admin.message_status(msg_id)
    (row,) = [s for s in st.statuses if s[0] == group]
    return row[1], row[7]


def test_ack_times_survive_kill9_and_compaction(tmp_path: Path) -> None:
    cfg = tmp_path / "broker.toml"
    cfg.write_text("delivery_journal_bytes = 4096\ndelivery_ack_history = 50\n")
    with BrokerProcess(tmp_path / "data", extra=["--config", str(cfg)]) as bp:
        with AdminClient(bp.address) as admin:
            admin.create_topic("t", 1)
        with Producer(bp.address) as p:
            ids = [r.msg_id for r in p.send_batch([Message("t", b"%d" % i) for i in range(200)])]
        c = SimpleConsumer(bp.address, "g", invisible_duration=30)
        c.subscribe("t")
        got = []
        deadline = time.monotonic() + 15
        while len(got) < 200 and time.monotonic() < deadline:
            got.extend(c.receive(50, wait=0.3))
        assert [x.msg_id for x in got] == ids
        t0 = time.time() * 1000 - 1000
        c.nack(got[0], delay=0.05)  # its ack comes from the retry queue
        for x in got[1:]:  # one ack per message: 199 runs, more than the 50 kept
            c.ack(x)
        retry = []
        while not retry and time.monotonic() < deadline:
            retry = c.receive(1, wait=0.5)
        assert [x.msg_id for x in retry] == [ids[0]]  # the original id, from the letter
        c.ack(retry[0])
        t1 = time.time() * 1000 + 1000
        with AdminClient(bp.address) as admin:
            before = {i: consumed_at(admin, i, "g") for i in (ids[0], ids[-1], ids[1])}
        assert before[ids[0]][0] == "CONSUMED" and t0 <= before[ids[0]][1] <= t1
        assert before[ids[-1]][0] == "CONSUMED" and t0 <= before[ids[-1]][1] <= t1
        assert before[ids[1]] == ("CONSUMED", -1)  # beyond delivery_ack_history: forgotten
        gen_dir = tmp_path / "data" / "delivery" / "g"
        deadline = time.monotonic() + 10  # compaction runs on the delivery tick
        while sorted(p.name for p in gen_dir.glob("journal.*")) == ["journal.0"]:
            assert time.monotonic() < deadline, "the journal should have been rotated"
            time.sleep(0.05)
        bp.kill9()
        bp.start()
        with AdminClient(bp.address) as admin:
            after = {i: consumed_at(admin, i, "g") for i in (ids[0], ids[-1], ids[1])}
        assert after == before
        with contextlib.suppress(Exception):  # its broker was killed under it
            c.close()
