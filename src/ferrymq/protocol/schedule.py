"""Scheduled (delayed) messages: the reserved properties that carry a due time, RocketMQ's delay
levels, and how the broker turns them into a due time. Sans-IO.

A scheduled message travels like any message, in a record batch whose attribute bit 7
(:data:`~ferrymq.protocol.records.ATTR_SCHEDULED`) is set; the producer never mixes scheduled and
plain messages in one batch. Every record of such a batch carries exactly one of:

==================  ===========================================================================
``%DELAY``          a delay in ms (decimal). Due time = the batch's ``append_time_ms`` (stamped by
                    the broker) + delay, so the producer's clock does not matter.
``%DELIVER_AT``     an absolute due time, wall-clock ms since the epoch (decimal).
==================  ===========================================================================

Consumers never see such a record. When it is due the broker appends a *copy* to the same queue
(a normal batch: same body, tag, keys, sharding key and born time; ``%DELAY``/``%DELIVER_AT``
dropped) with two more reserved properties:

==================  ===========================================================================
``%SCHEDULED_ID``   the message id of the original (what ``send()`` returned and ``cancel()``
                    takes)
``%SCHEDULED_DUE``  its due time (wall ms): receive time minus this is the lateness
==================  ===========================================================================

A cancel is stored in the queue too, so that every replica of a cluster's queue learns it: a
*cancel record*, a record of a scheduled batch (readers skip it) that carries no due time but

==================  ===========================================================================
``%SCHEDULED_CANCEL``  the message id of the original cancelled; written only by the broker (a
                    producer's batch carrying it is refused)
==================  ===========================================================================

A replica reads both kinds of *marks* back from its log (:func:`read_marks`): a copy says its
original fired, a cancel record that it was cancelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from ferrymq.errors import CorruptRecordError, InvalidRequestError
from ferrymq.protocol.letters import RESERVED_PREFIX
from ferrymq.protocol.records import (
    ATTR_SCHEDULED,
    LENGTH_PREFIX,
    BatchHeader,
    decode_properties,
    iter_raw_records,
)

DELAY = "%DELAY"
DELIVER_AT = "%DELIVER_AT"
SCHEDULED_ID = "%SCHEDULED_ID"
SCHEDULED_DUE = "%SCHEDULED_DUE"
SCHEDULED_CANCEL = "%SCHEDULED_CANCEL"

assert all(p.startswith(RESERVED_PREFIX)
           for p in (DELAY, DELIVER_AT, SCHEDULED_ID, SCHEDULED_DUE, SCHEDULED_CANCEL))

MARK_NEEDLE = b"%SCHEDULED_"
"""Bytes every batch holding a mark contains (in a property name): a batch without them is
skipped without decoding its records (:func:`read_marks`)."""
FIRED_MARK = 1
"""A mark of :func:`read_marks`: a copy, its original fired."""
CANCELLED_MARK = 2
"""A mark of :func:`read_marks`: a cancel record, its original was cancelled."""

DELAY_LEVELS_MS: tuple[int, ...] = tuple(
    s * 1000 for s in (1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800,
                       3600, 7200)
)
"""RocketMQ's 18 delay levels (``delay_level=1..18``): 1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m
10m 20m 30m 1h 2h."""

DEFAULT_MAX_DELAY_MS = 40 * 24 * 3600 * 1000
"""Longest delay the broker accepts by default (40 days; ``max_delay_ms``)."""

_MAX_DIGITS = 18  # any value below 10**18 ms (31 million years) fits an i64 with room to add


class Due(NamedTuple):
    """A record's due time as sent: relative (``%DELAY``) or absolute (``%DELIVER_AT``)."""

    relative: bool
    value: int

    def at(self, append_time_ms: int) -> int:
        """The due time (wall ms) of a record of a batch appended at ``append_time_ms``."""
        return append_time_ms + self.value if self.relative else self.value


def delay_level_ms(level: int) -> int:
    """The delay of RocketMQ delay level ``level`` in ms.

    Raises:
        ValueError: ``level`` is not 1..18.
    """
    if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= len(
        DELAY_LEVELS_MS
    ):
        raise ValueError(f"delay_level must be 1..{len(DELAY_LEVELS_MS)}, not {level!r}")
    return DELAY_LEVELS_MS[level - 1]


def due_property(due: Due) -> tuple[str, str]:
    """The reserved property that carries ``due`` on the wire."""
    return (DELAY if due.relative else DELIVER_AT), str(due.value)


