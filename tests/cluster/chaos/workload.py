"""The chaos workload: idempotent producers of unique ids with sharding keys, a reader that
reads throughout, and the drain after healing; everything recorded in a
:class:`~.history.History`.

Theory of operation
-------------------
Each producer (an :class:`~ferrymq.client.AsyncProducer`, ``acks="all"``, idempotent) runs
one worker per sharding key it owns; a worker sends its key's messages one after the other
(``<key>-<n>``, the body being the id), so the key's order is the order of its sends. Each
send is recorded when invoked and when it completes: ``ok`` with the ``(queue, offset)`` of the
acknowledgement, or ``timeout`` for any error (the client gave up; the message may be stored
or not). The reader (a :class:`~ferrymq.client.AsyncPullConsumer` assigned every queue, from
the start, no group) records each message read and each high watermark its fetches saw. The
drain reads every queue from its start with a new consumer until each reached the high
watermark its leader reports and nothing new came for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from ferrymq.client import AsyncProducer, AsyncPullConsumer, Message

from .history import History

__all__ = ["Workload"]

log = logging.getLogger(__name__)


class Workload:
    """Producers and a reader of ``topic`` (``queues`` queues) on the cluster at ``bootstrap``.

    Args:
        producers: how many producers.
        keys_per_producer: how many sharding keys (one worker each) per producer.
        delivery_timeout_s: a send's timeout (retries included): after it, ``timeout``.
        pace_s: a worker's pause between two sends (0: none).
    """

    def __init__(self, history: History, bootstrap: str, topic: str, queues: int, *,
                 producers: int = 2, keys_per_producer: int = 6,
                 delivery_timeout_s: float = 30.0, pace_s: float = 0.0) -> None:
        self.history = history
        self.bootstrap = bootstrap
        self.topic = topic
        self.queues = queues
        self.producers = producers
        self.keys_per_producer = keys_per_producer
        self.delivery_timeout_s = delivery_timeout_s
        self.pace_s = pace_s
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start the producers and the reader (tasks of the running loop)."""
        for p in range(self.producers):
            keys = [f"k{p}.{k}" for k in range(self.keys_per_producer)]
            self._tasks.append(asyncio.create_task(self._producer(keys)))
        self._tasks.append(asyncio.create_task(self._reader("reader")))

    async def stop(self) -> None:
        """Stop sending and reading (sends in flight complete or time out first)."""
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _producer(self, keys: list[str]) -> None:
        async with AsyncProducer(self.bootstrap, acks="all", idempotent=True, linger_ms=0,
                                 delivery_timeout_s=self.delivery_timeout_s,
                                 # longer than a pause: a producer still waits for the
                                 # paused leader's answer when it wakes up a zombie
                                 request_timeout_s=10, connect_timeout_s=3) as producer:
            await asyncio.gather(*(self._worker(producer, key) for key in keys))

    async def _worker(self, producer: AsyncProducer, key: str) -> None:
        n = 0
        while not self._stop.is_set():
            msg_id = f"{key}-{n}"
            n += 1
            send = self.history.invoke(msg_id, key)
            try:
                result = await producer.send(Message(self.topic, msg_id.encode(),
                                                     sharding_key=key))
            except Exception as exc:  # any failure: the fate is unknown
                self.history.failed(send, exc, timed_out=True)
                log.info("send %s: %s", msg_id, send.error)
            else:
                self.history.ok(send, result.queue, result.offset)
            if self.pace_s:
                await asyncio.sleep(self.pace_s)

    def _queues(self) -> list[tuple[str, int]]:
        return [(self.topic, q) for q in range(self.queues)]

    async def _reader(self, name: str) -> None:
        while not self._stop.is_set():
            try:
                async with AsyncPullConsumer(self.bootstrap, f"chaos-{name}", auto_commit=False,
                                             auto_offset_reset="earliest", request_timeout_s=5,
                                             connect_timeout_s=3) as consumer:
                    await consumer.assign(self._queues())
                    while not self._stop.is_set():
                        for m in await consumer.poll(timeout=0.5):
                            self.history.read(m.queue, m.offset, m.body.decode())
                        for (_t, q), hw in consumer.high_watermarks().items():
                            self.history.high_watermark(name, q, hw)
            except Exception as exc:  # a failover the consumer did not ride
                log.warning("reader %s: %r; starting again", name, exc)
                self.history.fault(f"reader restarted after {exc!r}")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 1)
                # a new consumer starts from the beginning: what it reads again is the same
                # (queue, offset) and must be the same message

    async def drain(self, quiet_s: float = 3.0, timeout_s: float = 120.0) -> None:
        """Read every queue from its start to its high watermark, recorded as ``final``.

        Raises:
            AssertionError: not done within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        async with AsyncPullConsumer(self.bootstrap, "chaos-drain", auto_commit=False,
                                     auto_offset_reset="earliest", request_timeout_s=5) as c:
            await c.assign(self._queues())
            last_new = time.monotonic()
            while True:
                got = await c.poll(timeout=0.5)
                for m in got:
                    self.history.read(m.queue, m.offset, m.body.decode(), final=True)
                    last_new = time.monotonic()
                for (_t, q), hw in c.high_watermarks().items():
                    self.history.high_watermark("drain", q, hw)
                hws, pos = c.high_watermarks(), c.position()
                if (len(hws) == self.queues and all(pos.get(tq, -1) >= hw
                                                    for tq, hw in hws.items())
                        and time.monotonic() - last_new > quiet_s):
                    return
                if time.monotonic() > deadline:
                    raise AssertionError(f"drain incomplete after {timeout_s} s: positions "
                                         f"{pos}, high watermarks {hws}")
