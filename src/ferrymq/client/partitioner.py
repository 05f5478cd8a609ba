"""Queue selection: round robin, sticky by sharding key, or a user's selector."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from crc32c import crc32c

if TYPE_CHECKING:
    from ferrymq.client.message import Message

QueueSelector = Callable[["Message", int], int]
"""``selector(message, queue_count) -> queue``."""


def queue_for_key(key: str, queues: int) -> int:
    """Stable queue of a sharding key: CRC32C of its UTF-8 bytes, modulo the queue count.

    Stable across processes and Python versions (unlike ``hash()``).
    """
    return int(crc32c(key.encode())) % queues


class RoundRobin:
    """Per-topic round robin over the queues."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def __call__(self, topic: str, queues: int) -> int:
        n = self._next.get(topic, 0)
        self._next[topic] = n + 1
        return n % queues
