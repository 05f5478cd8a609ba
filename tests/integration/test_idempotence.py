"""The idempotent producer: a batch sent twice is stored once, even across a broker restart;
a sequence gap and an old epoch are refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ferrymq import Broker
from ferrymq.client._transport import Transport
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.records import RecordInput, encode_batch

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
