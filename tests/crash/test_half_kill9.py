"""kill -9 with half messages in flight (RELIABILITY.md T16 3-4): a producer killed after its
half message is resolved by another producer of its group; a broker killed between half and
commit loses no half message and shows none early."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ferrymq import (
    AdminClient,
    HalfMessageProducer,
    HalfState,
    Message,
    ReceivedMessage,
)
from tests.helpers import BrokerProcess, read_topic, wait_for

pytestmark = pytest.mark.crash

PRODUCER = textwrap.dedent("""
    import os, signal, sys
    from ferrymq import Message, HalfMessageProducer, HalfState

    def checker(msg):
        return HalfState.UNKNOWN

    p = HalfMessageProducer(sys.argv[1], "pg", checker, check_after=0.5, check_interval=0.5)
    ids = [p.prepare(Message("t", f"m{i}".encode(), keys=[f"k{i}"])) for i in range(5)]
    print(",".join(ids), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_producer_kill9_after_half_is_resolved_by_another_producer(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data") as bp:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.run([sys.executable, "-c", PRODUCER, bp.address], capture_output=True,
                              timeout=60, env=env, check=False)
        assert proc.returncode == -9, proc.stderr.decode()
        ids = proc.stdout.decode().strip().split(",")
        assert len(ids) == 5
        assert read_topic(bp.address, "t", quiet=0.2) == []

        def checker(msg: ReceivedMessage) -> HalfState:  # commit even, roll back odd
            n = int(msg.body[1:])
            return HalfState.COMMIT if n % 2 == 0 else HalfState.ROLLBACK

        t0 = time.monotonic()
        with HalfMessageProducer(bp.address, "pg", checker, poll_wait_s=0.5):
            wait_for(lambda: len(read_topic(bp.address, "t", quiet=0.1)) == 3, timeout=15)
            with AdminClient(bp.address) as a:
                states = [a.message_status(i).statuses[0][1] for i in ids]
                wait_for(lambda: all(a.message_status(i).statuses[0][1] != "PREPARED"
                                     for i in ids), timeout=10)
                states = [a.message_status(i).statuses[0][1] for i in ids]
        assert time.monotonic() - t0 < 10  # within a few check intervals
        assert states == ["COMMITTED", "ROLLED_BACK"] * 2 + ["COMMITTED"]
        assert sorted(g.body for g in read_topic(bp.address, "t")) == [b"m0", b"m2", b"m4"]


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_broker_kill9_between_half_and_commit(tmp_path: Path, flush: str) -> None:
    def never(_m: ReceivedMessage) -> HalfState:
        return HalfState.UNKNOWN

    bp = BrokerProcess(tmp_path / "data", flush=flush,
                       env={"FERRYMQ_HALF_CHECK_AFTER_MS": "600000"})
    with bp:
        with HalfMessageProducer(bp.address, "pg", never, check_after=600) as p:
            done = p.send_in_transaction(Message("t", b"before"), lambda _m: HalfState.COMMIT)
            gone = p.send_in_transaction(Message("t", b"rb"), lambda _m: HalfState.ROLLBACK)
            halves = [p.prepare(Message("t", f"h{i}".encode(), sharding_key=f"s{i % 2}"))
                      for i in range(30)]
        bp.kill9()
        bp.start()
        got = read_topic(bp.address, "t")
        assert [g.body for g in got] == [b"before"]  # nothing early, nothing lost
        with AdminClient(bp.address) as a:
            assert all(a.message_status(h).statuses[0][1] == "PREPARED" for h in halves)
            assert a.message_status(done.half_id).statuses[0][1] == "COMMITTED"
            assert a.message_status(gone.half_id).statuses[0][1] == "ROLLED_BACK"
        with HalfMessageProducer(bp.address, "pg", never, check_after=600) as p:
            for h in halves[:20]:
                assert p.commit(h).committed
            for h in halves[20:]:
                p.rollback(h)
        bp.kill9()  # outcomes survive too
        bp.start()
        bodies = sorted(g.body for g in read_topic(bp.address, "t"))
        assert bodies == sorted([b"before"] + [f"h{i}".encode() for i in range(20)])
        with AdminClient(bp.address) as a:
            assert [a.message_status(h).statuses[0][1] for h in halves] == (
                ["COMMITTED"] * 20 + ["ROLLED_BACK"] * 10)
