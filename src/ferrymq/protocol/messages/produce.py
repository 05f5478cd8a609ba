"""Writing: INIT_PRODUCER and PRODUCE (record batches sent as buffers, read as views)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgpack

from ferrymq.protocol.messages.schema import (
    BYTES,
    INT,
    MAX_LIST_ITEMS,
    STR,
    ApiKey,
    Body,
    Reader,
    Request,
    Unexpected,
    array_header,
    bin_header,
    decode_generic,
    lst,
    opt,
    tup,
)
from ferrymq.protocol.records import BatchBuffers


class Durability(enum.IntEnum):
    """How far a stored batch got when the broker acknowledged it."""

    NONE = 0  # not acknowledged (oneway)
    WRITTEN = 1  # write(2) done: survives a broker crash, not a power loss
    FSYNCED = 2  # fsync done: survives a power loss
    REPLICATED = 3  # every in-sync replica has it (acks=all; fsynced on each in sync mode) and
    #                 the ISR had at least min_insync members: survives the loss of a broker


@dataclass(frozen=True, slots=True)
class InitProducerResponse(Body):
    """The producer id and epoch to stamp on batches."""

    producer_id: int
    producer_epoch: int
    SCHEMA = (INT, INT)


@dataclass(frozen=True, slots=True)
class InitProducerRequest(Request):
    """Get a producer id (and epoch) for idempotent sends."""

    transactional_id: str | None
    API_KEY = ApiKey.INIT_PRODUCER
    RESPONSE = InitProducerResponse
    SCHEMA = (opt(STR),)


Duplicate = tuple[int, int, int]
"""A record of a dedup batch that was not stored: (its index in the batch as sent, the queue and
the offset of the message stored earlier with the same dedup key)."""

ProduceResult = tuple[str, int, int, str, int, int, int, int, int, list[Duplicate]]
"""(topic, queue, error code, error message, base offset, last offset, append time ms,
durability, topic id, duplicates).

``duplicates`` is empty except for dedup batches: the records listed there were not stored; the
others were, in order, at ``base_offset..last_offset``. When every record was a duplicate,
``base_offset``, ``last_offset`` and ``append_time_ms`` are -1."""


@dataclass(frozen=True, slots=True)
class ProduceResponse(Body):
    """One result per produce entry, in request order."""

    results: list[ProduceResult]
    SCHEMA = (lst(tup(STR, INT, INT, STR, INT, INT, INT, INT, INT, lst(tup(INT, INT, INT)))),)


ProduceEntry = tuple[str, int, bytes | bytearray | memoryview | BatchBuffers]
"""(topic, queue, record batch). A producer may pass a
:class:`~ferrymq.protocol.records.BatchBuffers` as the batch (``encode_parts`` sends its
buffers); a decoded request always holds a memoryview."""


class Acks(enum.IntEnum):
    """When a produce is answered (Kafka's ``acks``): ``ALL`` when every in-sync replica has
    the batch (fsynced in sync mode) and the ISR has at least ``min_insync`` members; ``LEADER``
    after the leader's own write (and fsync in sync mode), losable on a failover. On a single
    broker the two are the same."""

    ALL = -1
    LEADER = 1


@dataclass(frozen=True, slots=True)
class ProduceRequest(Request):
    """Append record batches (one per entry) to queues; ``acks``: :class:`Acks` (a client that
    does not send it gets ``ALL``)."""

    timeout_ms: int
    entries: list[ProduceEntry]
    acks: int = -1
    API_KEY = ApiKey.PRODUCE
    RESPONSE = ProduceResponse
    SCHEMA = (INT, lst(tup(STR, INT, BYTES)), INT)

    def encode_parts(self) -> list[bytes | bytearray | memoryview]:
        """Headers and batches as separate buffers (no copy of the batches; a batch given as
        :class:`~ferrymq.protocol.records.BatchBuffers` goes as its buffers)."""
        parts: list[bytes | bytearray | memoryview] = [
            b"\x93" + msgpack.packb(self.timeout_ms) + array_header(len(self.entries))
        ]
        for topic, queue, batch in self.entries:
            parts.append(b"\x93" + msgpack.packb(topic) + msgpack.packb(queue)
                         + bin_header(len(batch)))
            if isinstance(batch, BatchBuffers):
                parts.append(batch.header)
                parts.extend(batch.parts)
            else:
                parts.append(batch)
        parts.append(msgpack.packb(self.acks))
        return parts

    @classmethod
    def decode(cls, data: bytes | memoryview) -> ProduceRequest:
        """Decode with batches as views into ``data`` (no copy); unusual encodings take the
        generic, fully checked path."""
        r = Reader(memoryview(data))
        try:
            fields = r.array()
            if fields not in (2, 3):
                raise Unexpected
            timeout = r.int_()
            n = r.array()
            if n > MAX_LIST_ITEMS:
                raise Unexpected
            entries: list[ProduceEntry] = []
            for _ in range(n):
                if r.array() != 3:
                    raise Unexpected
                entries.append((r.str_(), r.int_(), r.bin_()))
            acks = r.int_() if fields == 3 else Acks.ALL
            if r.pos != len(r.buf):
                raise Unexpected
        except Unexpected:
            return decode_generic(cls, data)
        return cls(timeout, entries, acks)
