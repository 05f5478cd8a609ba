"""Reading and writing letters (see :mod:`ferrymq.protocol.letters` for what they are):
records are read with their text fields raw, so a producer's odd bytes cannot stop a move.

A retry letter with a delay is written as a *scheduled* batch (``ATTR_SCHEDULED``, its due time
in ``%DELIVER_AT``): the broker's scheduler appends a visible copy to the retry queue when it is
due (see ``docs/scheduled.md``, "For the broker's own writers").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ferrymq.errors import CorruptRecordError
from ferrymq.protocol.letters import Letter, letter_properties, parse_letter
from ferrymq.protocol.records import (
    ATTR_SCHEDULED,
    RawRecord,
    RecordInput,
    decode_properties,
    encode_batch,
    encode_properties,
    iter_batches,
    iter_raw_records,
)
from ferrymq.protocol.schedule import DELIVER_AT


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """One record as stored: its raw fields (text is never decoded, so a producer's odd bytes
    cannot stop a move) and its properties (empty when they do not decode)."""

    offset: int
    timestamp: int
    tag: bytes
    sharding_key: bytes
    keys: bytes
    properties: dict[str, str]
    body: bytes


def stored_record(buf: memoryview, rec: RawRecord) -> StoredRecord:
    """The record at ``rec`` (from :func:`~ferrymq.protocol.records.iter_raw_records`)."""
    off, ts, t0, t1, s1, k1, p1, rend = rec
    try:
        props = decode_properties(bytes(buf[k1:p1])) if p1 > k1 else {}
    except CorruptRecordError:
        props = {}
    return StoredRecord(off, ts, bytes(buf[t0:t1]), bytes(buf[t1:s1]), bytes(buf[s1:k1]), props,
                        bytes(buf[p1:rend]))


def iter_stored(data: bytes, start: int = 0) -> Iterator[StoredRecord]:
    """The records of ``data`` (whole batches) at or after offset ``start``; a batch whose
    records do not add up ends the iteration (its CRC-valid prefix was read). Scheduled
    originals (``ATTR_SCHEDULED``) are skipped: the scheduler appends their copies when due."""
    mv = memoryview(data)
    for pos, h in iter_batches(mv):
        if h.attributes & ATTR_SCHEDULED:
            continue
        try:
            for rec in iter_raw_records(mv, pos, h):
                if rec[0] >= start:
                    yield stored_record(mv, rec)
        except CorruptRecordError:
            return


def make_letter(record: StoredRecord, letter: Letter, *, deliver_at: int | None = None) -> bytearray:
    """A one-record batch holding ``record`` with the properties of ``letter``; with
    ``deliver_at`` (wall ms) a scheduled batch, due then (the scheduler makes it visible)."""
    props = letter_properties(record.properties, letter)
    if deliver_at is not None:
        props[DELIVER_AT] = str(max(deliver_at, 0))
    return encode_batch([
        RecordInput(
            body=record.body,
            timestamp=record.timestamp,
            tag=record.tag,
            sharding_key=record.sharding_key,
            keys=record.keys,
            properties=encode_properties(props),
        )
    ], attributes=ATTR_SCHEDULED if deliver_at is not None else 0)


def read_letter(record: StoredRecord) -> Letter:
    """The letter properties of a record of a retry or dead-letter queue.

    Raises:
        CorruptRecordError: the record is not a letter.
    """
    try:
        return parse_letter(record.properties)
    except CorruptRecordError as exc:
        raise CorruptRecordError(f"record at offset {record.offset}: {exc}") from None
