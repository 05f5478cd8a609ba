"""A broker killed mid-write leaves a torn or garbage tail; restart truncates it and carries on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ferrymq import AdminClient, Message, Producer, PullConsumer
from tests.helpers import BrokerProcess

pytestmark = [pytest.mark.crash, pytest.mark.integration]


def _segment(data: Path) -> Path:
    logs = sorted((data / "topics" / "t" / "0").glob("*.log"))
    return logs[-1]


def _read(address: str) -> list[bytes]:
    with PullConsumer(address, "chk", auto_offset_reset="earliest", auto_commit=False) as c:
        c.assign([("t", 0)])
        out: list[bytes] = []
        idle = 0
        while idle < 2:
            got = c.poll(0.3)
            idle = 0 if got else idle + 1
            out += [m.body for m in got]
        return out


@pytest.mark.parametrize("damage", ["garbage", "cut-last-batch"])
def test_torn_tail_is_truncated_to_the_last_good_batch(tmp_path: Path, damage: str) -> None:
    data = tmp_path / "data"
    with BrokerProcess(data) as bp:
        with AdminClient(bp.address) as admin:
            admin.create_topic("t", 1)
        with Producer(bp.address) as p:
            for i in range(10):
                p.send(Message("t", f"m{i}"))
        bp.kill9()
        seg = _segment(data)
        size = seg.stat().st_size
        if damage == "garbage":
            with open(seg, "ab") as f:
                f.write(os.urandom(300))
            expected = [f"m{i}".encode() for i in range(10)]
        else:
            os.truncate(seg, size - 7)  # the last batch loses its tail
            expected = [f"m{i}".encode() for i in range(9)]
        bp.start()
        assert _read(bp.address) == expected
        with Producer(bp.address) as p:  # offsets continue right after the good data
            assert p.send(Message("t", b"next")).offset == len(expected)
        assert "truncat" in bp.log_text().lower()
