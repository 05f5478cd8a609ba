"""kill -9 with scheduled messages pending: none lost, none early, the ones that came due while
the broker was down delivered right after it starts; also with the time index lost or torn."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from ferrymq import AdminClient, Message, Producer, PullConsumer, ReceivedMessage
from ferrymq.protocol.schedule import SCHEDULED_DUE, SCHEDULED_ID
from tests.helpers import BrokerProcess

pytestmark = pytest.mark.crash


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def read_copies(address: str, topic: str, expect: int, timeout: float) -> list[ReceivedMessage]:
    """Every copy in ``topic`` from the start (a fresh group), until ``expect`` distinct
    originals were seen and nothing more came for a moment."""
    got: list[ReceivedMessage] = []
    seen: set[str] = set()
    with PullConsumer(address, f"check-{time.monotonic_ns()}", auto_offset_reset="earliest") as c:
        c.subscribe(topic)
        deadline = time.monotonic() + timeout
        quiet_until = 0.0
        while time.monotonic() < deadline:
            batch = c.poll(timeout=0.2)
            got.extend(batch)
            seen.update(x.properties[SCHEDULED_ID] for x in batch)
            if len(seen) >= expect:
                if not quiet_until:
                    quiet_until = time.monotonic() + 0.5
                elif time.monotonic() > quiet_until:
                    break
    return got


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_kill9_with_pending_scheduled_messages(tmp_path: Path, flush: str) -> None:
    with BrokerProcess(tmp_path / "data", flush=flush) as bp:
        with AdminClient(bp.address) as admin:
            admin.create_topic("t", 3)
        delays = {"before": 0.3, "while_down": 1.8, "after": 4.5}
        sent: dict[str, str] = {}  # msg id -> which phase
        with Producer(bp.address) as p:
            for phase, delay in delays.items():
                for r in p.send_batch([Message("t", f"{phase}-{i}".encode(), delay=delay)
                                       for i in range(40)]):
                    sent[r.msg_id] = phase
                for i in range(10):  # one by one too: separate batches, separate buckets
                    sent[p.send(Message("t", f"{phase}-s{i}".encode(),
                                        delay=delay)).msg_id] = phase
            t_sent = now_ms()
        time.sleep(0.9)  # the "before" ones fire
        bp.kill9()
        t_down = now_ms()
        time.sleep(1.5)  # the "while_down" ones come due meanwhile
        bp.start()
        t_up = now_ms()
        assert t_down < t_sent + 1800 < t_up, "timing of the test itself went wrong"
        copies = read_copies(bp.address, "t", len(sent), timeout=15)
    by_id: dict[str, list[ReceivedMessage]] = {}
    for x in copies:
        by_id.setdefault(x.properties[SCHEDULED_ID], []).append(x)
    lost = set(sent) - set(by_id)
    assert not lost, f"lost {len(lost)} scheduled messages, e.g. {sorted(lost)[:3]}"
    assert set(by_id) <= set(sent)
    for mid, xs in by_id.items():
        for x in xs:
            assert x.stored_ms >= int(x.properties[SCHEDULED_DUE]), f"{mid} fired early"
        phase = sent[mid]
        first = min(x.stored_ms for x in xs)
        if phase == "before":
            assert first < t_down
        elif phase == "while_down":  # delivered right after the start
            assert t_up - 2000 <= first <= t_up + 2000, (phase, first - t_up)
        else:
            assert first >= t_up
    duplicates = len(copies) - len(by_id)
    print(f"{flush}: {len(sent)} scheduled, {duplicates} delivered twice")
    assert duplicates <= len(sent) // 3  # at-least-once; duplicates only from the crash window


def test_lost_or_torn_time_index_is_rebuilt_from_the_logs(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with BrokerProcess(data) as bp:
        with Producer(bp.address) as p:
            ids = [r.msg_id for r in p.send_batch(
                [Message("t", f"m{i}".encode(), delay=2.0) for i in range(30)])]
            fired = p.send(Message("t", b"fired", delay=0.1)).msg_id
        time.sleep(1.5)  # "fired" is delivered; watermarks are checkpointed past everything
        bp.kill9()
        sched = data / "schedule"
        buckets = sorted(sched.glob("*.bucket"))
        assert buckets
        with open(buckets[-1], "ab") as f:
            f.write(b"\x01torn")  # a torn tail must not stop the broker
        bp.start()
        copies = read_copies(bp.address, "t", 31, timeout=10)
        assert {x.properties[SCHEDULED_ID] for x in copies} == {*ids, fired}
        bp.kill9()
        shutil.rmtree(sched)  # the whole index is gone: everything is indexed from the logs
        bp.start()
        with Producer(bp.address) as p:
            late = p.send(Message("t", b"late", delay=0.5)).msg_id
        copies = read_copies(bp.address, "t", 32, timeout=10)
        assert {x.properties[SCHEDULED_ID] for x in copies} == {*ids, fired, late}
        assert all(x.stored_ms >= int(x.properties[SCHEDULED_DUE]) for x in copies)
        assert "cutting a torn tail" in bp.log_text() or "torn tail" in bp.log_text()
