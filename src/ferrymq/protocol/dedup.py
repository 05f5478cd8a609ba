"""Dedup keys (NATS ``Nats-Msg-Id``): the reserved property that carries one, its limits, and how
the broker reads the keys of a batch. Sans-IO.

A producer gives a message a dedup key (``Message(dedup_key="order-42")``). It travels in the
record's properties as ``%DEDUP`` and stays there: consumers see it as
``ReceivedMessage.dedup_key`` (and in ``properties``). When the topic has a dedup window
(``dedup_window_ms`` > 0), the producer sends such messages in batches of their own with
attribute bit 2 (:data:`~ferrymq.protocol.records.ATTR_DEDUP`) set, where *every* record carries
a key; the broker reads keys only of those batches, so plain batches cost nothing more. A record
whose key the topic stored within the window is acknowledged as a duplicate of the stored
message and not stored again. Semantics, limits and storage: docs/dedup.md.
"""

from __future__ import annotations

import msgpack

from ferrymq.errors import InvalidRequestError
from ferrymq.protocol.letters import RESERVED_PREFIX
from ferrymq.protocol.records import (
    ATTR_DEDUP,
    HEADER_SIZE,
    LENGTH_PREFIX,
    RECORD_PREFIX,
    RECORD_PREFIX_SIZE,
    BatchHeader,
    RawRecord,
)

DEDUP_KEY = "%DEDUP"
assert DEDUP_KEY.startswith(RESERVED_PREFIX)

MAX_DEDUP_KEY_BYTES = 255
"""Longest dedup key, in UTF-8 bytes. The broker holds every key of a window in memory, so the
key length bounds that memory per key; a UUID (36) or an order id fits with room to spare."""

MAX_DEDUP_WINDOW_MS = 24 * 3600 * 1000
"""Longest dedup window (one day). A restarted broker rebuilds the window by reading what each
dedup topic stored within it, so the window bounds the start-up cost; NATS' default is 2 min."""

_ALWAYS_FITS = MAX_DEDUP_KEY_BYTES // 4  # a str this short is at most 4 bytes per character


def check_dedup_key(key: object) -> str:
    """``key`` if it is a valid dedup key (the client's check, before anything is sent).

    Raises:
        TypeError: not a str.
        ValueError: empty, or longer than :data:`MAX_DEDUP_KEY_BYTES` in UTF-8.
    """
    if not isinstance(key, str):
        raise TypeError(f"dedup_key must be str, not {type(key).__name__}")
    n = len(key.encode())
    if n == 0:
        raise ValueError("dedup_key must not be empty")
    if n > MAX_DEDUP_KEY_BYTES:
        raise ValueError(f"dedup_key is {n} bytes in UTF-8, max {MAX_DEDUP_KEY_BYTES} "
                         "(MAX_DEDUP_KEY_BYTES)")
    return key


def read_dedup_keys(
    buf: bytes | bytearray | memoryview, pos: int, h: BatchHeader
) -> list[tuple[RawRecord, str]]:
    """Every record of the dedup batch at ``pos`` with its key, in order.

    One pass over the records that decodes only their properties (the broker's only
    per-record work for dedup batches; the rest of a record is checked by its readers).

    Raises:
        InvalidRequestError: not a dedup batch, a record without ``%DEDUP``, a key that is
            empty or longer than :data:`MAX_DEDUP_KEY_BYTES`, or malformed records. Nothing of
            the batch may be stored then.
    """
    if not h.attributes & ATTR_DEDUP:
        raise InvalidRequestError("not a dedup batch")
    out: list[tuple[RawRecord, str]] = []
    append = out.append
    mv = memoryview(buf)
    unpack = RECORD_PREFIX.unpack_from
    base, first_ts = h.base_offset, h.first_timestamp
    p = pos + HEADER_SIZE
    end = pos + LENGTH_PREFIX + h.batch_length
    for i in range(h.record_count):
        if end - p < RECORD_PREFIX_SIZE:
            raise InvalidRequestError(f"malformed dedup batch: record {i} runs past the batch")
        length, odelta, tdelta, _attrs, tl, skl, kl, pl = unpack(mv, p)
        t0 = p + RECORD_PREFIX_SIZE
        k1 = t0 + tl + skl + kl
        p1 = k1 + pl
        rend = p + 4 + length
        if p1 > rend or rend > end:
            raise InvalidRequestError(f"malformed dedup batch: record {i} fields run past it")
        key = None
        if pl:
            try:
                props = msgpack.unpackb(mv[k1:p1], raw=False, strict_map_key=True)
            except Exception:  # noqa: BLE001 - msgpack raises several unrelated types
                raise InvalidRequestError(
                    f"malformed dedup batch: record {i} has unreadable properties") from None
            if type(props) is dict:
                key = props.get(DEDUP_KEY)
        if type(key) is not str:
            raise InvalidRequestError(f"record {i} of a dedup batch has no {DEDUP_KEY} property")
        if not key or (len(key) > _ALWAYS_FITS and len(key.encode()) > MAX_DEDUP_KEY_BYTES):
            n = len(key.encode())
            raise InvalidRequestError(
                f"dedup key of {n} bytes: must be 1..{MAX_DEDUP_KEY_BYTES} bytes of UTF-8")
        append(((base + odelta, first_ts + tdelta, t0, t0 + tl, t0 + tl + skl, k1, p1, rend),
                key))
        p = rend
    if p != end:
        raise InvalidRequestError("malformed dedup batch: records do not fill the batch")
    return out
