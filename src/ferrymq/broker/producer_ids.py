"""Producer ids for idempotent producers: unique per broker, never reused, even after a crash.

Ids are handed out from blocks: before the first id of a block is used, the end of the block is
written to a checkpoint, so after a crash the broker continues past every id it may have handed
out (Kafka's ProducerIdManager). Non-transactional producers always get epoch 0; a transactional
id keeps its producer id and bumps the epoch on every init (issue 5 builds on it).
"""

from __future__ import annotations

from pathlib import Path

import msgpack

from ferrymq.storage import read_checkpoint, write_checkpoint

ID_BLOCK_SIZE = 1000
"""Ids reserved per checkpoint write."""


class ProducerIdManager:
    """Allocates producer ids from durable blocks."""

    def __init__(self, data_dir: Path) -> None:
        self._path = data_dir / "meta" / "producer_ids"
        self._next = 0
        self._block_end = 0

    def load(self) -> None:
        """Continue after the last reserved block."""
        raw = read_checkpoint(self._path)
        if raw is not None:
            self._next = self._block_end = msgpack.unpackb(raw)["block_end"]

    def allocate(self) -> int:
        """A fresh producer id."""
        if self._next >= self._block_end:
            self._block_end = self._next + ID_BLOCK_SIZE
            write_checkpoint(self._path, msgpack.packb({"block_end": self._block_end}))
        pid = self._next
        self._next += 1
        return pid
