"""Retention through the broker, the public test kit, and graceful shutdown under load."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from ferrymq import AdminClient, Broker, Message, Producer, PullConsumer
from ferrymq.client._transport import Transport, decode_response
from ferrymq.protocol import messages as m
from ferrymq.testing import FakeClock, start_broker
from tests.helpers import BrokerProcess, wait_for

pytestmark = pytest.mark.integration


def test_retention_by_size_deletes_old_segments_and_consumers_reset(tmp_path: Path) -> None:
    with Broker(tmp_path / "d", retention_check_interval_ms=100) as b:
        with AdminClient(b.address) as admin:
            admin.create_topic("ret", 1, {"segment_bytes": "4096", "retention_bytes": "8192"})
        with Producer(b.address) as p:
            for _ in range(20):
                p.send_batch([Message("ret", b"x" * 200) for _ in range(5)])
        with PullConsumer(b.address, "g", auto_offset_reset="earliest") as c:
            c.subscribe("ret")
            c.commit({("ret", 0): 1})
        log = b.server.topics.queue("ret", 0).log
        wait_for(lambda: log.start_offset > 0, timeout=10)
        assert log.size_bytes <= 8192 + 4096
        with AdminClient(b.address) as admin:
            d = admin.describe_topic("ret")
            assert d.queues[0][1] == log.start_offset > 0
        # the committed offset (1) is gone: the consumer resets to earliest and carries on
        with PullConsumer(b.address, "g", auto_offset_reset="earliest") as c:
            c.subscribe("ret")
            got = []
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (not got or got[-1].offset < 99):
                got += c.poll(0.3)
        assert got[0].offset == log.start_offset
        assert got[-1].offset == 99


def test_public_test_kit(tmp_path: Path) -> None:
    b = start_broker(tmp_path / "kit")
    try:
        with Producer(b.address) as p:
            assert p.send(Message("kit", b"x")).offset == 0
    finally:
        b.stop()
    clock = FakeClock()
    t0, w0 = clock.monotonic(), clock.wall_ms()
    clock.advance(1.5)
    assert (clock.monotonic() - t0, clock.wall_ms() - w0) == (1.5, 1500)


async def _long_poll(address: str, offset: int) -> tuple[float, m.FetchResponse]:
    host, port = address.split(":")
    conn = await Transport.connect(host, int(port), 5)
    fut = conn.send(m.FetchRequest(20_000, 1, 1 << 20, [("t", 0, offset, 1 << 20, "*")]))
    await asyncio.sleep(0.5)  # the fetch is parked on the broker now
    t0 = time.monotonic()
    return t0, decode_response(await asyncio.wait_for(fut, 15), m.FetchResponse)


def test_sigterm_answers_long_polls_flushes_and_exits_zero(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data") as bp:
        with AdminClient(bp.address) as admin:
            admin.create_topic("t", 1)
        with Producer(bp.address) as p:
            p.send_batch([Message("t", f"m{i}") for i in range(100)])
        loop = asyncio.new_event_loop()
        task = loop.create_task(_long_poll(bp.address, 100))
        loop.run_until_complete(asyncio.sleep(0.3))
        bp.proc.send_signal(signal.SIGTERM)
        t0, resp = loop.run_until_complete(task)
        loop.close()
        assert time.monotonic() - t0 < 5  # answered at shutdown, not after its 20 s wait
        assert resp.results[0][2] == 0 and resp.results[0][7] == b""
        assert bp.proc.wait(15) == 0
        assert "stopped cleanly" in bp.log_text()
        assert (tmp_path / "data" / ".clean_shutdown").exists()
        bp.start()
        assert "clean shutdown before" in bp.log_text()
        with PullConsumer(bp.address, "g2", auto_offset_reset="earliest") as c2:
            c2.subscribe("t")
            got: list = []
            deadline = time.monotonic() + 10
            while len(got) < 100 and time.monotonic() < deadline:
                got += c2.poll(0.5)
            assert [x.body for x in got] == [f"m{i}".encode() for i in range(100)]
