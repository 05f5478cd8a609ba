"""The dead-broker probe (:mod:`ferrymq.cluster.liveness`) on a real cluster (etcd and three
broker processes) whose lease is long (6 s: renewed every 2 s, so it runs out 4 to 6 s after a
death): a killed leader, and a killed controller, lose their queues in well under that, because
their ports refuse connections; a paused broker (its port still accepts them) keeps its queues
until its lease runs out. And :func:`~ferrymq.cluster.liveness.refused` on its own."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from ferrymq.client import AdminClient
from ferrymq.cluster.liveness import refused
from ferrymq.testing import ClusterProcess
from tests.cluster.conftest import needs_etcd
from tests.cluster.test_cluster_etcd import describe, wait_until

LONG_LEASE = {"FERRYMQ_METADATA_LEASE_MS": "6000", "FERRYMQ_REPLICA_LAG_MS": "2000"}
LEASE_FLOOR_S = 4.0
"""The earliest a 6 s lease renewed every 2 s can run out after its broker's death."""


def test_refused_tells_a_closed_port_from_a_listening_one() -> None:
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port_open, port_closed = listening.getsockname()[1], closed.getsockname()[1]
        assert asyncio.run(refused("127.0.0.1", port_open, 1.0)) is False
        assert asyncio.run(refused("127.0.0.1", port_closed, 1.0)) is True
    # a name that does not resolve is not a refusal (only the lease decides then)
    assert asyncio.run(refused("no-such-host.invalid", 9, 1.0)) is False


def _state(c: ClusterProcess) -> tuple[int, int]:
    """(leader of ``probe/0``, controller) as a live broker says."""
    with AdminClient(c.bootstrap, connect_timeout_s=2, reconnect_timeout_s=2,
                     request_timeout_s=2) as admin:
        d = admin.cluster_describe()
    return next(q.leader for q in d.queues if (q.topic, q.queue) == ("probe", 0)), d.controller


def _moves_within(c: ClusterProcess, role: int, fault: str) -> tuple[int, float]:
    """Fault the broker holding ``role`` (0: the leader of ``probe/0``, 1: the controller)
    with ``fault`` ("kill" or "stop"); the victim and how long until another broker holds the
    role (inf: not within LEASE_FLOOR_S + 4 s)."""
    victim = _state(c)[role]
    pid = c.broker(victim).pid
    assert pid is not None
    t0 = time.monotonic()
    if fault == "kill":
        c.kill9(victim)
    else:
        os.kill(pid, signal.SIGSTOP)
    try:
        while time.monotonic() < t0 + LEASE_FLOOR_S + 4:
            try:
                if _state(c)[role] != victim:
                    return victim, time.monotonic() - t0
            except Exception:  # the cluster is moving: ask again
                pass
            time.sleep(0.05)
        return victim, float("inf")
    finally:
        if fault == "stop":
            os.kill(pid, signal.SIGCONT)


@needs_etcd
@pytest.mark.integration
def test_a_killed_leader_and_a_killed_controller_lose_their_roles_before_their_lease(
        tmp_path: Path) -> None:
    with ClusterProcess(3, tmp_path / "c", env=LONG_LEASE) as c:
        with AdminClient(c.bootstrap) as admin:
            admin.create_topic("probe", 1, replicas=3, min_insync=2)
        for role, name in ((0, "leader"), (1, "controller")):
            wait_until(lambda: len(describe(c)[("probe", 0)][1]) == 3, "three in sync")
            victim, took = _moves_within(c, role, "kill")
            assert took < LEASE_FLOOR_S - 1, f"the {name} (broker {victim}): {took:.2f} s"
            c.restart(victim)


@needs_etcd
@pytest.mark.integration
def test_a_paused_broker_keeps_its_queues_until_its_lease_runs_out(tmp_path: Path) -> None:
    with ClusterProcess(3, tmp_path / "c", env=LONG_LEASE) as c:
        with AdminClient(c.bootstrap) as admin:
            admin.create_topic("probe", 1, replicas=3, min_insync=2)
        wait_until(lambda: len(describe(c)[("probe", 0)][1]) == 3, "three in sync")
        victim, took = _moves_within(c, 0, "stop")
        assert took >= LEASE_FLOOR_S - 0.5, f"a paused broker {victim} lost its queue in {took:.2f} s"
