"""A FastStream application (``KafkaBroker``, aiokafka underneath) runs unchanged against
FerryMQ's Kafka port: a subscriber in a consumer group republishes what it gets."""

from __future__ import annotations

import asyncio

import pytest

from ferrymq import Broker

faststream_kafka = pytest.importorskip("faststream.kafka")

pytestmark = pytest.mark.integration


def test_faststream_app_consumes_and_publishes(kbroker: Broker) -> None:
    assert kbroker.server.kafka is not None
    address = "{}:{}".format(*kbroker.server.kafka.address)

    async def main() -> list[str]:
        broker = faststream_kafka.KafkaBroker(address)
        seen: list[str] = []
        done = asyncio.Event()

        @broker.subscriber("orders", group_id="enricher", auto_offset_reset="earliest")
        @broker.publisher("enriched")
        async def enrich(body: str) -> str:
            return body.upper()

        @broker.subscriber("enriched", group_id="audit", auto_offset_reset="earliest")
        async def audit(body: str) -> None:
            seen.append(body)
            if len(seen) == 3:
                done.set()

        async with broker:
            await broker.start()
            for word in ("one", "two", "three"):
                await broker.publish(word, "orders")
            await asyncio.wait_for(done.wait(), 60)
        return seen

    assert sorted(asyncio.run(main())) == ["ONE", "THREE", "TWO"]
