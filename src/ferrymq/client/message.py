"""Messages as users see them: :class:`Message` to send, :class:`ReceivedMessage` when consumed,
:class:`SendResult` when stored."""

from __future__ import annotations

import datetime as _dt
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ferrymq.protocol.records import (
    RawRecord,
    RecordInput,
    decode_properties,
    encode_msg_id,
    encode_properties,
)


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
    """

    __slots__ = ("body", "keys", "properties", "sharding_key", "tags", "topic")

    def __init__(
        self,
        topic: str,
        body: bytes | bytearray | memoryview | str,
        *,
        tags: str | None = None,
        keys: str | Iterable[str] = (),
        sharding_key: str | None = None,
        properties: Mapping[str, str] | None = None,
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

    def to_record(self, timestamp_ms: int) -> RecordInput:
        """The wire form of this message.

        Raises:
            ValueError: a key contains NUL (keys are NUL-separated on the wire).
        """
        if not (self.tags or self.keys or self.sharding_key or self.properties):
            return RecordInput(self.body, timestamp_ms)
        for k in self.keys:
            if "\x00" in k:
                raise ValueError("message keys must not contain NUL")
        return RecordInput(
            self.body,
            timestamp_ms,
            _utf8(self.tags, "tags"),
            _utf8(self.sharding_key, "sharding_key"),
            "\x00".join(self.keys).encode() if self.keys else b"",
            encode_properties(self.properties),
        )

    def __repr__(self) -> str:
        return f"Message(topic={self.topic!r}, body={self.body[:32]!r}, tags={self.tags!r})"


class Durability(enum.Enum):
    """How far a message got when the broker acknowledged it."""

    NONE = "none"
    """Not acknowledged (``send_oneway``)."""
    WRITTEN = "written"
    """Written to the OS (survives a broker crash, not a power loss)."""
    FSYNCED = "fsynced"
    """On disk (survives a power loss)."""


DURABILITY_BY_WIRE = {0: Durability.NONE, 1: Durability.WRITTEN, 2: Durability.FSYNCED}


@dataclass(frozen=True, slots=True)
class SendResult:
    """Where a message was stored."""

    msg_id: str
    topic: str
    queue: int
    offset: int
    durability: Durability


class ReceivedMessage:
    """A consumed message. Fields are decoded on first access from the fetched batch.

    Attributes:
        topic, queue, offset: where it is stored.
        born_ms: when the producer created it (ms since the epoch).
        stored_ms: when the broker stored it (ms since the epoch).
    """

    __slots__ = ("_buf", "_rec", "_topic_id", "born_ms", "offset", "queue", "stored_ms", "topic")

    def __init__(
        self, topic: str, queue: int, topic_id: int, stored_ms: int, buf: memoryview,
        rec: RawRecord,
    ) -> None:
        self.topic = topic
        self.queue = queue
        self._topic_id = topic_id
        self.stored_ms = stored_ms
        self._buf = buf
        self._rec = rec
        self.offset = rec[0]
        self.born_ms = rec[1]

    @property
    def body(self) -> bytes:
        """The payload."""
        r = self._rec
        return bytes(self._buf[r[6] : r[7]])

    @property
    def tags(self) -> str | None:
        """The message's tag, or None."""
        r = self._rec
        return bytes(self._buf[r[2] : r[3]]).decode() if r[3] > r[2] else None

    @property
    def sharding_key(self) -> str | None:
        """The sharding key, or None."""
        r = self._rec
        return bytes(self._buf[r[3] : r[4]]).decode() if r[4] > r[3] else None

    @property
    def keys(self) -> tuple[str, ...]:
        """Business keys."""
        r = self._rec
        return tuple(bytes(self._buf[r[4] : r[5]]).decode().split("\x00")) if r[5] > r[4] else ()

    @property
    def properties(self) -> dict[str, str]:
        """User properties."""
        r = self._rec
        return decode_properties(bytes(self._buf[r[5] : r[6]])) if r[6] > r[5] else {}

    @property
    def msg_id(self) -> str:
        """The message id (topic id, queue and offset)."""
        return encode_msg_id(self._topic_id, self.queue, self.offset)

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
