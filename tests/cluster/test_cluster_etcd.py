"""A real cluster: etcd and three ``ferrymq broker`` processes on loopback, driven by the real
clients. kill -9 of a leader under an ``acks="all"`` producer, a follower's restart and
catch-up, the controller's kill, etcd gone for a few seconds, and the refusals at start."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq.client import AdminClient, Message, Producer, PullConsumer
from ferrymq.client.message import Durability
from ferrymq.testing import ClusterProcess
from tests.cluster.conftest import needs_etcd

pytestmark = [pytest.mark.integration, needs_etcd]

FAST = {"FERRYMQ_METADATA_LEASE_MS": "2000", "FERRYMQ_REPLICA_LAG_MS": "2000"}
"""Short leases and lags so failovers take a couple of seconds, not the default's three."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterProcess]:
    with ClusterProcess(3, tmp_path / "c", cluster="t", env=FAST) as c:  # started
        yield c


def describe(c: ClusterProcess) -> dict[tuple[str, int], tuple[int, list[int]]]:
    """(topic, queue) -> (leader, ISR) as the cluster says."""
    with AdminClient(c.bootstrap, connect_timeout_s=5) as admin:
        d = admin.cluster_describe()
    return {(q.topic, q.queue): (q.leader, list(q.isr)) for q in d.queues}


