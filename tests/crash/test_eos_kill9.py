"""Exactly-once under kill -9 (RELIABILITY.md; issue 5): the processing application killed at
random times, the broker killed at each step of a commit, and a paused zombie."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from ferrymq import AdminClient, Message, Producer, PullConsumer
from ferrymq.errors import FerryMQError
from ferrymq.testing import NO_FAULTS, Faults
from tests.helpers import BrokerProcess, read_topic, wait_for

pytestmark = pytest.mark.crash
ROOT = Path(__file__).resolve().parents[2]


def start_app(address: str, tid: str = "rpw-app") -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.workers.rpw_app", address, "in", "out", "g", tid],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def kill_app(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def committed_total(address: str) -> int:
    with PullConsumer(address, "g", auto_commit=False) as c:
        c.assign([("in", q) for q in range(2)])
        return sum(c.committed().values())


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_app_killed_repeatedly_output_is_exactly_once(tmp_path: Path, flush: str) -> None:
    n = 3000
    rng = random.Random(7)
    with BrokerProcess(tmp_path / "d", flush=flush) as bp:
        with AdminClient(bp.address) as a:
            a.create_topic("in", 2)
            a.create_topic("out", 2)
        feed = [Message("in", f"m{i}".encode()) for i in range(n)]
        kills = 0
        with Producer(bp.address) as p:
            for chunk in range(0, n, 500):  # input keeps arriving while the app is killed
                p.send_batch(feed[chunk:chunk + 500])
                app = start_app(bp.address)
                time.sleep(rng.uniform(0.2, 0.8))
                kill_app(app)
                kills += 1
        app = start_app(bp.address)
        try:
            wait_for(lambda: committed_total(bp.address) == n, timeout=60)
        finally:
            kill_app(app)
        out = read_topic(bp.address, "out", n, timeout=30)
        srcs = Counter(o.properties["src"] for o in out)
        assert kills == 6
        assert len(srcs) == n, f"{n - len(srcs)} inputs missing from the output"
        assert max(srcs.values()) == 1, f"duplicates: {[s for s, k in srcs.items() if k > 1][:5]}"
        assert sorted(o.body for o in out) == sorted(f"m{i}".encode() for i in range(n))
        # aborted attempts are in the log, invisible to read_committed readers
        raw = read_topic(bp.address, "out", n, isolation="read_uncommitted", timeout=30)
        assert len(raw) >= n


@pytest.mark.parametrize("point", ["txn.prepare_durable", "txn.markers_durable",
                                   "txn.offsets_applied"])
@pytest.mark.parametrize("flush", ["sync", "async"])
def test_broker_killed_during_commit_finishes_it(tmp_path: Path, point: str, flush: str) -> None:
    data = tmp_path / "d"
    bp = BrokerProcess(data, flush=flush, faults=Faults(crash_at=point))
    bp.start()
    with AdminClient(bp.address) as a:
        a.create_topic("in", 2)
        a.create_topic("out", 2)
    with Producer(bp.address, queue_selector=lambda msg, _n: int(msg.body)) as feed:
        feed.send_batch([Message("in", str(q).encode()) for q in (0, 1) for _ in range(10)])
    p = Producer(bp.address, transactional_id="crashy", delivery_timeout_s=5,
                 request_timeout_s=3)
    try:
        p.begin()
        p.send_batch([Message("out", f"o{i}".encode(), sharding_key=str(i)) for i in range(10)])
        p.send_offsets("g", {("in", 0): 5, ("in", 1): 7})
        with pytest.raises(FerryMQError):  # the broker dies mid-commit
            p.commit()
    finally:
        p._async._closed = True  # do not flush into a dead broker
    assert bp.proc is not None and bp.proc.wait(10) == -signal.SIGKILL
    bp.faults = NO_FAULTS
    bp.start()  # recovery finishes the decided commit before listening
    try:
        got = read_topic(bp.address, "out", 10)
        assert sorted(g.body for g in got) == sorted(f"o{i}".encode() for i in range(10))
        with PullConsumer(bp.address, "g", auto_commit=False) as c:
            c.assign([("in", 0), ("in", 1)])
            assert c.committed() == {("in", 0): 5, ("in", 1): 7}
        with AdminClient(bp.address) as a:
            d = a.describe_transactions("crashy")
            assert d.txns[0][3] == 4  # COMPLETE_COMMIT
        # the producer's id still works after the crash: a new instance commits
        with Producer(bp.address, transactional_id="crashy") as p2:
            p2.begin()
            p2.send(Message("out", b"after"))
            p2.commit()
        assert len(read_topic(bp.address, "out", 11)) == 11
    finally:
        bp.terminate()


def test_broker_killed_before_commit_leaves_nothing_visible(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "d") as bp:
        with Producer(bp.address, transactional_id="half", delivery_timeout_s=30) as p:
            p.begin()
            p.send_batch([Message("out", f"x{i}".encode()) for i in range(5)])
            bp.kill9()
            bp.start()
            # still open after the restart: invisible until the producer decides
            assert read_topic(bp.address, "out", quiet=0.3) == []
            p.abort()
        assert read_topic(bp.address, "out", quiet=0.3) == []
        assert len(read_topic(bp.address, "out", 5, isolation="read_uncommitted")) == 5


def test_paused_zombie_is_fenced(tmp_path: Path) -> None:
    """An app paused (SIGSTOP) while its replacement starts cannot commit when it resumes."""
    with BrokerProcess(tmp_path / "d") as bp:
        with AdminClient(bp.address) as a:
            a.create_topic("in", 2)
            a.create_topic("out", 2)
        with Producer(bp.address) as p:
            p.send_batch([Message("in", f"m{i}".encode()) for i in range(200)])
        zombie = start_app(bp.address, tid="zz")
        try:
            wait_for(lambda: committed_total(bp.address) == 200, timeout=30)
            os.kill(zombie.pid, signal.SIGSTOP)
            with Producer(bp.address) as p:
                p.send_batch([Message("in", f"n{i}".encode()) for i in range(100)])
            with Producer(bp.address, transactional_id="zz") as fresh:  # fences the zombie
                fresh.begin()
                fresh.send(Message("out", b"from-the-new-instance"))
                fresh.commit()
                os.kill(zombie.pid, signal.SIGCONT)
                # the zombie reads the new input but its transactions are refused: it dies
                # on PRODUCER_FENCED (fatal), and none of its output becomes visible
                assert zombie.wait(timeout=20) != 0
        finally:
            kill_app(zombie)
        out = read_topic(bp.address, "out", 201)
        assert len(out) == 201
        assert not any(o.body.startswith(b"n") for o in out)
        assert committed_total(bp.address) == 200
