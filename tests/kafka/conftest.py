"""The Kafka port's fixtures: an in-process broker (sync flush) with its Kafka port on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq import Broker
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
