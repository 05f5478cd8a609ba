"""A broker killed and started again at once waits for its former self's lease before it joins;
until it has joined it must not serve (an empty view answers UNKNOWN_TOPIC, which clients do
not retry: the chaos tests saw thousands of sends fail that way): a client that reaches it
then carries on once it has joined. Real etcd and broker processes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ferrymq import AdminClient, Durability, Message, Producer
from ferrymq.testing import ClusterProcess
from tests.cluster.conftest import needs_etcd

pytestmark = [pytest.mark.integration, needs_etcd]


def test_a_restarting_broker_serves_only_once_it_has_joined(tmp_path: Path) -> None:
    with ClusterProcess(2, tmp_path / "c", env={"FERRYMQ_METADATA_LEASE_MS": "3000"}) as c:
        with AdminClient(c.bootstrap) as admin:
            admin.create_topic("t", 2, replicas=2, min_insync=1)
        c.kill9(2)
        restarted = threading.Thread(target=c.restart, args=(2,))
        restarted.start()  # it opens its logs, then waits up to ~4.5 s for its old lease
        try:
            # only broker 2 in the bootstrap list: the producer learns the cluster from it
            with Producer(c.broker(2).address, connect_timeout_s=20,
                          delivery_timeout_s=20) as p:
                r = p.send(Message("t", b"after the restart", sharding_key="k"))
                assert r.durability == Durability.REPLICATED
        finally:
            restarted.join()
        assert "joined cluster" in c.broker(2).log_text()
