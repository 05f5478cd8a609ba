"""Read-process-write transactions on a real cluster (etcd and three broker processes) with the
transaction coordinator killed (-9) in the middle.

The loop reads ``in`` (three queues), writes each input to ``out`` (three queues, led by
different brokers) inside a transaction with the consumer offsets, and commits. The coordinator
is the leader of ``%TXN%state``; killing it moves the state log's leadership, the new leader
rebuilds from it and the client follows it. Checker (Jepsen's Kafka/Redpanda findings):
every input is in the committed output exactly once (no lost write, no duplicate: offsets
and output are all-or-nothing), read_committed never returns a record of an attempt that was
aborted, and the attempts it returns are ones whose commit was acknowledged or whose outcome
the client could not learn. Then zombie fencing across brokers: a producer fenced by a new
instance of its transactional id cannot add a queue led by any broker, nor commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from ferrymq._faults import Faults
from ferrymq.broker.txn import TXN_TOPIC
from ferrymq.client import AdminClient, AsyncProducer, Message, Producer, PullConsumer
from ferrymq.client.partitioner import queue_for_key
from ferrymq.client.retry import Backoff
from ferrymq.errors import FerryMQError, ProducerFencedError, TxnUsageError
from ferrymq.testing import ClusterProcess
from tests.cluster.conftest import needs_etcd
from tests.cluster.test_cluster_etcd import FAST, describe, wait_until

pytestmark = [pytest.mark.integration, needs_etcd]

QUEUES = 3
GROUP = "rpw-g"


def _read_all(bootstrap: str, isolation: str, expect: int | None = None,
              quiet_s: float = 2.0) -> list[bytes]:
    """Every record of ``out`` from the start (until ``expect`` are read, then ``quiet_s``
    without a new one)."""
    out: list[bytes] = []
    with PullConsumer(bootstrap, group=f"check-{isolation}-{time.monotonic_ns()}",
                      auto_offset_reset="earliest", isolation=isolation) as c:
        c.assign([("out", q) for q in range(QUEUES)])
        last = time.monotonic()
        deadline = last + 60
        while time.monotonic() < deadline:
            got = c.poll(timeout=0.5)
            out.extend(m.body for m in got)
            if got:
                last = time.monotonic()
            elif (expect is None or len(out) >= expect) and time.monotonic() - last > quiet_s:
                break
    return out


def _rewind(consumer: PullConsumer) -> None:
    """After an abort: go back to the group's committed offsets."""
    committed = consumer.committed()
    for q in range(QUEUES):
        consumer.seek("in", q, committed.get(("in", q), 0))


