"""Kafka's Fetch response, versions 4 to 12, by hand, in pieces. Sans-IO.

The Fetch request is small and goes through ``kio``; the response carries the records, up to
``max_bytes`` of them. kio's writer copies them into its buffer, and the frame around it
copies them again: megabytes per response, each copy a fresh allocation. Here the response is
a list of pieces, the records left as the views of the log read they are (an envelope's Kafka
batch is a slice of what was read; :func:`ferrymq.protocol.kafka.envelope.kafka_pieces`), to
be written with one ``writelines``. ``tests/unit/protocol/test_kafka_fetch_codec.py`` checks
the bytes against kio's for every version::

    FetchResponse
      throttle_time_ms   int32
      error_code         int16 (v7+)
      session_id         int32 (v7+)
      responses          [topic string, partitions [
                            partition_index int32, error_code int16, high_watermark int64,
                            last_stable_offset int64, log_start_offset int64 (v5+),
                            aborted_transactions nullable [producer_id int64,
                                                           first_offset int64],
                            preferred_read_replica int32 (v11+),
                            records nullable bytes]]

v12 is flexible: compact strings, arrays and bytes, and tagged fields after each struct (none
are sent: a partition's diverging epoch, current leader and snapshot id keep their defaults).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

MIN_VERSION = 4
MAX_VERSION = 12
FLEXIBLE_FROM = 12

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_TOP_V7 = struct.Struct(">ihi")  # throttle, error code, session id
_PARTITION_V4 = struct.Struct(">ihqq")  # index, error code, high watermark, last stable offset
_PARTITION_V5 = struct.Struct(">ihqqq")  # ... and log start offset
_ABORTED = struct.Struct(">qq")
_NO_TAGS = b"\x00"

Piece = bytes | bytearray | memoryview


class PartitionFetch(NamedTuple):
    """One partition's answer: ``aborted`` the aborted transactions ``(producer id, first
    offset)`` (None: not asked, read_uncommitted), ``records`` the record set in pieces (empty:
    no records; Kafka clients get an empty set, never null)."""

    partition: int
    error_code: int
    high_watermark: int
    last_stable_offset: int
    log_start_offset: int
    aborted: list[tuple[int, int]] | None
    records: Sequence[Piece]


def _put_uvarint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _put_length(out: bytearray, n: int, flex: bool, *, short: bool = False) -> None:
    """A length (-1: null): compact in flexible versions, else int16 (``short``) or int32."""
    if flex:
        _put_uvarint(out, n + 1)
    else:
        out += _I16.pack(n) if short else _I32.pack(n)


def encode_response(version: int, topics: list[tuple[str, list[PartitionFetch]]], *,
                    throttle_ms: int = 0, error_code: int = 0,
                    session_id: int = 0) -> list[Piece]:
    """The body of a Fetch response of ``version`` (4..12), in pieces whose concatenation is
    the body: the records are not copied."""
    flex = version >= FLEXIBLE_FROM
    pieces: list[Piece] = []
    out = bytearray()
    if version >= 7:
        out += _TOP_V7.pack(throttle_ms, error_code, session_id)
    else:
        out += _I32.pack(throttle_ms)
    _put_length(out, len(topics), flex)
    part_fields = _PARTITION_V5 if version >= 5 else _PARTITION_V4
    for name, parts in topics:
        raw = name.encode()
        _put_length(out, len(raw), flex, short=True)
        out += raw
        _put_length(out, len(parts), flex)
        for p in parts:
            if version >= 5:
                out += part_fields.pack(p.partition, p.error_code, p.high_watermark,
                                        p.last_stable_offset, p.log_start_offset)
            else:
                out += part_fields.pack(p.partition, p.error_code, p.high_watermark,
                                        p.last_stable_offset)
            if p.aborted is None:
                _put_length(out, -1, flex)
            else:
                _put_length(out, len(p.aborted), flex)
                for producer_id, first in p.aborted:
                    out += _ABORTED.pack(producer_id, first)
                    if flex:
                        out += _NO_TAGS
            if version >= 11:
                out += _I32.pack(-1)  # preferred_read_replica: none (no follower fetching)
            _put_length(out, sum(len(r) for r in p.records), flex)
            if p.records:
                pieces.append(out)
                pieces += p.records
                out = bytearray()
            if flex:
                out += _NO_TAGS
        if flex:
            out += _NO_TAGS
    if flex:
        out += _NO_TAGS
    pieces.append(out)
    return pieces
