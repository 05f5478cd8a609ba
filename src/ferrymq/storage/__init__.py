"""FerryMQ storage: the segmented, CRC-checked, crash-recoverable log of one queue.

The broker uses :class:`Log` (one per queue) and the checkpoint helpers for its own small
state files. See ``docs/storage.md`` for the on-disk format.
"""

from ferrymq.storage.checkpoint import read_checkpoint, write_checkpoint
from ferrymq.storage.epochs import LeaderEpochCache
from ferrymq.storage.files import atomic_write
from ferrymq.storage.log import AppendResult, Log, LogConfig, SegmentInfo
from ferrymq.storage.recovery import RecoveryReport

__all__ = [
    "AppendResult",
    "LeaderEpochCache",
    "Log",
    "LogConfig",
    "RecoveryReport",
    "SegmentInfo",
    "atomic_write",
    "read_checkpoint",
    "write_checkpoint",
]