def _number(name: str, text: str) -> int:
    if not (text.isascii() and text.isdigit() and len(text) <= _MAX_DIGITS):
        raise InvalidRequestError(f"{name} must be a non-negative number of ms, not {text[:32]!r}")
    return int(text)


def parse_due(props: Mapping[str, str]) -> Due:
    """The due time named by a scheduled record's properties.

    Raises:
        InvalidRequestError: neither or both properties, or a value that is not a non-negative
            decimal number of ms.
    """
    delay = props.get(DELAY)
    at = props.get(DELIVER_AT)
    if (delay is None) == (at is None):
        raise InvalidRequestError(
            f"a scheduled message needs exactly one of {DELAY} and {DELIVER_AT}")
    if delay is not None:
        return Due(True, _number(DELAY, delay))
    assert at is not None
    return Due(False, _number(DELIVER_AT, at))


def read_due_times(
    buf: bytes | bytearray | memoryview, pos: int, h: BatchHeader, *, max_delay_ms: int | None,
    now_ms: int,
) -> list[tuple[int, Due]]:
    """``(offset delta, due)`` of every record of the scheduled batch at ``pos``.

    Args:
        buf: the buffer holding the batch.
        pos: where the batch starts in ``buf``.
        h: its header (``ATTR_SCHEDULED`` set).
        max_delay_ms: refuse a due time further than this from ``now_ms`` and a cancel record
            (from a producer); None: no check, for batches already stored, whose cancel records
            are skipped.
        now_ms: the broker's wall clock.

    Raises:
        InvalidRequestError: not a scheduled batch, a record without a valid due time, or a due
            time beyond ``max_delay_ms``, or a producer's cancel record. Nothing of the batch
            may be stored then.
    """
    if not h.attributes & ATTR_SCHEDULED:
        raise InvalidRequestError("not a scheduled batch")
    out: list[tuple[int, Due]] = []
    base = h.base_offset
    try:
        for rec in iter_raw_records(buf, pos, h):
            k1, p1 = rec[5], rec[6]
            props = decode_properties(bytes(buf[k1:p1])) if p1 > k1 else {}
            if SCHEDULED_CANCEL in props:
                if max_delay_ms is None:
                    continue  # a cancel record: not an original
                raise InvalidRequestError(f"{SCHEDULED_CANCEL} is written only by the broker")
            due = parse_due(props)
            if max_delay_ms is not None:
                delay = due.value if due.relative else due.value - now_ms
                if delay > max_delay_ms:
                    raise InvalidRequestError(
                        f"delay of {delay} ms exceeds the broker's max_delay_ms {max_delay_ms}")
            out.append((rec[0] - base, due))
    except CorruptRecordError as exc:
        raise InvalidRequestError(f"malformed scheduled batch: {exc}") from None
    return out


def copy_properties(props: Mapping[str, str], original_id: str, due_ms: int) -> dict[str, str]:
    """The properties of the copy appended when a scheduled message is due: the original's
    without its due time, plus ``%SCHEDULED_ID`` and ``%SCHEDULED_DUE``."""
    out = {k: v for k, v in props.items() if k != DELAY and k != DELIVER_AT}
    out[SCHEDULED_ID] = original_id
    out[SCHEDULED_DUE] = str(due_ms)
    return out


def cancel_properties(original_id: str) -> dict[str, str]:
    """The properties of the cancel record of the scheduled message ``original_id``."""
    return {SCHEDULED_CANCEL: original_id}


def read_marks(buf: bytes, pos: int, h: BatchHeader) -> list[tuple[int, str]]:
    """The marks in the stored batch at ``pos`` of ``buf``: ``(FIRED_MARK, original id)`` of
    every copy, ``(CANCELLED_MARK, original id)`` of every cancel record. A batch without
    :data:`MARK_NEEDLE` in its bytes is not decoded.

    Raises:
        CorruptRecordError: a malformed record.
    """
    if buf.find(MARK_NEEDLE, pos, pos + LENGTH_PREFIX + h.batch_length) < 0:
        return []
    scheduled = bool(h.attributes & ATTR_SCHEDULED)
    name = SCHEDULED_CANCEL if scheduled else SCHEDULED_ID
    kind = CANCELLED_MARK if scheduled else FIRED_MARK
    out: list[tuple[int, str]] = []
    for rec in iter_raw_records(buf, pos, h):
        k1, p1 = rec[5], rec[6]
        if p1 > k1:
            original = decode_properties(buf[k1:p1]).get(name)
            if original is not None:
                out.append((kind, original))
    return out
