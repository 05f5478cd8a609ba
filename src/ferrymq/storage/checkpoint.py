"""Small checksummed state files written atomically (recovery point, offsets, counters).

Theory of operation: a checkpoint is a 16-byte header followed by an opaque payload::

    off  size  field
    0    4     magic     b"FMQC"
    4    2     version   u16, 1
    6    2     reserved  u16, 0
    8    4     length    u32 payload bytes
    12   4     crc       u32 CRC32C of the payload
    16         payload

The file is replaced with :func:`~ferrymq.storage.files.atomic_write`, so a reader sees the old
or the new checkpoint, never a mix. The CRC and the exact length still catch a torn or
bit-flipped file (disks lie); such a file is refused with :class:`CorruptRecordError` rather
than silently read as garbage. What to do then is the caller's decision: a cache (the recovery
point) falls back to a full scan, authoritative state must be refused loudly.
"""

from __future__ import annotations

import struct
from pathlib import Path

from ferrymq.errors import CorruptRecordError
from ferrymq.protocol.records import crc32c
from ferrymq.storage.files import atomic_write

__all__ = [
    "CHECKPOINT_MAGIC",
    "CHECKPOINT_VERSION",
    "MAX_CHECKPOINT_BYTES",
    "read_checkpoint",
    "write_checkpoint",
]

CHECKPOINT_MAGIC = b"FMQC"
CHECKPOINT_VERSION = 1
MAX_CHECKPOINT_BYTES = 64 << 20  # state files are small; refuse to load a corrupt giant length
_HEADER = struct.Struct("<4sHHII")


def write_checkpoint(path: Path, payload: bytes) -> None:
    """Atomically replace ``path`` with a checkpoint holding ``payload``.

    Raises:
        ValueError: the payload is larger than ``MAX_CHECKPOINT_BYTES``.
        OSError: the write failed (the previous checkpoint is untouched).
    """
    if len(payload) > MAX_CHECKPOINT_BYTES:
        raise ValueError(f"checkpoint payload of {len(payload)} bytes, max {MAX_CHECKPOINT_BYTES}")
    header = _HEADER.pack(CHECKPOINT_MAGIC, CHECKPOINT_VERSION, 0, len(payload), crc32c(payload))
    atomic_write(path, header + payload)


def read_checkpoint(path: Path) -> bytes | None:
    """Read the payload of the checkpoint at ``path``; None when the file does not exist.

    Raises:
        CorruptRecordError: bad magic, unknown version, wrong length or CRC mismatch.
        OSError: the file exists but cannot be read.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) < _HEADER.size:
        raise CorruptRecordError(f"checkpoint {path}: truncated header ({len(data)} bytes)")
    magic, version, _reserved, length, crc = _HEADER.unpack_from(data)
    if magic != CHECKPOINT_MAGIC:
        raise CorruptRecordError(f"checkpoint {path}: bad magic {magic!r}")
    if version != CHECKPOINT_VERSION:
        raise CorruptRecordError(f"checkpoint {path}: unknown version {version}")
    payload = data[_HEADER.size :]
    if len(payload) != length:
        raise CorruptRecordError(f"checkpoint {path}: payload is {len(payload)} bytes, header says {length}")
    if crc32c(payload) != crc:
        raise CorruptRecordError(f"checkpoint {path}: CRC mismatch")
    return payload
