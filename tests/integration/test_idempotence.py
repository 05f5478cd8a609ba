"""The idempotent producer: a batch sent twice is stored once, even across a broker restart;
a sequence gap and an old epoch are refused, and a producer that gave up on a batch goes on
under a new epoch."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import ferrymq
from ferrymq import Broker
from ferrymq.client._transport import Transport
from ferrymq.errors import FerryMQTimeoutError
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.records import RecordInput, encode_batch
from tests.helpers import BrokerProcess, FakeStatm, read_topic, wait_for

pytestmark = pytest.mark.integration


def _batch(pid: int, seq: int, n: int = 3, epoch: int = 0) -> bytes:
    return bytes(encode_batch([RecordInput(f"s{seq + i}".encode(), 1) for i in range(n)],
                              producer_id=pid, producer_epoch=epoch, base_sequence=seq))


async def _produce(address: str, entries: list[tuple[str, int, bytes]]) -> list[m.ProduceResult]:
    host, port = address.split(":")
    conn = await Transport.connect(host, int(port), 5)
    try:
        await conn.request(m.HelloRequest("t", "0"), m.HelloResponse, 5)
        await conn.request(m.MetadataRequest(["idem"], True), m.MetadataResponse, 5)
        resp = await conn.request(m.ProduceRequest(5000, entries), m.ProduceResponse, 5)
        return resp.results
    finally:
        conn.close()


async def _pid(address: str) -> int:
    host, port = address.split(":")
    conn = await Transport.connect(host, int(port), 5)
    try:
        return (await conn.request(m.InitProducerRequest(None), m.InitProducerResponse, 5)).producer_id
    finally:
        conn.close()


def test_retried_batch_is_stored_once_even_after_restart(tmp_path: Path) -> None:
    with Broker(tmp_path / "d") as b:
        pid = asyncio.run(_pid(b.address))
        first = asyncio.run(_produce(b.address, [("idem", 0, _batch(pid, 0))]))
        again = asyncio.run(_produce(b.address, [("idem", 0, _batch(pid, 0))]))
        assert first[0][2] == 0 and again[0][2] == 0
        assert again[0][4:6] == first[0][4:6] == (0, 2)
    with Broker(tmp_path / "d") as b:  # the dedup state survives the restart
        again = asyncio.run(_produce(b.address, [("idem", 0, _batch(pid, 0))]))
        assert again[0][4:6] == (0, 2)
        nxt = asyncio.run(_produce(b.address, [("idem", 0, _batch(pid, 3))]))
        assert nxt[0][4:6] == (3, 5)
        assert b.server.topics.queue("idem", 0).log.end_offset == 6
        # a new producer id gets fresh ids, never reused after restart
        assert asyncio.run(_pid(b.address)) > pid


def test_sequence_gap_and_old_epoch_are_refused(broker: Broker) -> None:
    pid = asyncio.run(_pid(broker.address))
    asyncio.run(_produce(broker.address, [("idem", 1, _batch(pid, 0))]))
    gap = asyncio.run(_produce(broker.address, [("idem", 1, _batch(pid, 10))]))
    assert gap[0][2] == ErrorCode.OUT_OF_ORDER_SEQUENCE
    assert "expected" in gap[0][3]
    bumped = asyncio.run(_produce(broker.address, [("idem", 1, _batch(pid, 0, epoch=1))]))
    assert bumped[0][2] == 0
    zombie = asyncio.run(_produce(broker.address, [("idem", 1, _batch(pid, 3, epoch=0))]))
    assert zombie[0][2] == ErrorCode.PRODUCER_FENCED


MiB = 1 << 20


def test_a_given_up_batch_does_not_wedge_its_queue(tmp_path: Path) -> None:
    """A batch refused with BUSY until its delivery timeout leaves the queue's sequence in
    doubt; the producer goes on under a new epoch instead of failing every later send with
    OUT_OF_ORDER_SEQUENCE (Kafka's KIP-360)."""
    statm = FakeStatm(tmp_path / "statm", 50 * MiB)
    env = {"FERRYMQ_MEMORY_HIGH_WATERMARK_BYTES": str(100 * MiB),
           "FERRYMQ_BUSY_RETRY_AFTER_MS": "100"}
    with BrokerProcess(tmp_path / "data", env=env, faults=statm.faults) as bp:
        with ferrymq.AdminClient(bp.address) as admin:
            admin.create_topic("g", 1)
        with ferrymq.Producer(bp.address, delivery_timeout_s=1.0) as p:
            p.send(ferrymq.Message("g", b"a"))  # the broker now tracks this producer's sequence
            statm.set_rss(200 * MiB)
            wait_for(lambda: "refusing produce" in bp.log_text(), timeout=5)
            lost = [p.send_async(ferrymq.Message("g", f"lost{i}".encode())) for i in range(3)]
            for fut in lost:
                with pytest.raises(FerryMQTimeoutError, match="BUSY"):
                    fut.result(10)
            statm.set_rss(50 * MiB)
            wait_for(lambda: "produce accepted again" in bp.log_text(), timeout=5)
            later = [p.send(ferrymq.Message("g", f"later{i}".encode())) for i in range(3)]
            assert [r.offset for r in later] == [1, 2, 3]
        bodies = [m.body for m in read_topic(bp.address, "g", expect=4, quiet=0.3)]
        assert bodies == [b"a", b"later0", b"later1", b"later2"]


def test_a_batch_refused_out_of_order_goes_again_under_a_new_epoch(broker: Broker) -> None:
    """The broker's sequence for the producer moved on without it (here: another writer used
    its id): the refused batch is re-sent from sequence 0 of the next epoch, not failed, and a
    late batch of the old epoch is fenced."""
    with ferrymq.Producer(broker.address) as p:
        p.send(ferrymq.Message("idem", b"first", sharding_key="k"))
        q = p.send(ferrymq.Message("idem", b"second", sharding_key="k")).queue
        # someone else stores sequences 2..3 under this producer's id and epoch
        other = asyncio.run(_produce(broker.address, [("idem", q, _batch(p.producer_id, 2, 2))]))
        assert other[0][2] == 0
        r = p.send(ferrymq.Message("idem", b"third", sharding_key="k"))  # seq 2..2: refused
        r2 = p.send(ferrymq.Message("idem", b"fourth", sharding_key="k"))
        assert (r.queue, r2.offset) == (q, r.offset + 1)
    zombie = asyncio.run(_produce(broker.address, [("idem", q, _batch(p.producer_id, 4, 1))]))
    assert zombie[0][2] == ErrorCode.PRODUCER_FENCED
    got = [m.body for m in read_topic(broker.address, "idem", quiet=0.3) if m.queue == q]
    assert got == [b"first", b"second", b"s2", b"s3", b"third", b"fourth"]


def test_batches_refused_out_of_order_together_go_again_under_one_new_epoch(
        broker: Broker) -> None:
    """Two batches of a queue on the wire, both refused out of order (the broker's sequence
    moved on): the later one waits behind the first for the new epoch instead of being retried
    into the same refusal until delivery_timeout_s (issue 20's stalled bench), and both go
    again in their order."""
    async def main() -> int:
        async with ferrymq.AsyncProducer(broker.address, linger_ms=0,
                                         delivery_timeout_s=60) as p:
            q = (await p.send(ferrymq.Message("idem", b"first", sharding_key="k"))).queue
            other = await _produce(broker.address, [("idem", q, _batch(p.producer_id, 1, 2))])
            assert other[0][2] == 0
            a = p.send_nowait(ferrymq.Message("idem", b"a", sharding_key="k"))  # seq 1: refused
            await asyncio.sleep(0)  # shipped before the answer to "a"
            b = p.send_nowait(ferrymq.Message("idem", b"b", sharding_key="k"))  # seq 2: refused
            assert a is not None and b is not None
            ra, rb = await asyncio.wait_for(asyncio.gather(a, b), 15)  # not delivery_timeout_s
            assert (ra.queue, rb.queue, rb.offset) == (q, q, ra.offset + 1)
            return q

    q = asyncio.run(main())
    got = [m.body for m in read_topic(broker.address, "idem", quiet=0.3) if m.queue == q]
    assert got == [b"first", b"s1", b"s2", b"a", b"b"]