def _run_rpw(c: ClusterProcess, inputs: int, kills: int) -> None:
    with AdminClient(c.bootstrap) as admin:
        admin.create_topic("in", QUEUES, replicas=3, min_insync=2)
        admin.create_topic("out", QUEUES, replicas=3, min_insync=2)
    with Producer(c.bootstrap) as p:
        for i in range(inputs):
            p.send(Message("in", str(i).encode(), sharding_key=str(i)))
    acked: set[int] = set()  # attempts whose commit was answered
    unknown: set[int] = set()  # attempts whose commit failed: outcome not known
    aborted: set[int] = set()  # attempts aborted by the client (abort answered)
    attempt = 0
    kill_at = [5, 15][:kills]  # after so many acknowledged commits
    killed: list[int] = []
    restarts: list[threading.Thread] = []
    with PullConsumer(c.bootstrap, group=GROUP, auto_offset_reset="earliest",
                      auto_commit=False) as consumer, \
            Producer(c.bootstrap, transactional_id="rpw", request_timeout_s=30,
                     delivery_timeout_s=60) as tp:
        consumer.assign([("in", q) for q in range(QUEUES)])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            msgs = consumer.poll(timeout=0.5, max_messages=10)
            if not msgs:
                if not kill_at and sum(consumer.committed().values()) >= inputs:
                    break
                continue
            attempt += 1
            try:
                tp.begin()
                for msg in msgs:  # each input to a queue of its own (three leaders)
                    tp.send_async(Message("out", f"{msg.body.decode()}:{attempt}".encode(),
                                          sharding_key=msg.body.decode()))
                ends: dict[tuple[str, int], int] = {}
                for msg in msgs:
                    ends[(msg.topic, msg.queue)] = max(ends.get((msg.topic, msg.queue), 0),
                                                       msg.offset + 1)
                tp.send_offsets(GROUP, ends)
                if attempt % 7 == 0:  # some transactions abort on purpose
                    tp.abort()
                    aborted.add(attempt)
                    _rewind(consumer)
                    continue
                tp.commit()
                acked.add(attempt)
            except FerryMQError:
                unknown.add(attempt)
                with contextlib.suppress(FerryMQError):
                    tp.abort()
                _rewind(consumer)
            if kill_at and len(acked) >= kill_at[0]:
                kill_at.pop(0)
                for t in restarts:  # the broker killed before is back (else no ISR of 2)
                    t.join()
                coord = describe(c)[(TXN_TOPIC, 0)][0]
                c.kill9(coord)  # the coordinator, mid-run
                killed.append(coord)
                t = threading.Thread(target=c.restart, args=(coord,))  # back for the next kill
                t.start()
                restarts.append(t)
        done = sum(consumer.committed().values())
        assert done >= inputs, f"only {done} of {inputs} inputs committed in time"
    for t in restarts:
        t.join()
    assert len(killed) == kills
    committed = _read_all(c.bootstrap, "read_committed", expect=inputs)
    everything = _read_all(c.bootstrap, "read_uncommitted", expect=len(committed))
    ids = Counter(int(b.split(b":")[0]) for b in committed)
    assert sorted(ids) == list(range(inputs)), (
        f"lost: {sorted(set(range(inputs)) - set(ids))[:20]}")
    dups = {i: n for i, n in ids.items() if n > 1}
    assert not dups, f"committed twice: {dups}"
    attempts = {int(b.split(b":")[1]) for b in committed}
    assert not attempts & aborted, f"read_committed returned aborted attempts {attempts & aborted}"
    assert attempts <= acked | unknown
    assert set(committed) <= set(everything)


@pytest.mark.timeout(150)
def test_read_process_write_survives_killing_the_coordinator(tmp_path: Path) -> None:
    with ClusterProcess(3, tmp_path / "c", cluster="txn", env=FAST) as c:
        _run_rpw(c, inputs=90, kills=1)
        _check_zombie_fenced(c)


@pytest.mark.soak
@pytest.mark.timeout(600)
def test_read_process_write_soak_two_coordinator_kills(tmp_path: Path) -> None:
    with ClusterProcess(3, tmp_path / "c", cluster="txn", env=FAST) as c:
        _run_rpw(c, inputs=600, kills=2)


def _check_zombie_fenced(c: ClusterProcess) -> None:
    """A producer fenced by a new instance of its id: refused on every queue's leader (also
    queues it had not written to) and at commit; read_committed never shows its records."""
    leaders = {q: describe(c)[("out", q)][0] for q in range(QUEUES)}
    live = [q for q in range(QUEUES) if leaders[q] in _alive(c)]
    assert len(live) >= 2, leaders
    key = {queue_for_key(str(i), QUEUES): str(i) for i in range(100)}
    first, others = live[0], live[1:]
    for q in others:  # a queue the zombie's transaction had not reached, on another leader
        with Producer(c.bootstrap, transactional_id="z", request_timeout_s=30,
                      delivery_timeout_s=30) as zombie:
            zombie.begin()
            zombie.send(Message("out", b"zombie:0", sharding_key=key[first]))
            with Producer(c.bootstrap, transactional_id="z", request_timeout_s=30) as fresh:
                with pytest.raises(ProducerFencedError):  # refused by that queue's leader
                    zombie.send(Message("out", f"zombie:{q}".encode(), sharding_key=key[q]))
                with pytest.raises((ProducerFencedError, TxnUsageError)):
                    zombie.commit()
                fresh.begin()
                fresh.send(Message("out", b"fresh:0", sharding_key=key[first]))
                fresh.commit()
    with Producer(c.bootstrap, transactional_id="z2", request_timeout_s=30) as zombie:
        zombie.begin()  # fenced at its commit: nothing of it is ever read
        zombie.send(Message("out", b"zombie:commit", sharding_key=key[others[0]]))
        with Producer(c.bootstrap, transactional_id="z2", request_timeout_s=30):
            with pytest.raises(ProducerFencedError):
                zombie.commit()
    committed = _read_all(c.bootstrap, "read_committed")
    assert b"fresh:0" in committed
    assert not [b for b in committed if b.startswith(b"zombie")]


