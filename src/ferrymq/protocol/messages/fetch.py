"""Reading: FETCH (long polls, read_committed) and LIST_OFFSETS (where to start)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgpack

from ferrymq.protocol.messages.schema import (
    BYTES,
    INT,
    STR,
    ApiKey,
    Body,
    Request,
    lst,
    rows_with_data,
    tup,
)


class Isolation(enum.IntEnum):
    """What a fetch returns of transactional data."""

    LEGACY = -1
    READ_UNCOMMITTED = 0
    READ_COMMITTED = 1


class OffsetSpec(enum.IntEnum):
    """Special values of LIST_OFFSETS ``spec`` (a value >= 0 is a timestamp in ms)."""

    LATEST = -1
    EARLIEST = -2


FetchResult = tuple[str, int, int, str, int, int, int, bytes | memoryview]
"""(topic, queue, error code, error message, high watermark, log start offset, topic id,
record batches)."""


FetchTxnInfo = tuple[str, int, int, list[tuple[int, int]]]
"""(topic, queue, last stable offset, aborted transactions in the answered range as
(producer id, first offset)): read_committed answers only, for queues that have any."""


@dataclass(frozen=True, slots=True)
class FetchResponse(Body):
    """Record batches per fetched queue; for a read_committed fetch, ``txn`` lists the aborted
    transactions a reader must skip (see :class:`ferrymq.protocol.markers.ReadCommittedFilter`)
    and each queue's last stable offset."""

    results: list[FetchResult]
    txn: list[FetchTxnInfo] = field(default_factory=list)
    SCHEMA = (lst(tup(STR, INT, INT, STR, INT, INT, INT, BYTES)),
              lst(tup(STR, INT, INT, lst(tup(INT, INT)))))

    def encode_parts(self) -> list[bytes | bytearray | memoryview]:
        """Headers and record data as separate buffers (no copy of the data)."""
        parts = rows_with_data(b"\x92", self.results)
        parts.append(msgpack.packb(self.txn))
        return parts


FetchEntry = tuple[str, int, int, int, str]
"""(topic, queue, offset, max bytes for this queue, tag expression)."""


@dataclass(frozen=True, slots=True)
class FetchRequest(Request):
    """Read from queues; wait up to ``max_wait_ms`` for ``min_bytes`` (long polling).

    ``isolation``: :class:`Isolation`. ``LEGACY`` (what a client that does not send the field
    gets) reads like READ_UNCOMMITTED with transaction control batches left out by the broker.
    """

    max_wait_ms: int
    min_bytes: int
    max_bytes: int
    entries: list[FetchEntry]
    isolation: int = -1
    API_KEY = ApiKey.FETCH
    RESPONSE = FetchResponse
    SCHEMA = (INT, INT, INT, lst(tup(STR, INT, INT, INT, STR)), INT)


OffsetResult = tuple[str, int, int, int]
"""(topic, queue, error code, offset)."""


@dataclass(frozen=True, slots=True)
class ListOffsetsResponse(Body):
    """Offsets found, per entry."""

    results: list[OffsetResult]
    SCHEMA = (lst(tup(STR, INT, INT, INT)),)


@dataclass(frozen=True, slots=True)
class ListOffsetsRequest(Request):
    """Find offsets: ``spec`` is LATEST (-1), EARLIEST (-2) or a timestamp in ms. With
    ``isolation`` READ_COMMITTED, LATEST and timestamp answers are capped at the last stable
    offset (the first offset of the oldest open transaction)."""

    entries: list[tuple[str, int, int]]
    isolation: int = 0
    API_KEY = ApiKey.LIST_OFFSETS
    RESPONSE = ListOffsetsResponse
    SCHEMA = (lst(tup(STR, INT, INT)), INT)
