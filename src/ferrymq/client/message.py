"""Messages as users see them: :class:`Message` to send, :class:`ReceivedMessage` when consumed,
:class:`SendResult` when stored."""

from __future__ import annotations

import datetime as _dt
import enum
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import overload

from ferrymq.protocol.dedup import DEDUP_KEY, check_dedup_key
from ferrymq.protocol.records import (
    HEADER_SIZE,
    LENGTH_PREFIX,
    RECORD_PREFIX_SIZE,
    BatchHeader,
    RecordInput,
    decode_properties,
    encode_msg_id,
    encode_properties,
    record_body,
    record_fields,
    record_timestamp_delta,
)
from ferrymq.protocol.schedule import Due, delay_level_ms, due_property

_new_tuple = tuple.__new__  # skips the namedtuple's Python-level __new__ on the hot path


def _utf8(value: str | bytes | None, what: str) -> bytes:
    if value is None:
        return b""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise TypeError(f"{what} must be str, not {type(value).__name__}")


class Message:
    """A message to send.

    Args:
        topic: topic name.
        body: the payload; ``str`` is encoded as UTF-8.
        tags: one tag (RocketMQ style) that consumers can filter on server-side.
        keys: business keys (str or several), kept with the message.
        sharding_key: messages with the same key go to the same queue, in send order.
        properties: user properties, str to str.
        delay: deliver no earlier than this long after the broker stored it: seconds (float,
            millisecond resolution, rounded up) or a ``timedelta``. 0: at once.
        deliver_at: deliver no earlier than this time (a ``datetime``; naive means local time).
            A time in the past: at once.
        delay_level: RocketMQ's delay level 1..18 (1s 5s 10s 30s 1m 2m ... 30m 1h 2h).
        dedup_key: names the message for deduplication (NATS' ``Nats-Msg-Id``): when the topic
            has a dedup window and stored a message with this key within it, this one is not
            stored again and its send result says ``duplicate`` and points at the stored one.
            1..255 bytes of UTF-8 (``MAX_DEDUP_KEY_BYTES``). Consumers see it as
            ``ReceivedMessage.dedup_key`` (property ``%DEDUP``). See docs/dedup.md.

    At most one of ``delay``, ``deliver_at`` and ``delay_level``. A scheduled message is stored
    at once (the send result is its id, which ``Producer.cancel`` takes); consumers receive a copy
    when it is due, with properties ``%SCHEDULED_ID`` (the original id) and ``%SCHEDULED_DUE``
    (the due time, wall ms). Limits and clock semantics: docs/scheduled.md.

    Raises:
        ValueError: a negative delay, a delay level outside 1..18, or more than one of them;
            an empty dedup key or one longer than 255 bytes.
        TypeError: a delay, due time or dedup key of the wrong type.
    """

    __slots__ = ("_due", "body", "dedup_key", "keys", "properties", "sharding_key", "tags",
                 "topic")

    def __init__(
        self,
        topic: str,
        body: bytes | bytearray | memoryview | str,
        *,
        tags: str | None = None,
        keys: str | Iterable[str] = (),
        sharding_key: str | None = None,
        properties: Mapping[str, str] | None = None,
        delay: float | _dt.timedelta | None = None,
        deliver_at: _dt.datetime | None = None,
        delay_level: int | None = None,
        dedup_key: str | None = None,
    ) -> None:
        self.topic = topic
        if isinstance(body, str):
            self.body = body.encode()
        elif isinstance(body, bytes):
            self.body = body
        elif isinstance(body, (bytearray, memoryview)):
            self.body = bytes(body)
        else:
            raise TypeError(f"body must be bytes or str, not {type(body).__name__}")
        self.tags = tags
        self.keys: tuple[str, ...] = (keys,) if isinstance(keys, str) else tuple(keys)
        self.sharding_key = sharding_key
        self.properties = dict(properties) if properties else None
        self._due: Due | None = None
        if delay is not None or deliver_at is not None or delay_level is not None:
            self._due = _parse_due(delay, deliver_at, delay_level)
        self.dedup_key = None if dedup_key is None else check_dedup_key(dedup_key)

    @property
    def delay_ms(self) -> int | None:
        """The delay in ms (``delay`` or ``delay_level``), None when not delayed."""
        d = self._due
        return d.value if d is not None and d.relative else None

    @property
    def deliver_at_ms(self) -> int | None:
        """The due time (wall ms) given with ``deliver_at``, else None."""
        d = self._due
        return d.value if d is not None and not d.relative else None

    def scheduled_delay_ms(self, now_ms: int) -> int | None:
        """How far in the future it is due when sent at ``now_ms`` (None: a plain message,
        sent as such: no delay, or a ``deliver_at`` not in the future)."""
        d = self._due
        if d is None:
            return None
        if d.relative:
            return d.value
        return d.value - now_ms if d.value > now_ms else None

    def to_record(self, timestamp_ms: int) -> RecordInput:
        """The wire form of this message (with its due time when it is scheduled at
        ``timestamp_ms``).

        Raises:
            ValueError: a key contains NUL (keys are NUL-separated on the wire).
        """
        if not (self.tags or self.keys or self.sharding_key or self.properties or self._due
                or self.dedup_key):
            return _new_tuple(RecordInput, (self.body, timestamp_ms, b"", b"", b"", b""))
        for k in self.keys:
            if "\x00" in k:
                raise ValueError("message keys must not contain NUL")
        props = self.properties
        if self._due is not None and self.scheduled_delay_ms(timestamp_ms) is not None:
            name, value = due_property(self._due)
            props = {**(props or {}), name: value}
        if self.dedup_key is not None:
            props = {**(props or {}), DEDUP_KEY: self.dedup_key}
        return RecordInput(
            self.body,
            timestamp_ms,
            _utf8(self.tags, "tags"),
            _utf8(self.sharding_key, "sharding_key"),
            "\x00".join(self.keys).encode() if self.keys else b"",
            encode_properties(props),
        )

    def __repr__(self) -> str:
        return f"Message(topic={self.topic!r}, body={self.body[:32]!r}, tags={self.tags!r})"


