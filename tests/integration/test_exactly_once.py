"""Exactly-once read-process-write transactions against a real broker: visibility, isolation,
offsets in transactions, fencing, timeouts, staged (Spark sink) commits, bad input."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ferrymq import AdminClient, Broker, Message, Producer, PullConsumer
from ferrymq.client._session import Session
from ferrymq.errors import (
    BatchAlreadyCommittedError,
    ConcurrentTransactionsError,
    InvalidTxnTimeoutError,
    ProducerFencedError,
    StagedTxnExpiredError,
    TransactionTimedOutError,
    TxnUsageError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.records import ATTR_CONTROL, ATTR_TRANSACTIONAL, iter_batches
from tests.helpers import read_topic, wait_for


def bodies(msgs: list) -> list[bytes]:  # type: ignore[type-arg]
    return sorted(x.body for x in msgs)


def test_commit_abort_and_isolation(broker: Broker) -> None:
    with AdminClient(broker.address) as a:
        a.create_topic("out", 2)
    with Producer(broker.address, transactional_id="app-1") as p:
        p.begin()
        for i in range(10):
            p.send_async(Message("out", f"c{i}".encode()))
        p.commit()
        p.begin()
        for i in range(5):
            p.send(Message("out", f"a{i}".encode()))
        p.abort()
        p.begin()
        p.send(Message("out", b"c-last"))
        p.commit()
    committed = [f"c{i}".encode() for i in range(10)] + [b"c-last"]
    assert bodies(read_topic(broker.address, "out", 11)) == sorted(committed)
    raw = read_topic(broker.address, "out", 16, isolation="read_uncommitted")
    assert bodies(raw) == sorted(committed + [f"a{i}".encode() for i in range(5)])
    assert all(r.properties.get("%TXN_MARKER") is None for r in raw)  # markers never surface


def test_open_transaction_holds_back_later_messages(broker: Broker) -> None:
    with AdminClient(broker.address) as a:
        a.create_topic("t", 1)
    with Producer(broker.address, transactional_id="slow") as tp, Producer(broker.address) as pp:
        tp.begin()
        tp.send(Message("t", b"in-txn"))
        pp.send(Message("t", b"plain-after"))
        # read_committed stops at the open transaction (the LSO): the later plain message too
        assert read_topic(broker.address, "t", quiet=0.3) == []
        assert bodies(read_topic(broker.address, "t", 2, isolation="read_uncommitted")) == [
            b"in-txn", b"plain-after"]
        with PullConsumer(broker.address, "g-live", auto_offset_reset="earliest") as c:
            c.subscribe("t")
            assert c.poll(timeout=0.3) == []
            tp.commit()  # the long poll wakes when the LSO moves
            got: list = []  # type: ignore[type-arg]
            deadline = time.monotonic() + 5
            while len(got) < 2 and time.monotonic() < deadline:
                got += c.poll(timeout=0.5)
            assert [g.body for g in got] == [b"in-txn", b"plain-after"]


def test_latest_start_is_the_last_stable_offset(broker: Broker) -> None:
    with AdminClient(broker.address) as a:
        a.create_topic("t", 1)
    with Producer(broker.address, transactional_id="lso") as tp:
        tp.begin()
        tp.send(Message("t", b"x"))
        with PullConsumer(broker.address, "late", auto_offset_reset="latest") as c:
            c.subscribe("t")
            c.poll(timeout=0.2)  # resolves the start: latest = LSO = 0, not the end (1)
            assert c.position() == {("t", 0): 0}
            tp.commit()
            got = c.poll(timeout=3)
            assert [g.body for g in got] == [b"x"]


def test_offsets_commit_with_the_transaction(broker: Broker) -> None:
    with AdminClient(broker.address) as a:
        a.create_topic("in", 1)
        a.create_topic("out", 1)
    with Producer(broker.address) as p:
        p.send_batch([Message("in", f"m{i}".encode()) for i in range(6)])
    with Producer(broker.address, transactional_id="rpw") as tp, PullConsumer(
            broker.address, "g", auto_offset_reset="earliest", auto_commit=False) as c:
        c.subscribe("in")
        got = []
        while len(got) < 6:
            got += c.poll(timeout=1, max_messages=6)
        tp.begin()
        for g in got[:3]:
            tp.send(Message("out", g.body.upper()))
        tp.send_offsets("g", {("in", 0): got[2].offset + 1}, consumer=c)
        # while the transaction is open, the group's offset is unstable
        s = Session(broker.address)
        import asyncio

        async def unstable() -> list[tuple[str, int]]:
            try:
                r = await s.request(m.FetchOffsetsRequest("g", None), m.FetchOffsetsResponse)
                return r.unstable
            finally:
                await s.close()
        assert asyncio.run(unstable()) == [("in", 0)]
        with pytest.raises(ConcurrentTransactionsError):
            c.commit({("in", 0): 1})  # a plain commit may not race the transaction
        tp.abort()
        assert c.committed() == {}
        tp.begin()
        for g in got[:3]:
            tp.send(Message("out", g.body.upper()))
        tp.send_offsets("g", {("in", 0): got[2].offset + 1}, consumer=c)
        tp.commit()
        assert c.committed() == {("in", 0): 3}
    assert bodies(read_topic(broker.address, "out", 3)) == [b"M0", b"M1", b"M2"]


def test_zombie_is_fenced(broker: Broker) -> None:
    with AdminClient(broker.address) as a:
        a.create_topic("t", 2)
    old = Producer(broker.address, transactional_id="job")
    old.begin()
    old.send(Message("t", b"zombie-1"))
    new = Producer(broker.address, transactional_id="job")  # aborts old's txn, bumps the epoch
    try:
        with pytest.raises(ProducerFencedError):
            old.send(Message("t", b"zombie-2"))
        with pytest.raises((ProducerFencedError, TxnUsageError)):
            old.commit()
        new.begin()
        new.send(Message("t", b"new-1"))
        new.commit()
        assert new.producer_id == old.producer_id and new._async.producer_epoch > \
            old._async.producer_epoch
    finally:
        old.close()
        new.close()
    assert bodies(read_topic(broker.address, "t", 1)) == [b"new-1"]


def test_timeout_aborts_then_resume(tmp_path: Path) -> None:
    with Broker(tmp_path / "d", txn_default_timeout_ms=1000) as b:
        with Producer(b.address, transactional_id="sleepy") as p:
            p.begin()
            p.send(Message("t", b"late"))
            time.sleep(2.2)  # the housekeeping tick aborts it after 1 s
            with pytest.raises(TransactionTimedOutError):
                p.commit()
            p.abort()  # succeeds: the broker already aborted
            p.begin()  # resumes at a new epoch
            p.send(Message("t", b"fresh"))
            p.commit()
        assert bodies(read_topic(b.address, "t", 1)) == [b"fresh"]
        with pytest.raises(InvalidTxnTimeoutError):
            Producer(b.address, transactional_id="x", txn_timeout_s=10_000)


def test_staged_commit(broker: Broker) -> None:
    with AdminClient(broker.address) as a:
        a.create_topic("sink", 3)
    handles = []
    for task in range(3):
        with Producer(broker.address, transactional_id=f"sink-1:7:{task}:0") as p:
            p.begin()
            p.send_batch([Message("sink", f"b7-t{task}-{i}".encode()) for i in range(4)])
            handles.append(p.stage("sink-1", 7))
    assert read_topic(broker.address, "sink", quiet=0.3) == []  # staged: invisible
    with AdminClient(broker.address) as a:
        assert a.commit_staged("sink-1", 7, handles) == 7
        with pytest.raises(BatchAlreadyCommittedError):  # the driver replays its commit
            a.commit_staged("sink-1", 7, handles)
        # a late task staging a batch already committed is refused at once and aborted, so
        # it does not hold back read_committed readers until its TTL
        with Producer(broker.address, transactional_id="sink-1:6:0:1") as p:
            p.begin()
            p.send(Message("sink", b"late", sharding_key="late"))
            with pytest.raises(BatchAlreadyCommittedError):
                p.stage("sink-1", 6, ttl_s=3600)
            p.abort()
        with Producer(broker.address) as p:
            after = p.send(Message("sink", b"after the late task", sharding_key="late"))
        with PullConsumer(broker.address, "late-reader") as c:
            c.assign([("sink", after.queue)])
            c.seek("sink", after.queue, after.offset)
            msgs = c.poll(timeout=5)
            assert [x.body for x in msgs] == [b"after the late task"]
        # an aborted (expired) handle: nothing of the batch is committed
        good, gone = [], []
        for task in range(2):
            with Producer(broker.address, transactional_id=f"sink-1:8:{task}:0") as p:
                p.begin()
                p.send(Message("sink", f"b8-t{task}".encode()))
                (good if task == 0 else gone).append(p.stage("sink-1", 8))
        assert a.abort_staged("sink-1", 8, gone) == 1
        with pytest.raises(StagedTxnExpiredError):
            a.commit_staged("sink-1", 8, good + gone)
        assert a.abort_staged("sink-1", 8) == 1  # the driver's abort(): the rest
        d = a.describe_transactions(sink_id="sink-1")
        assert d.sinks[0][:2] == ("sink-1", 7)
    got = bodies(read_topic(broker.address, "sink", 13))
    assert got == sorted([*(f"b7-t{t}-{i}".encode() for t in range(3) for i in range(4)),
                          b"after the late task"])


def test_staged_ttl_expires(tmp_path: Path) -> None:
    with Broker(tmp_path / "d") as b:
        with Producer(b.address, transactional_id="ttl-task") as p:
            p.begin()
            p.send(Message("t", b"staged"))
            h = p.stage("sink-ttl", 1, ttl_s=0.5)
        with AdminClient(b.address) as a:
            wait_for(lambda: a.describe_transactions("ttl-task").txns[0][3]
                     == m.TxnState.COMPLETE_ABORT, timeout=5)
            with pytest.raises(StagedTxnExpiredError):
                a.commit_staged("sink-ttl", 1, [h])
        assert read_topic(b.address, "t", isolation="read_uncommitted", quiet=0.3)[0].body \
            == b"staged"
        assert read_topic(b.address, "t", quiet=0.3) == []


def test_bad_input(broker: Broker) -> None:
    with Producer(broker.address, transactional_id="bad") as p:
        with pytest.raises(TxnUsageError):
            p.send(Message("t", b"outside a transaction"))
        with pytest.raises(TxnUsageError):
            p.commit()
        p.begin()
        with pytest.raises(TxnUsageError):
            p.begin()
        with pytest.raises(ValueError):
            p.send(Message("t", b"x", dedup_key="k"))
        with pytest.raises(ValueError):
            p.send(Message("t", b"x", delay=5))
        p.abort()
    with Producer(broker.address) as plain, pytest.raises(TxnUsageError):
        plain.begin()


def test_legacy_fetch_never_sees_markers(broker: Broker) -> None:
    """A client that does not send an isolation (older clients) gets no control batches."""
    with AdminClient(broker.address) as a:
        a.create_topic("t", 1)
    with Producer(broker.address, transactional_id="legacy") as p:
        for i in range(3):
            p.begin()
            p.send(Message("t", f"x{i}".encode()))
            p.commit()
    import asyncio

    async def fetch(isolation: int | None) -> bytes:
        s = Session(broker.address)
        try:
            entries = [("t", 0, 0, 1 << 20, "*")]
            req = (m.FetchRequest(0, 1, 1 << 20, entries) if isolation is None
                   else m.FetchRequest(0, 1, 1 << 20, entries, isolation))
            r = await s.request(req, m.FetchResponse)
            return bytes(r.results[0][7])
        finally:
            await s.close()
    legacy = asyncio.run(fetch(None))
    assert not any(h.attributes & ATTR_CONTROL for _, h in iter_batches(legacy))
    assert sum(1 for _, h in iter_batches(legacy) if h.attributes & ATTR_TRANSACTIONAL) == 3
    new = asyncio.run(fetch(m.Isolation.READ_UNCOMMITTED))
    assert sum(1 for _, h in iter_batches(new) if h.attributes & ATTR_CONTROL) == 3


def test_open_transaction_survives_restart(tmp_path: Path) -> None:
    from tests.helpers import BrokerProcess

    bp = BrokerProcess(tmp_path / "d")
    bp.start()
    try:
        with Producer(bp.address, transactional_id="restart", delivery_timeout_s=30) as p:
            p.begin()
            p.send(Message("t", b"before"))
            bp.terminate()
            bp.start()
            p.send(Message("t", b"after"))
            p.commit()
        assert bodies(read_topic(bp.address, "t", 2)) == [b"after", b"before"]
    finally:
        bp.terminate()


@pytest.mark.parametrize("orderly", [False, True])
def test_delivery_groups_read_committed_only(broker: Broker, orderly: bool) -> None:
    """Simple (lease/ack) consumers never get markers or aborted data, and wait at the LSO."""
    from ferrymq import SimpleConsumer

    with AdminClient(broker.address) as a:
        a.create_topic("t", 1)
    with Producer(broker.address, transactional_id="deliv") as p:
        p.begin()
        p.send_batch([Message("t", f"gone{i}".encode(), sharding_key="k") for i in range(3)])
        p.abort()
        p.begin()
        p.send_batch([Message("t", f"ok{i}".encode(), sharding_key="k") for i in range(3)])
        p.commit()
        p.begin()
        p.send(Message("t", b"open", sharding_key="k"))
        c = SimpleConsumer(broker.address, f"dg-{orderly}", orderly=orderly)
        try:
            c.subscribe("t")
            got = []
            deadline = time.monotonic() + 5
            while len(got) < 3 and time.monotonic() < deadline:
                batch = c.receive(16, wait=0.3)
                c.ack_batch(batch)
                got += batch
            assert [g.body for g in got] == [b"ok0", b"ok1", b"ok2"]
            assert c.receive(16, wait=0.3) == []  # "open" is behind the LSO
            p.commit()
            late = []
            deadline = time.monotonic() + 5
            while not late and time.monotonic() < deadline:
                late = c.receive(16, wait=0.3)
            assert [g.body for g in late] == [b"open"]
        finally:
            c.close()


def test_empty_transactions_end_either_way(broker: Broker) -> None:
    """begin() is local: a transaction that sent nothing commits or aborts without error, right
    after a committed one too (the broker has nothing open at that epoch)."""
    with Producer(broker.address, transactional_id="empty") as p:
        p.begin()
        p.send(Message("t", b"kept"))
        p.commit()
        p.begin()
        p.abort()
        p.begin()
        p.commit()
        p.begin()
        p.send_async(Message("t", b"dropped before it was sent"))
        p.abort()
    assert bodies(read_topic(broker.address, "t", 1)) == [b"kept"]


def test_each_transaction_ends_at_a_new_epoch(broker: Broker) -> None:
    """KIP-890: a commit (or abort) moves the transactional id to the next epoch, which the
    producer uses from then on. END_TXN sent again with the old epoch (its answer was lost) gets
    the same answer; the opposite outcome at the old epoch, and a batch of the old epoch (a late
    zombie of the transaction just ended), are fenced."""
    import asyncio

    from ferrymq.protocol.records import RecordInput, encode_batch

    with AdminClient(broker.address) as a:
        a.create_topic("t", 1)
    with Producer(broker.address, transactional_id="per-txn") as p:
        pid, first = p.producer_id, p._async.producer_epoch
        p.begin()
        p.send(Message("t", b"one"))
        p.commit()
        assert (p.producer_id, p._async.producer_epoch) == (pid, first + 1)
        p.begin()
        p.send(Message("t", b"two"))
        p.abort()
        assert p._async.producer_epoch == first + 2

        async def raw() -> None:
            s = Session(broker.address)
            try:
                again = await s.request(m.EndTxnRequest("per-txn", pid, first + 1, int(
                    m.EndTxnAction.ABORT), "", -1, 0, new_epoch=True), m.EndTxnResponse,
                    retry=False)
                assert (again.state, again.producer_epoch) == (int(m.TxnState.COMPLETE_ABORT),
                                                               first + 2)
                with pytest.raises(ProducerFencedError):
                    await s.request(m.EndTxnRequest("per-txn", pid, first + 1, int(
                        m.EndTxnAction.COMMIT), "", -1, 0, new_epoch=True), m.EndTxnResponse,
                        retry=False)
                late = encode_batch([RecordInput(b"late", 0)], producer_id=pid,
                                    producer_epoch=first, base_sequence=1,
                                    attributes=ATTR_TRANSACTIONAL)
                resp = await s.request(m.ProduceRequest(5000, [("t", 0, bytes(late))]),
                                       m.ProduceResponse, retry=False)
                assert resp.results[0][2] == ProducerFencedError.code
            finally:
                await s.close()

        asyncio.run(raw())
        p.begin()
        p.send(Message("t", b"three"))
        p.commit()
    assert bodies(read_topic(broker.address, "t", 2)) == [b"one", b"three"]

