"""The failover bench's wait for a queue's state ends with a clear error when no broker answers
(a bench whose brokers are all gone used to hang there for ever)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from ferrymq.admin.bench_failover import queue_state

pytestmark = pytest.mark.integration


def test_queue_state_gives_up_when_no_broker_answers() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    with pytest.raises(RuntimeError, match=r"no broker of 127\.0\.0\.1:\d+ described it within 1 s"):
        asyncio.run(queue_state(f"127.0.0.1:{port}", "t", 0, timeout_s=1.0))