_MS = _dt.timedelta(milliseconds=1)


def _parse_due(delay: float | _dt.timedelta | None, deliver_at: _dt.datetime | None,
         delay_level: int | None) -> Due | None:
    if (delay is not None) + (deliver_at is not None) + (delay_level is not None) > 1:
        raise ValueError("give at most one of delay, deliver_at and delay_level")
    if delay_level is not None:
        return Due(True, delay_level_ms(delay_level))
    if deliver_at is not None:
        if not isinstance(deliver_at, _dt.datetime):
            raise TypeError(f"deliver_at must be a datetime, not {type(deliver_at).__name__}")
        if deliver_at.tzinfo is None:
            deliver_at = deliver_at.astimezone()
        epoch = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
        return Due(False, max(0, -((epoch - deliver_at) // _MS)))  # rounded up to the ms
    if isinstance(delay, _dt.timedelta):
        ms = -(-delay // _MS)
    elif isinstance(delay, (int, float)) and not isinstance(delay, bool):
        if not math.isfinite(delay):
            raise ValueError(f"delay must be a finite number of seconds, not {delay!r}")
        ms = math.ceil(round(delay * 1_000_000) / 1000)  # to the µs first: 0.1 s is 100 ms
    else:
        raise TypeError(f"delay must be seconds or a timedelta, not {type(delay).__name__}")
    if ms < 0:
        raise ValueError(f"delay must not be negative, not {delay!r}")
    return Due(True, ms) if ms > 0 else None


class Durability(enum.Enum):
    """How far a message got when the broker acknowledged it."""

    NONE = "none"
    """Not acknowledged (``send_oneway``)."""
    WRITTEN = "written"
    """Written to the OS (survives a broker crash, not a power loss)."""
    FSYNCED = "fsynced"
    """On disk (survives a power loss)."""
    REPLICATED = "replicated"
    """On every in-sync replica of its queue, at least ``min_insync`` of them (``acks="all"``
    on a cluster; fsynced on each with ``--flush sync``): survives the loss of a broker."""


DURABILITY_BY_WIRE = {0: Durability.NONE, 1: Durability.WRITTEN, 2: Durability.FSYNCED,
                      3: Durability.REPLICATED}


class SendResult:
    """Where a message was stored.

    Attributes:
        topic, queue, offset: its place in the log.
        durability: how far it got when acknowledged.
        msg_id: its id (derived from topic id, queue and offset).
        duplicate: True when the topic had already stored a message with the same dedup key
            within its dedup window: this send stored nothing, and queue, offset and msg_id are
            the stored message's (its queue may differ from the one this send picked).
    """

    __slots__ = ("_topic_id", "duplicate", "durability", "offset", "queue", "topic")

    def __init__(self, topic: str, queue: int, offset: int, durability: Durability,
                 topic_id: int, duplicate: bool = False) -> None:
        self.topic = topic
        self.queue = queue
        self.offset = offset
        self.durability = durability
        self._topic_id = topic_id
        self.duplicate = duplicate

    @property
    def msg_id(self) -> str:
        """The message id."""
        return encode_msg_id(self._topic_id, self.queue, self.offset)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SendResult) and (
            self.msg_id, self.durability, self.duplicate) == (
            other.msg_id, other.durability, other.duplicate)

    def __hash__(self) -> int:
        return hash(self.msg_id)

    def __repr__(self) -> str:
        dup = ", duplicate=True" if self.duplicate else ""
        return (f"SendResult(msg_id={self.msg_id!r}, topic={self.topic!r}, queue={self.queue}, "
                f"offset={self.offset}, durability={self.durability}{dup})")


class BatchContext:
    """What the messages of one fetched batch share (one object per batch, not per message)."""

    __slots__ = ("first_ts", "queue", "stored_ms", "topic", "topic_id")

    def __init__(self, topic: str, queue: int, topic_id: int, stored_ms: int, first_ts: int) -> None:
        self.topic = topic
        self.queue = queue
        self.topic_id = topic_id
        self.stored_ms = stored_ms
        self.first_ts = first_ts


class SendResults(Sequence["SendResult"]):
    """The results of messages stored as one contiguous run of one queue, created on access."""

    __slots__ = ("_base", "_count", "_durability", "_queue", "_topic", "_topic_id")

    def __init__(self, topic: str, queue: int, base: int, count: int, durability: Durability,
                 topic_id: int) -> None:
        self._topic, self._queue, self._base, self._count = topic, queue, base, count
        self._durability, self._topic_id = durability, topic_id

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> SendResult: ...
    @overload
    def __getitem__(self, i: slice) -> list[SendResult]: ...
    def __getitem__(self, i: int | slice) -> SendResult | list[SendResult]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._count))]
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError(i)
        return SendResult(self._topic, self._queue, self._base + i, self._durability,
                          self._topic_id)

    def __repr__(self) -> str:
        return (f"SendResults({self._topic!r}, queue={self._queue}, offsets {self._base}.."
                f"{self._base + self._count - 1})")


