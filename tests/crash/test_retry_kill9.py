"""A retry letter pending in the scheduler survives kill -9: the message comes back after its
ladder delay (never before), and ``message status`` shows it RETRYING before and after."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from ferrymq import AdminClient, LeasedMessage, Message, Producer, SimpleConsumer
from tests.helpers import BrokerProcess

pytestmark = pytest.mark.crash

DELAY_S = 4.0


def retrying(admin: AdminClient, msg_id: str) -> tuple[str, int, int, str]:
    (row,) = [s for s in admin.message_status(msg_id).statuses if s[0] == "g"]
    return row[1], row[4], row[5], row[6]


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_pending_retry_survives_kill9_and_is_never_early(tmp_path: Path, flush: str) -> None:
    with BrokerProcess(tmp_path / "data", flush=flush) as bp:
        with AdminClient(bp.address) as admin:
            admin.create_topic("t", 2)
        with Producer(bp.address) as p:
            ids = [r.msg_id for r in p.send_batch([Message("t", f"m{i}".encode())
                                                   for i in range(20)])]
        c = SimpleConsumer(bp.address, "g", retry_delays=[DELAY_S])
        c.subscribe("t")
        got: list[LeasedMessage] = []
        deadline = time.monotonic() + 10
        while len(got) < 20 and time.monotonic() < deadline:
            got.extend(c.receive(64, wait=0.3))
        assert len(got) == 20
        nacked_wall = time.time() * 1000
        for x in got:
            c.nack(x, reason="later")  # the ladder: DELAY_S
        with AdminClient(bp.address) as admin:
            before = {mid: retrying(admin, mid) for mid in ids}
        for state, attempts, next_ms, reason in before.values():
            assert (state, attempts, reason) == ("RETRYING", 1, "later")
            assert nacked_wall + DELAY_S * 1000 - 5 <= next_ms
        if flush == "async":
            time.sleep(0.3)  # async mode promises survival of kill -9 once written
        bp.kill9()
        assert time.time() * 1000 < nacked_wall + DELAY_S * 1000 - 1000, "too slow to test"
        bp.start()
        with AdminClient(bp.address) as admin:
            after = {mid: retrying(admin, mid) for mid in ids}
        assert after == before  # pending in the scheduler's files, same due times
        due_ms = min(next_ms for _, _, next_ms, _ in after.values())
        with SimpleConsumer(bp.address, "g") as c2:
            c2.subscribe("t")
            back: list[tuple[LeasedMessage, float]] = []
            deadline = time.monotonic() + DELAY_S + 15
            while len(back) < 20 and time.monotonic() < deadline:
                batch = c2.receive(64, wait=0.5)
                now_ms = time.time() * 1000
                back.extend((x, now_ms) for x in batch)
                c2.ack_batch(batch)
            assert sorted(x.msg_id for x, _ in back) == sorted(ids)  # each once, none lost
            assert all(x.reconsume_times == 1 for x, _ in back)
            early = [(x.msg_id, due_ms - at) for x, at in back if at < due_ms]
            assert not early, f"redelivered before the retry delay: {early[:3]}"
            assert c2.receive(64, wait=0.5) == []
        with AdminClient(bp.address) as admin:
            assert {retrying(admin, mid)[0] for mid in ids} == {"CONSUMED"}
        with contextlib.suppress(Exception):  # its broker was killed under it
            c.close()
