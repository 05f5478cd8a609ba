"""The Kafka port's fixtures: an in-process broker (sync flush) with its Kafka port on, and one
behind a proxy that loses the first Produce answer (for idempotent producers' retries)."""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq import Broker
from ferrymq.protocol.records import decode_records, iter_batches
from tests.helpers import free_port


@pytest.fixture
def kbroker(tmp_path: Path) -> Iterator[Broker]:
    """A broker with ``kafka_port`` on a free port and two queues per new topic."""
    b = Broker(tmp_path / "data", port=0, kafka_port=free_port(), default_queues=2).start()
    try:
        yield b
    finally:
        b.stop()


def kafka_address(b: Broker) -> str:
    """``host:port`` of ``b``'s Kafka port."""
    assert b.server.kafka is not None
    host, port = b.server.kafka.address
    return f"{host}:{port}"


def assert_one_batch_per_sequence(b: Broker, topic: str, bodies: list[bytes]) -> None:
    """Queue 0 of ``topic`` holds ``bodies`` once each, one batch per body, all of one
    idempotent producer with sequences 0, 1, ... (what a producer sending one message per
    request stores, retries included)."""
    data = b.server.topics.queue(topic, 0).log.read(0, 1 << 20)
    assert [r.body for r in decode_records(data)] == bodies
    headers = [h for _p, h in iter_batches(data)]
    assert len({h.producer_id for h in headers}) == 1 and headers[0].producer_id >= 0
    assert [h.base_sequence for h in headers] == list(range(len(bodies)))


class ProduceAnswerDropper:
    """A TCP proxy in front of a Kafka port that forwards everything, except that it cuts the
    connection instead of delivering the answer to the first Produce request: the broker has
    stored the batch, the client never hears so, and retries it."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self.produce_requests = 0
        self.dropped = False
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._writers: set[asyncio.StreamWriter] = set()

    def __enter__(self) -> ProduceAnswerDropper:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _close(self) -> None:
        self._server.close()
        for w in self._writers:
            w.transport.abort()
        await self._server.wait_closed()
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        self._writers.add(client_w)
        broker_r, broker_w = await asyncio.open_connection(*self.target)
        self._writers.add(broker_w)
        produce_ids: set[int] = set()

        async def requests() -> None:
            while frame := await read_frame(client_r):
                api_key, _version, correlation_id = struct.unpack_from(">hhi", frame, 4)
                if api_key == 0:  # Produce
                    self.produce_requests += 1
                    produce_ids.add(correlation_id)
                broker_w.write(frame)

        async def answers() -> None:
            while frame := await read_frame(broker_r):
                (correlation_id,) = struct.unpack_from(">i", frame, 4)
                if correlation_id in produce_ids and not self.dropped:
                    self.dropped = True
                    return
                client_w.write(frame)

        pumps = [asyncio.create_task(requests()), asyncio.create_task(answers())]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for w in (client_w, broker_w):
            w.transport.abort()
            self._writers.discard(w)
        for t in pumps:
            t.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def read_frame(r: asyncio.StreamReader) -> bytes:
    """One size-prefixed Kafka frame, size included (b"" at the end of the stream)."""
    try:
        head = await r.readexactly(4)
        return head + await r.readexactly(struct.unpack(">i", head)[0])
    except (asyncio.IncompleteReadError, OSError):
        return b""


@pytest.fixture
def dropper_broker(tmp_path: Path) -> Iterator[tuple[Broker, ProduceAnswerDropper]]:
    """A broker whose Kafka port is reached through a :class:`ProduceAnswerDropper` (Metadata
    names the proxy, ``kafka_advertised_address``)."""
    kafka_port = free_port()
    with ProduceAnswerDropper(("127.0.0.1", kafka_port)) as proxy:
        b = Broker(tmp_path / "data", port=0, kafka_port=kafka_port,
                   kafka_advertised_address=f"127.0.0.1:{proxy.port}").start()
        try:
            yield b, proxy
        finally:
            b.stop()