class ReceivedMessage:
    """A consumed message. The body is sliced out when the message is built; every other field
    is decoded on first access from the fetched batch.

    Attributes:
        offset: its offset in its queue.
        body: the payload.
    """

    __slots__ = ("_buf", "_ctx", "_pos", "body", "offset")

    def __init__(self, ctx: BatchContext, buf: bytes, pos: int, offset: int) -> None:
        self._ctx = ctx
        self._buf = buf
        self._pos = pos
        self.offset = offset
        self.body: bytes = record_body(buf, pos)

    @property
    def topic(self) -> str:
        """The topic."""
        return self._ctx.topic

    @property
    def queue(self) -> int:
        """The queue."""
        return self._ctx.queue

    @property
    def stored_ms(self) -> int:
        """When the broker stored it (ms since the epoch)."""
        return self._ctx.stored_ms

    def _fields(self) -> tuple[int, int, int, int, int, int]:
        return record_fields(self._buf, self._pos)

    @property
    def born_ms(self) -> int:
        """When the producer created it (ms since the epoch)."""
        return self._ctx.first_ts + record_timestamp_delta(self._buf, self._pos)

    @property
    def tags(self) -> str | None:
        """The message's tag, or None."""
        r = self._fields()
        return self._buf[r[0] : r[1]].decode("utf-8", "replace") if r[1] > r[0] else None

    @property
    def sharding_key(self) -> str | None:
        """The sharding key, or None."""
        r = self._fields()
        return self._buf[r[1] : r[2]].decode("utf-8", "replace") if r[2] > r[1] else None

    @property
    def keys(self) -> tuple[str, ...]:
        """Business keys."""
        r = self._fields()
        if r[3] == r[2]:
            return ()
        return tuple(self._buf[r[2] : r[3]].decode("utf-8", "replace").split("\x00"))

    @property
    def properties(self) -> dict[str, str]:
        """User properties."""
        r = self._fields()
        return decode_properties(self._buf[r[3] : r[4]]) if r[4] > r[3] else {}

    @property
    def dedup_key(self) -> str | None:
        """The dedup key it was sent with (property ``%DEDUP``), or None."""
        r = self._fields()
        if r[4] == r[3]:
            return None
        return decode_properties(self._buf[r[3] : r[4]]).get(DEDUP_KEY)

    @property
    def msg_id(self) -> str:
        """The message id (topic id, queue and offset)."""
        return encode_msg_id(self._ctx.topic_id, self._ctx.queue, self.offset)

    @property
    def born_at(self) -> _dt.datetime:
        """``born_ms`` as an aware UTC datetime."""
        return _dt.datetime.fromtimestamp(self.born_ms / 1000, _dt.UTC)

    @property
    def stored_at(self) -> _dt.datetime:
        """``stored_ms`` as an aware UTC datetime."""
        return _dt.datetime.fromtimestamp(self.stored_ms / 1000, _dt.UTC)

    def __repr__(self) -> str:
        return (f"ReceivedMessage(topic={self.topic!r}, queue={self.queue}, "
                f"offset={self.offset}, body={self.body[:32]!r})")


