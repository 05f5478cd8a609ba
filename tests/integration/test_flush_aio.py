"""Sync flush through a real broker: a round's queues are fsynced with one AIO submission
(``flush_aio``, the default) or one by one (off); either way every acknowledged send is fsynced
and readable."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from ferrymq import Broker, Message, Producer, PullConsumer
from ferrymq.broker import flusher as flusher_module
from ferrymq.client.message import Durability
from ferrymq.storage.aio import AioFsync

pytestmark = pytest.mark.integration

QUEUES = 4
MESSAGES = 400
REQUESTS = 10
"""One-request sends in a row: before PRODUCE marked its queues together, the flusher took
the first queue alone in about a third of them (every queue alone in some)."""


def _produce(b: Broker, bodies: list[bytes], *, one_request: bool = False) -> None:
    """Send ``bodies`` round robin: every send acknowledged as fsynced, every queue's log
    durable to its end. ``one_request``: all of them in one PRODUCE request (held until
    ``flush``), else each as soon as the producer can."""
    with Producer(b.address, linger_ms=60_000 if one_request else 0,
                  sticky_queue_bytes=0) as p:
        futures = [p.send_async(Message("aio", body)) for body in bodies]
        p.flush()
        results = [f.result(30) for f in futures]
    assert {r.durability for r in results} == {Durability.FSYNCED}
    assert {r.queue for r in results} == set(range(QUEUES))
    for qs in b.server.topics.get("aio").queues:  # type: ignore[union-attr]
        assert qs.log.durable_offset == qs.log.end_offset > 0


def _read(b: Broker, bodies: list[bytes]) -> None:
    """Every one of ``bodies`` (all that was sent) read back."""
    got: list[tuple[int, bytes]] = []
    with PullConsumer(b.address, f"g{time.monotonic_ns()}", auto_offset_reset="earliest") as c:
        c.subscribe("aio")
        while len(got) < len(bodies):
            msgs = c.poll(timeout=5.0)
            assert msgs, f"only {len(got)} of {len(bodies)} read"
            got += [(m.queue, m.body) for m in msgs]
    assert sorted(body for _q, body in got) == sorted(bodies)


def _bodies(start: int) -> list[bytes]:
    return [f"m{i}".encode() for i in range(start, start + MESSAGES)]


@pytest.mark.skipif(not sys.platform.startswith("linux") or AioFsync.open(1) is None,
                    reason="native AIO is not available here")
def test_rounds_of_several_queues_use_one_submission(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # AIO follows fast rounds only; count every round as fast, however slow this disk is
    monkeypatch.setattr(flusher_module, "PARALLEL_AFTER_S", 60.0)
    with Broker(tmp_path / "data", port=0, default_queues=QUEUES) as b:
        sent = _bodies(0)
        _produce(b, sent)  # (a new log's first flush also fsyncs its directory: not AIO)
        flusher = b.server.flusher
        for i in range(REQUESTS):
            rounds, fsyncs = flusher.aio_rounds, flusher.aio_fsyncs
            bodies = _bodies(len(sent))
            _produce(b, bodies, one_request=True)
            sent += bodies
            # the request's queues were dirty in one round, fsynced by one submission
            assert (flusher.aio_rounds - rounds, flusher.aio_fsyncs - fsyncs) == (1, QUEUES), (
                f"request {i}")
        _read(b, sent)


def test_aio_off_fsyncs_one_by_one(tmp_path: Path) -> None:
    with Broker(tmp_path / "data", port=0, default_queues=QUEUES, flush_aio=False) as b:
        _produce(b, _bodies(0))
        _read(b, _bodies(0))
        assert b.server.flusher.aio_rounds == 0
