"""Helpers shared by the storage unit tests (a plain module: conftest is not importable)."""

from __future__ import annotations

from collections.abc import Callable

from ferrymq.protocol.records import RecordInput, encode_batch
from ferrymq.storage import Log, RecoveryReport

BatchFactory = Callable[..., bytearray]
LogOpener = Callable[..., tuple[Log, RecoveryReport]]


def build_batch(
    count: int = 1,
    body: bytes = b"m",
    *,
    ts: int = 0,
    pid: int = -1,
    epoch: int = -1,
    seq: int = -1,
) -> bytearray:
    """A batch of ``count`` records with distinct bodies (``body`` + index)."""
    records = [RecordInput(body + str(i).encode(), ts) for i in range(count)]
    return encode_batch(records, producer_id=pid, producer_epoch=epoch, base_sequence=seq)
