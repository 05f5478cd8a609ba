"""Retry and dead letters: a message copied into ``%RETRY%<group>`` or ``%DLQ%<group>``.

A letter is the original record (body, tag, keys, sharding key, born time and properties kept)
with reserved properties, all starting with ``%``, that say where it came from and how it has
fared. Clients hide the ``%`` properties and show the original topic, queue, offset and id.

=============  ====================================================================
``%TOPIC``     original topic
``%QUEUE``     original queue
``%OFFSET``    original offset
``%MSGID``     original message id
``%RECONSUME`` deliveries that failed before this one (``reconsume_times``)
``%DUE``       wall-clock ms when the letter becomes deliverable (retry letters)
``%REASON``    why the last delivery failed
``%DEAD``      wall-clock ms when the message was dead-lettered (DLQ letters)
=============  ====================================================================
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ferrymq.broker.delivery.state import Letter
from ferrymq.errors import CorruptRecordError
from ferrymq.protocol.records import (
    RawRecord,
    RecordInput,
    decode_properties,
    encode_batch,
    encode_properties,
    iter_batches,
    iter_raw_records,
)

RESERVED_PREFIX = "%"
MAX_REASON_CHARS = 1024


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


def _stored(buf: memoryview, rec: RawRecord) -> StoredRecord:
    off, ts, t0, t1, s1, k1, p1, rend = rec
    try:
        props = decode_properties(bytes(buf[k1:p1])) if p1 > k1 else {}
    except CorruptRecordError:
        props = {}
    return StoredRecord(off, ts, bytes(buf[t0:t1]), bytes(buf[t1:s1]), bytes(buf[s1:k1]), props,
                        bytes(buf[p1:rend]))


def iter_stored(data: bytes, start: int = 0) -> Iterator[StoredRecord]:
    """The records of ``data`` (whole batches) at or after offset ``start``; a batch whose
    records do not add up ends the iteration (its CRC-valid prefix was read)."""
    mv = memoryview(data)
    for pos, h in iter_batches(mv):
        try:
            for rec in iter_raw_records(mv, pos, h):
                if rec[0] >= start:
                    yield _stored(mv, rec)
        except CorruptRecordError:
            return


def make_letter(
    record: StoredRecord, origin: Letter, *, reconsume: int, due_wall: int, reason: str,
    dead_wall: int | None = None,
) -> bytearray:
    """A one-record batch holding ``record`` with the letter properties of ``origin``."""
    props = {k: v for k, v in record.properties.items() if not k.startswith(RESERVED_PREFIX)}
    props.update({
        "%TOPIC": origin.topic,
        "%QUEUE": str(origin.queue),
        "%OFFSET": str(origin.offset),
        "%MSGID": origin.msg_id,
        "%RECONSUME": str(reconsume),
        "%DUE": str(due_wall),
        "%REASON": reason[:MAX_REASON_CHARS],
    })
    if dead_wall is not None:
        props["%DEAD"] = str(dead_wall)
    return encode_batch([
        RecordInput(
            body=record.body,
            timestamp=record.timestamp,
            tag=record.tag,
            sharding_key=record.sharding_key,
            keys=record.keys,
            properties=encode_properties(props),
        )
    ])


def read_letter(record: StoredRecord) -> Letter:
    """The letter properties of a record of a retry or dead-letter queue.

    Raises:
        CorruptRecordError: the record is not a letter.
    """
    p = record.properties
    try:
        return Letter(
            topic=p["%TOPIC"],
            queue=int(p["%QUEUE"]),
            offset=int(p["%OFFSET"]),
            msg_id=p["%MSGID"],
            reconsume=int(p["%RECONSUME"]),
            due_wall=int(p.get("%DUE", "0")),
            reason=p.get("%REASON", ""),
        )
    except (KeyError, ValueError) as exc:
        raise CorruptRecordError(
            f"record at offset {record.offset} is not a letter ({exc})") from None
