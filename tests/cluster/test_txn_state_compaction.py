"""``%TXN%state`` is compacted in a cluster (real in-process brokers on one memory store, real
transactional producers): its leader, the transaction coordinator, snapshots every
transactional id's state and deletes the segments the snapshot replaced, its followers follow
the leader's log start, and the next coordinator rebuilds the same ids, producer ids and epochs
from what is left, so a producer goes on through the failover and a zombie stays fenced."""

from __future__ import annotations

import pytest

from ferrymq.broker.txn import TXN_TOPIC
from ferrymq.client import AsyncAdminClient, AsyncProducer, Message
from ferrymq.errors import ProducerFencedError
from tests.cluster.inprocess import cluster, leader_of, run

pytestmark = pytest.mark.integration

SMALL = {"metadata_lease_ms": 2000, "replica_lag_ms": 2000, "txn_state_segment_bytes": 1024}
TIDS = [f"tid-{i}" for i in range(4)]
ROUNDS = 6


def test_a_compacted_state_log_keeps_every_transactional_id_across_a_failover(
        tmp_path: object) -> None:
    async def body() -> None:
        async with cluster(tmp_path, **SMALL) as c:  # type: ignore[arg-type]
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("out", 2, replicas=3, min_insync=2)
            producers = [AsyncProducer(c.bootstrap, transactional_id=t) for t in TIDS]
            for p in producers:
                await p.start()
            for r in range(ROUNDS):  # many small records: several segments' worth
                for i, p in enumerate(producers):
                    await p.begin()
                    await p.send(Message("out", f"{r}-{i}", sharding_key=str(i)))
                    await p.commit()
            zombie = producers[0]
            fresh = AsyncProducer(c.bootstrap, transactional_id=TIDS[0])
            await fresh.start()  # fences the first producer
            coord = leader_of(c, TXN_TOPIC, 0)
            logs = {b: srv.topics.queue(TXN_TOPIC, 0).log for b, srv in c.brokers.items()}
            await c.wait(lambda: all(lg.start_offset > 0 for lg in logs.values()),
                         "every copy's start past offset 0")
            assert logs[coord].size_bytes < 6 * SMALL["txn_state_segment_bytes"]
            before = {t: (m.pid, m.epoch, m.state)
                      for t, m in c.brokers[coord].txn.book.txns.items()}
            assert set(before) == set(TIDS)
            await c.stop(coord)
            await c.wait(lambda: leader_of(c, TXN_TOPIC, 0) in c.brokers, "a new coordinator")
            new = c.brokers[leader_of(c, TXN_TOPIC, 0)]
            await c.wait(lambda: new.txn.cluster is not None and new.txn.cluster.leads,
                         "the new coordinator rebuilt")
            after = {t: (m.pid, m.epoch, m.state) for t, m in new.txn.book.txns.items()}
            assert after == before
            for p in [*producers[1:], fresh]:  # each goes on with its epoch
                await p.begin()
                await p.send(Message("out", b"after", sharding_key="0"))
                await p.commit()
            async def zombie_transaction() -> None:
                await zombie.begin()
                await zombie.send(Message("out", b"zombie", sharding_key="0"))
                await zombie.commit()

            with pytest.raises(ProducerFencedError):  # at its first batch or at its commit
                await zombie_transaction()
            for p in [*producers[1:], fresh]:
                await p.close()
            await zombie.close()

    run(body)