_RECORD_LENGTHS = struct.Struct("<II5xBHHI")  # length, offset delta, tag/sk/keys/props lengths
_unpack_record = _RECORD_LENGTHS.unpack_from
_new_received = ReceivedMessage.__new__


def received_messages(
    buf: bytes, pos: int, h: BatchHeader, start: int, ctx: BatchContext,
) -> list[ReceivedMessage] | None:
    """The messages of the batch at ``pos`` whose offset is at least ``start``; None when the
    record lengths do not add up to the batch (CRC-valid but malformed inside).

    The consumers' hot path: one ``unpack_from``, one slice and one object per record, built
    without a Python-level ``__init__`` call.
    """
    out: list[ReceivedMessage] = []
    app = out.append
    unpack = _unpack_record
    new = _new_received
    cls = ReceivedMessage
    base = h.base_offset
    p = pos + HEADER_SIZE
    end = pos + LENGTH_PREFIX + h.batch_length
    try:
        while p < end:
            n, delta, tl, skl, kl, pl = unpack(buf, p)
            rend = p + 4 + n
            bstart = p + RECORD_PREFIX_SIZE + tl + skl + kl + pl
            if bstart > rend:
                return None
            off = base + delta
            if off >= start:
                msg = new(cls)
                msg._ctx = ctx
                msg._buf = buf
                msg._pos = p
                msg.offset = off
                msg.body = buf[bstart:rend]
                app(msg)
            p = rend
    except struct.error:
        return None
    return out if p == end else None
