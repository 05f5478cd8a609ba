"""Queue selection: sticky round robin, a stable hash of the sharding key, or a user's selector."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from crc32c import crc32c

if TYPE_CHECKING:
    from ferrymq.client.message import Message

QueueSelector = Callable[["Message", int], int]
"""``selector(message, queue_count) -> queue``."""

DEFAULT_STICKY_QUEUE_BYTES = 16 * 1024
"""Body bytes of keyless messages a producer sends to one queue before it moves to the next
(Kafka's ``batch.size``, which its uniform sticky partitioner uses the same way)."""


def queue_for_key(key: str, queues: int) -> int:
    """Stable queue of a sharding key: CRC32C of its UTF-8 bytes, modulo the queue count.

    Stable across processes and Python versions (unlike ``hash()``).
    """
    return int(crc32c(key.encode())) % queues


class RoundRobin:
    """Per-topic round robin over the queues, sticky for ``sticky_bytes`` of bodies.

    Each topic starts at a random queue (so that many short-lived producers spread out) and
    moves to the next queue once ``sticky_bytes`` of message bodies went to the current one:
    Kafka's uniform sticky partitioner (KIP-480, KIP-794). Over time every queue gets the same
    share, while a slow producer's consecutive messages share a queue, hence a record batch and
    a flush: with ``flush sync`` one fsync covers them instead of one per queue. With
    ``sticky_bytes`` 0 every call moves on (plain round robin, RocketMQ's choice).
    """

    __slots__ = ("_next", "_rng", "_sticky_bytes")

    def __init__(self, sticky_bytes: int = 0, *, rng: random.Random | None = None) -> None:
        if sticky_bytes < 0:
            raise ValueError("sticky_bytes must be >= 0")
        self._sticky_bytes = sticky_bytes
        self._rng = rng
        self._next: dict[str, list[int]] = {}  # topic -> [queue counter, bytes sent to it]

    def pick(self, topic: str, queues: int) -> int:
        """The queue for the next keyless message (or call) of ``topic``."""
        state = self._next.get(topic)
        if state is None:
            start = (self._rng or random).randrange(queues) if queues > 1 else 0
            state = self._next[topic] = [start, 0]
        return state[0] % queues

    def sent(self, topic: str, nbytes: int) -> None:
        """Count ``nbytes`` sent to the picked queue; move on once it has its share."""
        state = self._next[topic]
        state[1] += nbytes
        if state[1] >= self._sticky_bytes:
            state[0] += 1
            state[1] = 0

    def __call__(self, topic: str, queues: int, nbytes: int = 0) -> int:
        """Pick a queue for one message of ``nbytes`` and count it."""
        q = self.pick(topic, queues)
        self.sent(topic, nbytes)
        return q