def _alive(c: ClusterProcess) -> set[int]:
    return {i for i, b in c.brokers.items() if b.proc is not None and b.proc.poll() is None}



@pytest.mark.timeout(150)
def test_a_commit_decided_before_the_coordinator_dies_stands(tmp_path: Path) -> None:
    """The coordinator dies (SIGKILL at the crash point right after its PrepareCommit is
    replicated) before any marker is written: the next coordinator finishes the commit, the
    producer's retried commit succeeds there, and every queue shows the transaction."""
    with ClusterProcess(3, tmp_path / "c", cluster="txn", env=FAST) as c:
        c.brokers[1].faults = Faults(crash_at="txn.prepare_durable")
        c.kill9(1)
        c.restart(1)  # the one broker that dies at the decision
        with AdminClient(c.bootstrap) as admin:
            admin.create_topic("out", QUEUES, replicas=3, min_insync=2)
        key = {queue_for_key(str(i), QUEUES): str(i) for i in range(100)}
        with Producer(c.bootstrap, transactional_id="decided", request_timeout_s=30,
                      delivery_timeout_s=60) as tp:
            with AdminClient(c.bootstrap) as admin:  # broker 1 coordinates
                wait_until(lambda: len(describe(c)[(TXN_TOPIC, 0)][1]) == 3,
                           "%TXN%state in sync on all three brokers")
                admin.reassign_queue(TXN_TOPIC, 0, [1, 2, 3])
                wait_until(lambda: _moved_to_1(admin), "broker 1 leading %TXN%state")
            tp.begin()
            for q in range(QUEUES):
                tp.send(Message("out", f"d{q}".encode(), sharding_key=key[q]))
            tp.commit()  # broker 1 decides, dies; the next coordinator finishes it
        wait_until(lambda: not c.brokers[1].running(), "broker 1 dead at its crash point")
        committed = _read_all(c.bootstrap, "read_committed", expect=QUEUES)
        assert sorted(committed) == [b"d0", b"d1", b"d2"]


def _moved_to_1(admin: AdminClient) -> bool:
    admin.elect_preferred_leaders([TXN_TOPIC])
    return any(q.topic == TXN_TOPIC and q.leader == 1 for q in admin.cluster_describe().queues)


@pytest.mark.timeout(150)
def test_a_send_refused_for_a_dead_coordinator_goes_again_once_it_moved(tmp_path: Path) -> None:
    """A transaction's first send to a queue is registered with the coordinator by that
    queue's leader (KIP-890's verification); while the coordinator is dead the leader answers
    NOT_COORDINATOR. The producer's retry goes once a refresh shows ``%TXN%state`` at a new
    leader, not after its whole backoff (made 6 s here; the failover takes the 2 s lease)."""
    with ClusterProcess(3, tmp_path / "c", cluster="txn", env=FAST) as c:
        with AdminClient(c.bootstrap) as admin:
            admin.create_topic("out", QUEUES, replicas=3, min_insync=2)
        key = {queue_for_key(str(i), QUEUES): str(i) for i in range(100)}

        async def main() -> float:
            async with AsyncProducer(c.bootstrap, transactional_id="moved", linger_ms=0,
                                     request_timeout_s=30, delivery_timeout_s=60) as tp:
                await tp.begin()
                await tp.send(Message("out", b"before", sharding_key=key[0]))
                await tp.commit()
                view = await asyncio.to_thread(describe, c)
                coord = view[(TXN_TOPIC, 0)][0]
                q = next(q for q in range(QUEUES) if view[("out", q)][0] != coord)
                tp._sender.backoff = Backoff(base_s=6, cap_s=6, floor_s=6)
                c.kill9(coord)
                t0 = time.monotonic()
                await tp.begin()
                await tp.send(Message("out", b"after", sharding_key=key[q]))
                took = time.monotonic() - t0
                await tp.commit()
                return took

        took = asyncio.run(main())
        assert took < 5, took  # the lease and a refresh, not the 6 s backoff
        assert sorted(_read_all(c.bootstrap, "read_committed", expect=2)) == [b"after",
                                                                              b"before"]
