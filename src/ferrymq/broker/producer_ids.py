"""Producer ids for idempotent producers: unique per broker, never reused, even after a crash.

Ids are handed out from blocks: before the first id of a block is used, the end of the block is
written to a checkpoint, so after a crash the broker continues past every id it may have handed
out (Kafka's ProducerIdManager). Non-transactional producers always get epoch 0; a transactional
id keeps its producer id and bumps the epoch on every init (issue 5 builds on it).

In a cluster, ids must be unique across brokers (a producer keeps its id when it follows a
queue's leader to another broker): the blocks come from the metadata store instead
(:meth:`ProducerIdManager.use_cluster_blocks`), taken by compare-and-swap, one ahead.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgpack

from ferrymq.errors import BusyError
from ferrymq.storage import read_checkpoint, write_checkpoint

ID_BLOCK_SIZE = 1000
"""Ids reserved per checkpoint write."""


class ProducerIdManager:
    """Allocates producer ids from durable blocks."""

    def __init__(self, data_dir: Path) -> None:
        self._path = data_dir / "meta" / "producer_ids"
        self._next = 0
        self._block_end = 0
        self._spare: tuple[int, int] | None = None
        self._refill: Callable[[], None] | None = None

    def load(self) -> None:
        """Continue after the last reserved block."""
        raw = read_checkpoint(self._path)
        if raw is not None:
            self._next = self._block_end = msgpack.unpackb(raw)["block_end"]

    def use_cluster_blocks(self, first: tuple[int, int], refill: Callable[[], None]) -> None:
        """Take ids from the cluster's blocks from now on: ``first`` is a block [start, end)
        reserved in the metadata store; ``refill`` is called (once per block used up) to reserve
        the next one in the background and hand it over with :meth:`add_block`."""
        self._next, self._block_end = first
        self._refill = refill
        refill()

    def add_block(self, block: tuple[int, int]) -> None:
        """A block reserved in the cluster's metadata store, used after the current one."""
        if self._next >= self._block_end:
            self._next, self._block_end = block
        else:
            self._spare = block

    def allocate(self) -> int:
        """A fresh producer id.

        Raises:
            BusyError: in a cluster, the next block is not reserved yet (retriable).
        """
        if self._refill is not None:
            if self._next >= self._block_end:
                if self._spare is None:
                    raise BusyError("producer ids: the next block is being reserved in the "
                                    "metadata store", retry_after_ms=100)
                self._next, self._block_end = self._spare
                self._spare = None
                self._refill()
            pid = self._next
            self._next += 1
            return pid
        if self._next >= self._block_end:
            self._block_end = self._next + ID_BLOCK_SIZE
            write_checkpoint(self._path, msgpack.packb({"block_end": self._block_end}))
        pid = self._next
        self._next += 1
        return pid
