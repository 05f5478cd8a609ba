"""A rolling restart of a real cluster (etcd and three broker processes) under load: each broker
in turn is stopped gracefully and started again, waiting for it to be back in every ISR, while an
``acks="all"`` producer and a consumer group run. Nothing acknowledged is lost, and neither
client raises: a graceful stop hands leadership over at once and the clients follow it.
Push consumers through a rolling restart: ``test_delivery_failover.py`` (the history checker of
delivery groups)."""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path

import pytest

from ferrymq.client import AdminClient, Message, Producer, PullConsumer
from ferrymq.client.message import Durability
from ferrymq.testing import ClusterProcess
from tests.cluster.conftest import needs_etcd
from tests.cluster.test_cluster_etcd import FAST, describe, wait_until

pytestmark = [pytest.mark.integration, needs_etcd]


def test_a_rolling_restart_under_load_loses_nothing_and_shows_no_error(tmp_path: Path) -> None:
    with ClusterProcess(3, tmp_path / "c", cluster="roll", env=FAST) as cluster:
        with AdminClient(cluster.bootstrap) as admin:
            admin.create_topic("r", 3, replicas=3, min_insync=2)
        acked: set[bytes] = set()
        seen: set[bytes] = set()
        stop = threading.Event()
        errors: list[BaseException] = []

        def produce() -> None:
            try:
                with Producer(cluster.bootstrap, delivery_timeout_s=60) as p:
                    i = 0
                    while not stop.is_set():
                        body = f"m{i}".encode()
                        r = p.send(Message("r", body, sharding_key=str(i % 7)))
                        assert r.durability == Durability.REPLICATED
                        acked.add(body)
                        i += 1
                        time.sleep(0.002)
            except BaseException as exc:  # reported by the test
                errors.append(exc)

        def consume() -> None:
            try:
                with PullConsumer(cluster.bootstrap, group="roll",
                                  auto_offset_reset="earliest") as c:
                    c.subscribe("r")
                    while not stop.is_set() or not acked <= seen:
                        seen.update(m.body for m in c.poll(timeout=0.5))
                        if stop.is_set() and time.monotonic() > drain_until[0]:
                            return
            except BaseException as exc:
                errors.append(exc)

        drain_until = [float("inf")]
        threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: len(acked) >= 100, "100 acknowledged sends")
            for b in (1, 2, 3):
                cluster.stop_broker(b)
                gone = describe(cluster)  # asked of the others: b leads nothing, is in no ISR
                assert all(leader != b and b not in isr for leader, isr in gone.values()), gone
                cluster.restart(b)
                wait_until(lambda: all(sorted(isr) == [1, 2, 3]
                                       for _, isr in describe(cluster).values()),
                           "the restarted broker back in every ISR", timeout=60)
                wait_until(partial(lambda n: len(acked) >= n + 50, len(acked)),
                           "sends going on after the restart")
        finally:
            drain_until[0] = time.monotonic() + 60
            stop.set()
            for t in threads:
                t.join(90)
        assert not errors, errors  # no client raised through the restarts
        missing = acked - seen
        assert not missing, f"{len(missing)} of {len(acked)} acknowledged messages not consumed"
