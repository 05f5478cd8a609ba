"""How ready batches become PRODUCE requests: at most ``max_request_bytes`` each.

A proxy between the producer and a real broker decodes the client's stream with the protocol's
own frame decoder and records every request's type and size.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from ferrymq import Broker
from ferrymq.client.admin import AsyncAdminClient
from ferrymq.client.consumer import AsyncPullConsumer
from ferrymq.client.message import Message
from ferrymq.client.producer import AsyncProducer
from ferrymq.errors import ConfigError
from ferrymq.protocol.frames import FrameDecoder
from ferrymq.protocol.messages import ApiKey

pytestmark = pytest.mark.integration


class FrameCountingProxy:
    """Forwards bytes both ways; records (api_key, payload bytes) of each client request."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._up = (host, int(port))
        self.requests: list[tuple[int, int]] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _client(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(*self._up)
        decoder = FrameDecoder(64 * 1024 * 1024)

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, count: bool) -> None:
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                while data := await r.read(1 << 16):
                    if count:
                        self.requests += [(f.api_key, len(f.payload)) for f in decoder.feed(data)]
                    w.write(data)
                    await w.drain()
            w.close()

        for coro in (pump(cr, uw, True), pump(ur, cw, False)):
            task = asyncio.get_running_loop().create_task(coro)
            self._tasks.add(task)

    def produce_sizes(self) -> list[int]:
        return [n for key, n in self.requests if key == ApiKey.PRODUCE]


async def _four_batches_at_once(broker: Broker, **options: int) -> tuple[list[int], list[bytes]]:
    """Four 80 KB batches ready in one sender wake-up; the PRODUCE sizes, then what a consumer
    reads back from the topic."""
    async with AsyncAdminClient(broker.address) as admin:
        await admin.create_topic("req", 4)
    proxy = FrameCountingProxy(broker.address)
    address = await proxy.start()
    body = b"x" * 10_000
    sent = [[Message("req", bytes([k]) * 8 + body) for _ in range(8)] for k in range(4)]
    try:
        async with AsyncProducer(address, linger_ms=0, **options) as p:
            await p.send(Message("req", b"warm-up"))
            before = len(proxy.produce_sizes())
            await asyncio.gather(*(p.send_batch(batch) for batch in sent))
            sizes = proxy.produce_sizes()[before:]
    finally:
        await proxy.close()
    async with AsyncPullConsumer(broker.address, "g", auto_offset_reset="earliest") as c:
        await c.subscribe("req")
        got: list[bytes] = []
        for _ in range(50):
            got += [msg.body for msg in await c.poll(timeout=0.2)]
            if len(got) >= 33:
                break
    return sizes, got


def test_requests_are_capped_at_max_request_bytes(broker: Broker) -> None:
    sizes, got = asyncio.run(_four_batches_at_once(broker, max_request_bytes=100_000))
    assert len(sizes) == 4 and all(80_000 < n < 100_000 for n in sizes), sizes
    assert len(got) == 33 and sorted(got)[:-1] == sorted(
        bytes([k]) * 8 + b"x" * 10_000 for k in range(4) for _ in range(8))


def test_one_request_carries_every_batch_that_fits(broker: Broker) -> None:
    sizes, got = asyncio.run(_four_batches_at_once(broker))  # default: 1 MiB
    assert len(sizes) == 1 and 320_000 < sizes[0] < 400_000, sizes
    assert len(got) == 33


def test_a_batch_larger_than_the_cap_goes_alone(broker: Broker) -> None:
    sizes, got = asyncio.run(_four_batches_at_once(broker, max_request_bytes=1000))
    assert len(sizes) == 4 and all(n > 80_000 for n in sizes), sizes
    assert len(got) == 33


def test_max_request_bytes_is_checked() -> None:
    with pytest.raises(ConfigError, match="max_request_bytes must be > 0"):
        AsyncProducer("127.0.0.1:1", max_request_bytes=0)


async def _flush_before_the_topic_is_known(broker: Broker) -> tuple[list[int], int]:
    """Eight sends to a topic the producer has no metadata for yet, then a flush (the answers
    must come long before ``linger_ms``); the PRODUCE sizes and how many sends succeeded."""
    proxy = FrameCountingProxy(broker.address)
    address = await proxy.start()
    try:
        async with AsyncProducer(address, linger_ms=3_600_000, delivery_timeout_s=10) as p:
            futs = [p.send_nowait(Message("fresh", f"m{i}")) for i in range(8)]
            await asyncio.wait_for(p.flush(), 10)
            ok = sum(f is not None and f.done() and f.exception() is None for f in futs)
            sizes = proxy.produce_sizes()
    finally:
        await proxy.close()
    return sizes, ok


def test_a_flush_sends_what_waited_for_the_topics_metadata(broker: Broker) -> None:
    # the metadata comes back while the flush waits: those messages must not linger either
    sizes, ok = asyncio.run(_flush_before_the_topic_is_known(broker))
    assert (len(sizes), ok) == (1, 8), sizes