def wait_until(cond, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except Exception:  # the cluster is moving: ask again
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def drain(c: ClusterProcess, topic: str, expected: int, group: str) -> list[tuple[int, int, bytes]]:
    """Every message of ``topic`` as (queue, offset, body), read by a fresh group."""
    got: list[tuple[int, int, bytes]] = []
    with PullConsumer(c.bootstrap, group=group, auto_offset_reset="earliest") as consumer:
        consumer.subscribe(topic)
        deadline = time.monotonic() + 60
        while len(got) < expected and time.monotonic() < deadline:
            got += [(m.queue, m.offset, m.body) for m in consumer.poll(timeout=1.0)]
    return got


def test_kill9_of_the_leader_loses_no_acknowledged_message(cluster: ClusterProcess) -> None:
    with AdminClient(cluster.bootstrap) as admin:
        admin.create_topic("orders", 2, replicas=3, min_insync=2)
    acked: dict[bytes, tuple[int, int]] = {}
    stop = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            with Producer(cluster.bootstrap, delivery_timeout_s=60) as p:
                i = 0
                while not stop.is_set():
                    body = f"{i % 5}:{i}".encode()
                    r = p.send(Message("orders", body, sharding_key=str(i % 5)))
                    assert r.durability == Durability.REPLICATED
                    acked[body] = (r.queue, r.offset)
                    i += 1
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    t = threading.Thread(target=produce)
    t.start()
    try:
        wait_until(lambda: len(acked) >= 200, "200 acknowledged sends")
        leader = describe(cluster)[("orders", 0)][0]
        before = len(acked)
        cluster.kill9(leader)
        t0 = time.monotonic()
        wait_until(lambda: describe(cluster)[("orders", 0)][0] not in (leader, -1),
                   "a new leader of orders/0")
        wait_until(lambda: len(acked) >= before + 200, "sends resuming after the kill")
        resumed_s = time.monotonic() - t0
        assert resumed_s < 15, resumed_s
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    cluster.restart(leader)  # back, it catches up and rejoins the ISR by itself
    wait_until(lambda: all(sorted(isr) == [1, 2, 3] for _, isr in describe(cluster).values()),
               "the restarted broker back in every ISR")
    got = drain(cluster, "orders", len(acked), "check")
    bodies = [b for _, _, b in got]
    assert len(bodies) == len(set(bodies)), "no message read twice"
    missing = set(acked) - set(bodies)
    assert not missing, f"{len(missing)} acknowledged messages lost"
    for body, (q, off) in acked.items():  # each acknowledged message where its ack said
        assert (q, off, body) in set(got)
    by_key: dict[str, list[int]] = {}
    for _q, _off, b in sorted(got):  # per key, in send order
        key, n = b.decode().split(":")
        by_key.setdefault(key, []).append(int(n))
    for key, ns in by_key.items():
        assert ns == sorted(ns), f"key {key} out of order"


def test_a_follower_restarts_and_catches_up(cluster: ClusterProcess) -> None:
    with AdminClient(cluster.bootstrap) as admin:
        admin.create_topic("logs", 1, replicas=3, min_insync=2)
    leader = describe(cluster)[("logs", 0)][0]
    follower = next(b for b in (1, 2, 3) if b != leader)
    cluster.kill9(follower)
    wait_until(lambda: follower not in describe(cluster)[("logs", 0)][1],
               "the dead follower out of the ISR")
    with Producer(cluster.bootstrap) as p:
        for i in range(500):
            p.send_async(Message("logs", b"x" * 1000 + str(i).encode()))
        p.flush()
    cluster.restart(follower)
    wait_until(lambda: follower in describe(cluster)[("logs", 0)][1],
               "the restarted follower back in the ISR")
    # its copy is the leader's: make it the only one that can lead, and read everything
    cluster.kill9(leader)
    other = next(b for b in (1, 2, 3) if b not in (leader, follower))
    cluster.kill9(other)
    # with min_insync 2 the lone replica serves reads of what was committed (read by offset:
    # a consumer group's coordinator could not write its membership with one replica left)
    wait_until(lambda: describe(cluster)[("logs", 0)][0] == follower, "the follower leading")
    got: list[bytes] = []
    with PullConsumer(cluster.bootstrap, group="g", auto_commit=False,
                      auto_offset_reset="earliest") as consumer:
        consumer.assign([("logs", 0)])
        deadline = time.monotonic() + 60
        while len(got) < 500 and time.monotonic() < deadline:
            got += [m.body for m in consumer.poll(timeout=1.0)]
    assert len(got) == 500


def test_the_controllers_kill_moves_the_seat_and_failover_goes_on(cluster: ClusterProcess) -> None:
    with AdminClient(cluster.bootstrap) as admin:
        admin.create_topic("t", 3, replicas=3, min_insync=2)
        controller = admin.cluster_describe().controller
    assert controller in (1, 2, 3)
    cluster.kill9(controller)

    def new_controller() -> bool:
        with AdminClient(cluster.bootstrap, connect_timeout_s=3) as admin:
            c = admin.cluster_describe().controller
        return c not in (controller, -1)

    wait_until(new_controller, "a new controller")
    wait_until(lambda: all(leader not in (controller, -1)
                           for leader, _ in describe(cluster).values()),
               "every queue led by a live broker")
    with Producer(cluster.bootstrap, delivery_timeout_s=30) as p:
        for i in range(30):
            assert p.send(Message("t", str(i))).durability == Durability.REPLICATED


def test_etcd_gone_for_a_few_seconds(cluster: ClusterProcess) -> None:
    with AdminClient(cluster.bootstrap) as admin:
        admin.create_topic("e", 1, replicas=3, min_insync=2)
    with Producer(cluster.bootstrap, delivery_timeout_s=60) as p, \
            PullConsumer(cluster.bootstrap, group="r", auto_offset_reset="earliest") as c:
        c.subscribe("e")  # the group (and its offsets topic) exists before etcd goes
        assert p.send(Message("e", b"before")).durability == Durability.REPLICATED
        got: list[bytes] = []
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            got += [m.body for m in c.poll(timeout=1.0)]
        cluster.etcd.pause()  # unreachable: leaders fence acks=all within half a lease
        time.sleep(3)
        fut = p.send_async(Message("e", b"during"))
        time.sleep(1)
        assert not fut.done(), "an acks=all send was acknowledged while etcd was unreachable"
        assert got == [b"before"]
        cluster.etcd.resume()
        assert fut.result(60).durability == Durability.REPLICATED  # acknowledged once back
    logs = [cluster.broker(b).log_text() for b in (1, 2, 3)]
    fenced = [t.count("not acknowledging acks=all") for t in logs]
    assert all(n <= 1 for n in fenced), fenced  # logged once, not per request
    assert sum(fenced) >= 1


def test_sigterm_stops_a_broker_while_etcd_is_unreachable(cluster: ClusterProcess) -> None:
    """Shutting down gives the lease up and leaves the cluster through etcd: every such call is
    bounded, so a broker cut off from etcd still stops on SIGTERM, well before a supervisor's
    SIGKILL (systemd's 90 s, Kubernetes' 30 s)."""
    cluster.etcd.pause()
    try:
        time.sleep(4)  # past half a lease: fenced, its controller and renewals retrying
        started = time.monotonic()
        assert cluster.broker(1).terminate(20) == 0
        assert time.monotonic() - started < 15
        assert "stopped cleanly" in cluster.broker(1).log_text()
    finally:
        cluster.etcd.resume()


def test_etcd_unreachable_at_start_exits_nonzero_with_a_message(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "ferrymq.broker", "--port", "0", "--data-dir",
         str(tmp_path / "d"), "--metadata", "etcd://127.0.0.1:1", "--broker-id", "1"],
        capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "metadata" in res.stderr.lower() and "127.0.0.1:1" in res.stderr, res.stderr[-2000:]


def test_a_data_dir_of_another_cluster_is_refused(cluster: ClusterProcess, tmp_path: Path) -> None:
    data = cluster.broker(1).data_dir
    cluster.stop_broker(1)
    res = subprocess.run(
        [sys.executable, "-m", "ferrymq.broker", "--port", "0", "--data-dir", str(data),
         "--metadata", cluster.metadata_url, "--cluster", "other", "--broker-id", "1"],
        capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "belongs to cluster 't'" in res.stderr, res.stderr[-2000:]
