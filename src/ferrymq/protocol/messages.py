"""Request and response types, one pair per API, with their wire encoding.

Every body is a msgpack array of the message's fields in declaration order (record batches
travel as msgpack ``bin``, so a batch is copied once and never re-encoded). Each type declares a
schema; :func:`decode_request` / :func:`decode_response` check every field against it, so a
handler only ever sees well-typed values. Unknown trailing fields are ignored (a newer peer may
append fields in a later version); missing fields are an error, except trailing fields that
declare a default (fields added after release: an older peer's message gets the default).

Versions: every API is at version 1. A request with a version outside
``[MIN_VERSION, MAX_VERSION]`` of its type is answered with ``UNSUPPORTED_VERSION``.
"""

from __future__ import annotations

import enum
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

import msgpack

from ferrymq.errors import RemoteProtocolError
from ferrymq.protocol.records import BatchBuffers

MAX_LIST_ITEMS = 100_000
"""Largest list in any request or response (entries of a produce or fetch, topics, ...)."""

MAX_NAME_CHARS = 249
"""Topic and group names: at most this many characters."""

INTERNAL_TOPIC_PREFIX = "%"
"""Names of the broker's own topics start with this (``%RETRY%<group>``, ``%DLQ%<group>``,
``%HALF%transactions``, ``%TXN%state``); a user's topic name never does."""


def is_internal_topic(name: str) -> bool:
    """Whether ``name`` is one of the broker's own topics (see INTERNAL_TOPIC_PREFIX)."""
    return name.startswith(INTERNAL_TOPIC_PREFIX)


class ApiKey(enum.IntEnum):
    """Request types (``u16`` on the wire)."""

    HELLO = 1
    PING = 2
    METADATA = 3
    CREATE_TOPIC = 4
    DELETE_TOPIC = 5
    DESCRIBE_TOPIC = 6
    INIT_PRODUCER = 7
    PRODUCE = 8
    FETCH = 9
    LIST_OFFSETS = 10
    COMMIT_OFFSETS = 11
    FETCH_OFFSETS = 12
    JOIN_GROUP = 13
    HEARTBEAT = 14
    LEAVE_GROUP = 15
    LIST_GROUPS = 16
    DESCRIBE_GROUP = 17
    RESET_OFFSETS = 18
    CONSUMER_HEARTBEAT = 19
    RECEIVE = 20
    ACK = 21
    NACK = 22
    CHANGE_INVISIBLE = 23
    CONSUMER_LEAVE = 24
    DESCRIBE_DELIVERY = 25
    MESSAGE_STATUS = 26
    DLQ_ADMIN = 27
    FIND_BY_KEY = 28
    CANCEL_SCHEDULED = 29
    SKIP_MESSAGE = 30
    AUTH_START = 31
    AUTH_FINISH = 32
    WHOAMI = 33
    UPSERT_USER = 34
    DELETE_USER = 35
    LIST_USERS = 36
    DELETE_GROUP = 37
    PREPARE_TRANSACTION = 40
    END_TRANSACTION = 41
    TXN_CHECK_POLL = 42
    INIT_TXN = 43
    END_TXN = 44
    TXN_OFFSET_COMMIT = 45
    COMMIT_STAGED = 46
    ABORT_STAGED = 47
    DESCRIBE_TXNS = 48


class Durability(enum.IntEnum):
    """How far a stored batch got when the broker acknowledged it."""

    NONE = 0  # not acknowledged (oneway)
    WRITTEN = 1  # write(2) done: survives a broker crash, not a power loss
    FSYNCED = 2  # fsync done: survives a power loss


class OffsetSpec(enum.IntEnum):
    """Special values of LIST_OFFSETS ``spec`` (a value >= 0 is a timestamp in ms)."""

    LATEST = -1
    EARLIEST = -2


# --- schema ---------------------------------------------------------------------------------


class _Spec:
    __slots__ = ()

    def check(self, v: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


class _Scalar(_Spec):
    __slots__ = ("types",)

    def __init__(self, *types: type) -> None:
        self.types = types

    def check(self, v: Any) -> Any:
        if type(v) not in self.types:
            raise RemoteProtocolError(f"expected {self.types[0].__name__}, got {type(v).__name__}")
        return v


class _Opt(_Spec):
    __slots__ = ("inner",)

    def __init__(self, inner: _Spec) -> None:
        self.inner = inner

    def check(self, v: Any) -> Any:
        return None if v is None else self.inner.check(v)


class _List(_Spec):
    __slots__ = ("inner",)

    def __init__(self, inner: _Spec) -> None:
        self.inner = inner

    def check(self, v: Any) -> Any:
        if type(v) is not list:
            raise RemoteProtocolError(f"expected a list, got {type(v).__name__}")
        if len(v) > MAX_LIST_ITEMS:
            raise RemoteProtocolError(f"list of {len(v)} items exceeds {MAX_LIST_ITEMS}")
        check = self.inner.check
        return [check(x) for x in v]


class _Tup(_Spec):
    __slots__ = ("items",)

    def __init__(self, *items: _Spec) -> None:
        self.items = items

    def check(self, v: Any) -> Any:
        if type(v) is not list or len(v) < len(self.items):
            raise RemoteProtocolError(f"expected an array of {len(self.items)} fields")
        return tuple(s.check(x) for s, x in zip(self.items, v, strict=False))


class _StrMap(_Spec):
    __slots__ = ()

    def check(self, v: Any) -> Any:
        if type(v) is not dict or not all(
            type(k) is str and type(x) is str for k, x in v.items()
        ):
            raise RemoteProtocolError("expected a map of str to str")
        return v


INT = _Scalar(int)
STR = _Scalar(str)
BYTES = _Scalar(bytes)
BOOL = _Scalar(bool)
FLOAT = _Scalar(float, int)
STRMAP = _StrMap()


def opt(s: _Spec) -> _Spec:
    """Schema: ``s`` or None."""
    return _Opt(s)


def lst(s: _Spec) -> _Spec:
    """Schema: a list of ``s``."""
    return _List(s)


def tup(*s: _Spec) -> _Spec:
    """Schema: a fixed array (decoded as a tuple)."""
    return _Tup(*s)


# --- hand-rolled msgpack for the two bulk messages -------------------------------------------
# PRODUCE requests and FETCH responses carry megabytes of record batches. Building them as a
# list of buffers (msgpack headers + the batches themselves) lets the transport write them with
# one vectored write instead of copying every batch into one big bytes object, and the broker
# reads produce batches as views into the received frame. The bytes are exactly what
# ``msgpack.packb`` would produce, so the generic decoder reads them too.


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _bin_header(n: int) -> bytes:
    if n < 0x100:
        return b"\xc4" + bytes((n,))
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _rows_with_data(
    prefix: bytes, rows: list[Any]
) -> list[bytes | bytearray | memoryview]:
    """``prefix`` then an array of rows of 7 small fields and a trailing ``bin``, as buffers:
    the record data of each row is a buffer of its own (not copied)."""
    parts: list[bytes | bytearray | memoryview] = [prefix + _array_header(len(rows))]
    for *head, data in rows:
        fields = msgpack.packb(head, use_bin_type=True)  # a fixarray of 7
        parts.append(b"\x98" + fields[1:] + _bin_header(len(data)))
        if data:
            parts.append(data)
    return parts


class _Reader:
    """A strict reader of the few msgpack types the fast paths use; anything else -> None."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def _take(self, n: int) -> memoryview:
        p = self.pos
        end = p + n
        if end > len(self.buf):
            raise _Unexpected
        self.pos = end
        return self.buf[p:end]

    def array(self) -> int:
        b = self._take(1)[0]
        if b & 0xF0 == 0x90:
            return b & 0x0F
        if b == 0xDC:
            return int.from_bytes(self._take(2), "big")
        if b == 0xDD:
            return int.from_bytes(self._take(4), "big")
        raise _Unexpected

    def int_(self) -> int:
        b = self._take(1)[0]
        if b < 0x80:
            return b
        if b >= 0xE0:
            return b - 0x100
        sizes = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
        n = sizes.get(b)
        if n is None:
            raise _Unexpected
        return int.from_bytes(self._take(n), "big", signed=b >= 0xD0)

    def str_(self) -> str:
        b = self._take(1)[0]
        if b & 0xE0 == 0xA0:
            n = b & 0x1F
        elif b == 0xD9:
            n = self._take(1)[0]
        elif b == 0xDA:
            n = int.from_bytes(self._take(2), "big")
        else:
            raise _Unexpected
        try:
            return str(self._take(n), "utf-8")
        except UnicodeDecodeError:
            raise _Unexpected from None

    def bin_(self) -> memoryview:
        b = self._take(1)[0]
        width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(b)
        if width is None:
            raise _Unexpected
        return self._take(int.from_bytes(self._take(width), "big"))


class _Unexpected(Exception):
    """The fast path met something it does not handle: use the generic decoder."""


# --- base classes ---------------------------------------------------------------------------

M = TypeVar("M", bound="Body")


@dataclass(frozen=True, slots=True)
class Body:
    """Base of every request and response body."""

    SCHEMA: ClassVar[tuple[_Spec, ...]] = ()

    def encode(self) -> bytes:
        """Encode this body as a msgpack array."""
        return bytes(msgpack.packb(astuple_shallow(self), use_bin_type=True))

    def encode_parts(self) -> list[bytes | bytearray | memoryview]:
        """The encoding as a list of buffers to write in order (one, unless overridden)."""
        return [self.encode()]

    @classmethod
    def decode(cls: type[M], data: bytes | memoryview) -> M:
        """Decode and check a body of this type.

        Raises:
            RemoteProtocolError: not msgpack, or a field does not match the schema.
        """
        return _decode_generic(cls, data)


def _decode_generic(cls: type[M], data: bytes | memoryview) -> M:
    try:
        raw = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises many unrelated types
        raise RemoteProtocolError(f"{cls.__name__}: undecodable body ({exc})") from None
    schema = cls.SCHEMA
    if type(raw) is not list or (len(raw) < len(schema) and len(raw) < _required_fields(cls)):
        raise RemoteProtocolError(f"{cls.__name__}: expected {len(schema)} fields")
    try:
        values = [s.check(v) for s, v in zip(schema, raw, strict=False)]
    except RemoteProtocolError as exc:
        raise RemoteProtocolError(f"{cls.__name__}: {exc}") from None
    return cls(*values)


_REQUIRED: dict[type[Any], int] = {}


def _required_fields(cls: type[Any]) -> int:
    """How many leading fields a message of ``cls`` must carry: those without a default."""
    n = _REQUIRED.get(cls)
    if n is None:
        n = sum(1 for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)
        _REQUIRED[cls] = n
    return n


def astuple_shallow(obj: Body) -> list[Any]:
    """Field values of a body, without dataclasses.astuple's deep copy."""
    return [getattr(obj, f.name) for f in fields(obj)]




@dataclass(frozen=True, slots=True)
class Request(Body):
    """A request body; ``API_KEY`` says which API it belongs to."""

    API_KEY: ClassVar[ApiKey]
    MIN_VERSION: ClassVar[int] = 1
    MAX_VERSION: ClassVar[int] = 1
    RESPONSE: ClassVar[type[Body]]


# --- the APIs -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Empty(Body):
    """A body with no fields."""


@dataclass(frozen=True, slots=True)
class HelloResponse(Body):
    """What the broker tells a new connection about itself and its limits."""

    broker_version: str
    broker_id: int
    max_frame_bytes: int
    max_message_bytes: int
    max_batch_records: int
    flush_mode: str
    max_delay_ms: int = 0
    SCHEMA = (STR, INT, INT, INT, INT, STR, INT)


@dataclass(frozen=True, slots=True)
class HelloRequest(Request):
    """First request on a connection: who the client is."""

    client_id: str
    client_version: str
    API_KEY = ApiKey.HELLO
    RESPONSE = HelloResponse
    SCHEMA = (STR, STR)


@dataclass(frozen=True, slots=True)
class PingRequest(Request):
    """Keepalive; answered with an empty body."""

    API_KEY = ApiKey.PING
    RESPONSE = Empty


TopicMeta = tuple[str, int, int, int, int]
"""(name, topic_id, queue count, error code, dedup window ms (0: none))."""


@dataclass(frozen=True, slots=True)
class MetadataResponse(Body):
    """Topics with their ids and queue counts."""

    topics: list[TopicMeta]
    SCHEMA = (lst(tup(STR, INT, INT, INT, INT)),)


@dataclass(frozen=True, slots=True)
class MetadataRequest(Request):
    """Metadata of some topics (None: all), creating missing ones if asked and allowed."""

    topics: list[str] | None
    auto_create: bool
    API_KEY = ApiKey.METADATA
    RESPONSE = MetadataResponse
    SCHEMA = (opt(lst(STR)), BOOL)


@dataclass(frozen=True, slots=True)
class CreateTopicResponse(Body):
    """The new topic."""

    topic_id: int
    queues: int
    SCHEMA = (INT, INT)


@dataclass(frozen=True, slots=True)
class CreateTopicRequest(Request):
    """Create a topic with ``queues`` queues and optional per-topic config overrides."""

    name: str
    queues: int
    config: dict[str, str]
    API_KEY = ApiKey.CREATE_TOPIC
    RESPONSE = CreateTopicResponse
    SCHEMA = (STR, INT, STRMAP)


@dataclass(frozen=True, slots=True)
class DeleteTopicRequest(Request):
    """Delete a topic and its data."""

    name: str
    API_KEY = ApiKey.DELETE_TOPIC
    RESPONSE = Empty
    SCHEMA = (STR,)


QueueInfo = tuple[int, int, int, int, int, int]
"""(queue, start offset, end offset, size bytes, segments, last append time ms)."""


@dataclass(frozen=True, slots=True)
class DescribeTopicResponse(Body):
    """Per-queue offsets and sizes of a topic; how many scheduled messages of it are pending
    and the earliest due time among them (wall ms, -1: none); its dedup window (ms, 0: none) and
    how many dedup keys the broker remembers for it now."""

    name: str
    topic_id: int
    queues: list[QueueInfo]
    config: dict[str, str]
    scheduled_pending: int = 0
    next_due_ms: int = -1
    dedup_window_ms: int = 0
    dedup_keys: int = 0
    SCHEMA = (STR, INT, lst(tup(INT, INT, INT, INT, INT, INT)), STRMAP, INT, INT, INT, INT)


@dataclass(frozen=True, slots=True)
class DescribeTopicRequest(Request):
    """Describe one topic."""

    name: str
    API_KEY = ApiKey.DESCRIBE_TOPIC
    RESPONSE = DescribeTopicResponse
    SCHEMA = (STR,)


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


@dataclass(frozen=True, slots=True)
class ProduceRequest(Request):
    """Append record batches (one per entry) to queues."""

    timeout_ms: int
    entries: list[ProduceEntry]
    API_KEY = ApiKey.PRODUCE
    RESPONSE = ProduceResponse
    SCHEMA = (INT, lst(tup(STR, INT, BYTES)))

    def encode_parts(self) -> list[bytes | bytearray | memoryview]:
        """Headers and batches as separate buffers (no copy of the batches; a batch given as
        :class:`~ferrymq.protocol.records.BatchBuffers` goes as its buffers)."""
        parts: list[bytes | bytearray | memoryview] = [
            b"\x92" + msgpack.packb(self.timeout_ms) + _array_header(len(self.entries))
        ]
        for topic, queue, batch in self.entries:
            parts.append(b"\x93" + msgpack.packb(topic) + msgpack.packb(queue)
                         + _bin_header(len(batch)))
            if isinstance(batch, BatchBuffers):
                parts.append(batch.header)
                parts.extend(batch.parts)
            else:
                parts.append(batch)
        return parts

    @classmethod
    def decode(cls, data: bytes | memoryview) -> ProduceRequest:
        """Decode with batches as views into ``data`` (no copy); unusual encodings take the
        generic, fully checked path."""
        r = _Reader(memoryview(data))
        try:
            if r.array() != 2:
                raise _Unexpected
            timeout = r.int_()
            n = r.array()
            if n > MAX_LIST_ITEMS:
                raise _Unexpected
            entries: list[ProduceEntry] = []
            for _ in range(n):
                if r.array() != 3:
                    raise _Unexpected
                entries.append((r.str_(), r.int_(), r.bin_()))
            if r.pos != len(r.buf):
                raise _Unexpected
        except _Unexpected:
            return _decode_generic(cls, data)
        return cls(timeout, entries)


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
        parts = _rows_with_data(b"\x92", self.results)
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


@dataclass(frozen=True, slots=True)
class CommitOffsetsResponse(Body):
    """(topic, queue, error code) per committed entry."""

    results: list[tuple[str, int, int]]
    SCHEMA = (lst(tup(STR, INT, INT)),)


@dataclass(frozen=True, slots=True)
class CommitOffsetsRequest(Request):
    """Commit a group's next offsets; ``generation`` -1 commits outside group membership."""

    group: str
    member_id: str
    generation: int
    entries: list[tuple[str, int, int]]
    API_KEY = ApiKey.COMMIT_OFFSETS
    RESPONSE = CommitOffsetsResponse
    SCHEMA = (STR, STR, INT, lst(tup(STR, INT, INT)))


@dataclass(frozen=True, slots=True)
class FetchOffsetsResponse(Body):
    """(topic, queue, committed offset) for every committed queue asked for; ``unstable``
    lists queues with offsets sent in a transaction that is not yet resolved (a consumer
    waits for them before it starts from the committed offset)."""

    offsets: list[tuple[str, int, int]]
    unstable: list[tuple[str, int]] = field(default_factory=list)
    SCHEMA = (lst(tup(STR, INT, INT)), lst(tup(STR, INT)))


@dataclass(frozen=True, slots=True)
class FetchOffsetsRequest(Request):
    """A group's committed offsets, for some topics (None: all)."""

    group: str
    topics: list[str] | None
    API_KEY = ApiKey.FETCH_OFFSETS
    RESPONSE = FetchOffsetsResponse
    SCHEMA = (STR, opt(lst(STR)))


@dataclass(frozen=True, slots=True)
class JoinGroupResponse(Body):
    """The member's id, the group generation and the queues assigned to it."""

    generation: int
    member_id: str
    assignment: list[tuple[str, int]]
    members: int
    SCHEMA = (INT, STR, lst(tup(STR, INT)), INT)


@dataclass(frozen=True, slots=True)
class JoinGroupRequest(Request):
    """Join (or rejoin) a consumer group subscribed to ``topics``."""

    group: str
    member_id: str
    client_id: str
    topics: list[str]
    session_timeout_ms: int
    API_KEY = ApiKey.JOIN_GROUP
    RESPONSE = JoinGroupResponse
    SCHEMA = (STR, STR, STR, lst(STR), INT)


@dataclass(frozen=True, slots=True)
class HeartbeatRequest(Request):
    """Keep a membership alive; REBALANCE_IN_PROGRESS means: rejoin."""

    group: str
    member_id: str
    generation: int
    API_KEY = ApiKey.HEARTBEAT
    RESPONSE = Empty
    SCHEMA = (STR, STR, INT)


@dataclass(frozen=True, slots=True)
class LeaveGroupRequest(Request):
    """Leave a group at once (its queues move to the other members)."""

    group: str
    member_id: str
    API_KEY = ApiKey.LEAVE_GROUP
    RESPONSE = Empty
    SCHEMA = (STR, STR)


@dataclass(frozen=True, slots=True)
class ListGroupsResponse(Body):
    """(group, state, live members) for every known group."""

    groups: list[tuple[str, str, int]]
    SCHEMA = (lst(tup(STR, STR, INT)),)


@dataclass(frozen=True, slots=True)
class ListGroupsRequest(Request):
    """All known consumer groups."""

    API_KEY = ApiKey.LIST_GROUPS
    RESPONSE = ListGroupsResponse


MemberInfo = tuple[str, str, str, list[tuple[str, int]]]
"""(member id, client id, host, assigned queues)."""
GroupOffset = tuple[str, int, int, int, int]
"""(topic, queue, committed offset or -1, end offset, lag)."""


@dataclass(frozen=True, slots=True)
class DescribeGroupResponse(Body):
    """A group's members, assignment and per-queue progress."""

    group: str
    state: str
    generation: int
    members: list[MemberInfo]
    offsets: list[GroupOffset]
    SCHEMA = (
        STR, STR, INT,
        lst(tup(STR, STR, STR, lst(tup(STR, INT)))),
        lst(tup(STR, INT, INT, INT, INT)),
    )


@dataclass(frozen=True, slots=True)
class DescribeGroupRequest(Request):
    """Describe one consumer group."""

    group: str
    API_KEY = ApiKey.DESCRIBE_GROUP
    RESPONSE = DescribeGroupResponse
    SCHEMA = (STR,)


@dataclass(frozen=True, slots=True)
class DeleteGroupResponse(Body):
    """What was deleted: the consumer (pull) group of that name and its committed offsets, the
    delivery group with its state, retry queue and dead-letter queue; how many dead letters
    went with it."""

    consumer_group: bool
    delivery_group: bool
    dead_letters: int
    SCHEMA = (BOOL, BOOL, INT)


@dataclass(frozen=True, slots=True)
class DeleteGroupRequest(Request):
    """Delete a group (both kinds when the name has both): NON_EMPTY_GROUP while it has live
    members, or dead letters unless ``delete_dlq``; UNKNOWN_GROUP when no group has the name."""

    group: str
    delete_dlq: bool
    API_KEY = ApiKey.DELETE_GROUP
    RESPONSE = DeleteGroupResponse
    SCHEMA = (STR, BOOL)


@dataclass(frozen=True, slots=True)
class ResetOffsetsResponse(Body):
    """The offsets now committed, per queue."""

    offsets: list[tuple[str, int, int]]
    SCHEMA = (lst(tup(STR, INT, INT)),)


@dataclass(frozen=True, slots=True)
class ResetOffsetsRequest(Request):
    """Move a group's committed offsets on a topic (replay): ``spec`` as in LIST_OFFSETS,
    or an exact offset when ``exact`` is true."""

    group: str
    topic: str
    spec: int
    exact: bool
    API_KEY = ApiKey.RESET_OFFSETS
    RESPONSE = ResetOffsetsResponse
    SCHEMA = (STR, STR, INT, BOOL)


# --- per-message delivery (leases, acks, retries, dead letters) ------------------------------


@dataclass(frozen=True, slots=True)
class ConsumerHeartbeatResponse(Body):
    """The member id to use from now on, how many members the group has, and whether the
    group is ephemeral (added after release: a broker that predates it sends none, and its
    groups are all durable)."""

    member_id: str
    members: int
    ephemeral: bool = False
    SCHEMA = (STR, INT, BOOL)


@dataclass(frozen=True, slots=True)
class ConsumerHeartbeatRequest(Request):
    """Register or keep alive a member of a delivery group (push and simple consumers).

    ``member_id`` is empty on the first heartbeat. ``retry_delays_ms`` (None: keep) and
    ``max_reconsume`` (-1: keep) set the group's retry policy; the last heartbeat that sets them
    wins, and the policy is persisted with the group. ``start_from`` (an
    :class:`OffsetSpec` or a timestamp in ms) says where a *new* group starts reading each
    queue; it is ignored for a group that exists. ``orderly`` asks for an orderly group (one
message per sharding key at a time, in order); it is fixed when the group is created.
``exclusive`` says the member must be the group's only live member (a broadcasting consumer's
own group): a new member is refused with ``MEMBER_CONFLICT`` while another one is live.
``ephemeral`` (added after release; an older broker ignores it and keeps the group) asks for a
group the broker removes, with its state and retry queue, once it has no members (a
broadcasting consumer without an ``instance_name``); it is taken when the group is created, and
a heartbeat without it makes the group durable for good.

A subscription may name a topic that does not exist yet: the member is registered and the
group starts delivering it once it exists (see docs/delivery.md)."""

    group: str
    member_id: str
    client_id: str
    subscriptions: list[tuple[str, str]]
    session_timeout_ms: int
    retry_delays_ms: list[int] | None
    max_reconsume: int
    start_from: int
    orderly: bool = False
    exclusive: bool = False
    ephemeral: bool = False
    API_KEY = ApiKey.CONSUMER_HEARTBEAT
    RESPONSE = ConsumerHeartbeatResponse
    SCHEMA = (STR, STR, STR, lst(tup(STR, STR)), INT, opt(lst(INT)), INT, INT, BOOL, BOOL,
              BOOL)


Delivery = tuple[str, int, int, int, int, int, int, bytes | memoryview]
"""(topic, queue, topic id, lease id, reconsume times, first offset, last offset, batches).

The records of ``batches`` whose offsets are in ``[first, last]`` are leased to the caller under
``lease id``. For the group's retry queue (topic ``%RETRY%<group>``) each delivery holds one
record, whose ``%``-prefixed properties name the original topic, queue, offset and message id."""


@dataclass(frozen=True, slots=True)
class ReceiveResponse(Body):
    """Leased messages; they stay invisible to the group for ``invisible_ms``."""

    invisible_ms: int
    deliveries: list[Delivery]
    SCHEMA = (INT, lst(tup(STR, INT, INT, INT, INT, INT, INT, BYTES)))

    def encode_parts(self) -> list[bytes | bytearray | memoryview]:
        """Headers and record data as separate buffers (no copy of the data)."""
        return _rows_with_data(b"\x92" + msgpack.packb(self.invisible_ms), self.deliveries)


@dataclass(frozen=True, slots=True)
class ReceiveRequest(Request):
    """Lease up to ``max_messages`` of the subscribed topics for ``invisible_ms``; wait up to
    ``max_wait_ms`` when there is nothing (long polling)."""

    group: str
    member_id: str
    subscriptions: list[tuple[str, str]]
    max_messages: int
    max_bytes: int
    invisible_ms: int
    max_wait_ms: int
    API_KEY = ApiKey.RECEIVE
    RESPONSE = ReceiveResponse
    SCHEMA = (STR, STR, lst(tup(STR, STR)), INT, INT, INT, INT)


@dataclass(frozen=True, slots=True)
class ReceiptResponse(Body):
    """Per entry of an ACK, NACK or CHANGE_INVISIBLE: (error code, new lease id or -1)."""

    results: list[tuple[int, int]]
    SCHEMA = (lst(tup(INT, INT)),)


Receipt = tuple[str, int, int, int]
"""(topic, queue, offset, lease id): names one leased message."""


AckEntry = tuple[str, int, int, list[int]]
"""(topic, queue, lease id, offsets): messages of one lease to acknowledge."""


@dataclass(frozen=True, slots=True)
class AckResponse(Body):
    """The acks that were refused: (topic, queue, offset, error code); empty when all held."""

    failed: list[tuple[str, int, int, int]]
    SCHEMA = (lst(tup(STR, INT, INT, INT)),)


@dataclass(frozen=True, slots=True)
class AckRequest(Request):
    """Acknowledge leased messages (consumed): they are never delivered to the group again.
    Grouped by lease, so a batch ack costs one small integer per message on the wire."""

    group: str
    member_id: str
    entries: list[AckEntry]
    API_KEY = ApiKey.ACK
    RESPONSE = AckResponse
    SCHEMA = (STR, STR, lst(tup(STR, INT, INT, lst(INT))))


NackEntry = tuple[str, int, int, int, int, str, bool]
"""(topic, queue, offset, lease id, delay ms (-1: the group's retry ladder), reason,
counts as an attempt)."""


@dataclass(frozen=True, slots=True)
class NackRequest(Request):
    """Give leased messages back: redeliver after a delay (a failed attempt, or a release of
    prefetched messages that were never handled when ``counts`` is false)."""

    group: str
    member_id: str
    entries: list[NackEntry]
    API_KEY = ApiKey.NACK
    RESPONSE = ReceiptResponse
    SCHEMA = (STR, STR, lst(tup(STR, INT, INT, INT, INT, STR, BOOL)))


@dataclass(frozen=True, slots=True)
class ChangeInvisibleRequest(Request):
    """Extend or shorten leases: each message becomes visible again ``invisible_ms`` from now.
    Each answer carries the message's new lease id (the old receipt is no longer valid)."""

    group: str
    member_id: str
    entries: list[tuple[str, int, int, int, int]]
    API_KEY = ApiKey.CHANGE_INVISIBLE
    RESPONSE = ReceiptResponse
    SCHEMA = (STR, STR, lst(tup(STR, INT, INT, INT, INT)))


@dataclass(frozen=True, slots=True)
class ConsumerLeaveRequest(Request):
    """Leave a delivery group; leases still held go back to the group at once."""

    group: str
    member_id: str
    API_KEY = ApiKey.CONSUMER_LEAVE
    RESPONSE = Empty
    SCHEMA = (STR, STR)


DeliveryMember = tuple[str, str, str, int, int]
"""(member id, client id, host, ms since last heartbeat, messages in flight)."""
DeliveryQueue = tuple[str, int, int, int, int, int, int]
"""(topic, queue, acked-below offset, next new offset, end offset, in flight, age in ms of the
oldest unconsumed message or -1)."""


BlockedKey = tuple[str, int, str, str, int, int, int, str]
"""An orderly group's failing sharding key: (topic, queue, key, message id of its head,
failed attempts, first failure (wall ms), next attempt (wall ms, -1 delivered now), last
reason)."""


@dataclass(frozen=True, slots=True)
class DescribeDeliveryResponse(Body):
    """A delivery group: members, per-queue progress, retry and dead-letter sizes, policy.

    ``lag`` has one entry per row of ``queues``: the messages of that queue the group has not
    finished (never delivered, ``end - next``, plus those below ``next`` not finished: leased;
    for an orderly group also held behind a key and retried in place). Retry letters are not
    in it (``retry_pending``, ``retry_in_flight``). A broker that predates it sends none.
    """

    group: str
    members: list[DeliveryMember]
    queues: list[DeliveryQueue]
    retry_pending: int
    retry_in_flight: int
    dlq_size: int
    retry_delays_ms: list[int]
    max_reconsume: int
    orderly: bool = False
    blocked: list[BlockedKey] = field(default_factory=list)
    lag: list[int] = field(default_factory=list)
    SCHEMA = (
        STR,
        lst(tup(STR, STR, STR, INT, INT)),
        lst(tup(STR, INT, INT, INT, INT, INT, INT)),
        INT, INT, INT, lst(INT), INT, BOOL,
        lst(tup(STR, INT, STR, STR, INT, INT, INT, STR)),
        lst(INT),
    )


@dataclass(frozen=True, slots=True)
class DescribeDeliveryRequest(Request):
    """Describe one delivery group (UNKNOWN_GROUP if none); works with no member online."""

    group: str
    API_KEY = ApiKey.DESCRIBE_DELIVERY
    RESPONSE = DescribeDeliveryResponse
    SCHEMA = (STR,)


MessageGroupStatus = tuple[str, str, str, int, int, int, str, int]
"""(group, state, member, lease until (wall ms) or -1, reconsume times, next attempt (wall ms)
or -1, last failure reason, when (wall ms) it was acknowledged (CONSUMED) or dead-lettered
(DEAD), -1 if not known). States: WAITING, DELIVERED, CONSUMED, FILTERED (its tag does not
match the group's tag expression; the reason names it), RETRYING, DEAD."""


@dataclass(frozen=True, slots=True)
class MessageStatusResponse(Body):
    """Where a message is, and its state in every delivery group subscribed to its topic."""

    topic: str
    queue: int
    offset: int
    statuses: list[MessageGroupStatus]
    SCHEMA = (STR, INT, INT, lst(tup(STR, STR, STR, INT, INT, INT, STR, INT)))


@dataclass(frozen=True, slots=True)
class MessageStatusRequest(Request):
    """The consume status of one message id in each delivery group."""

    msg_id: str
    API_KEY = ApiKey.MESSAGE_STATUS
    RESPONSE = MessageStatusResponse
    SCHEMA = (STR,)


@dataclass(frozen=True, slots=True)
class SkipMessageRequest(Request):
    """Send a pending message of an orderly group to the group's dead-letter queue on purpose
    (its sharding key moves on). It must be the first pending message of its key."""

    group: str
    msg_id: str
    API_KEY = ApiKey.SKIP_MESSAGE
    RESPONSE = Empty
    SCHEMA = (STR, STR)


class DlqAction(enum.IntEnum):
    """What a DLQ_ADMIN request does."""

    REDRIVE = 1  # move dead letters back to the group (its retry queue), due now
    PURGE = 2  # drop every dead letter of the group


@dataclass(frozen=True, slots=True)
class DlqAdminResponse(Body):
    """The DLQ offsets the action covered (``[first, end)``) and how many it moved or dropped."""

    first: int
    end: int
    count: int
    SCHEMA = (INT, INT, INT)


@dataclass(frozen=True, slots=True)
class DlqAdminRequest(Request):
    """Redrive or purge a group's dead letters, at most ``max_messages`` of them (0: all).
    With ``dry_run`` nothing changes; the answer says what would."""

    group: str
    action: int
    max_messages: int
    dry_run: bool
    API_KEY = ApiKey.DLQ_ADMIN
    RESPONSE = DlqAdminResponse
    SCHEMA = (STR, INT, INT, BOOL)


KeyMatch = tuple[int, int, str, int, list[str]]
"""(queue, offset, message id, stored time (append time, wall ms), the message's keys)."""


@dataclass(frozen=True, slots=True)
class FindByKeyResponse(Body):
    """Messages of ``topic`` whose keys include the key, newest first (by stored time).

    ``unindexed`` counts the offsets that were not searched: the key index had not reached them
    yet and the request's scan budget ran out first (0: the answer is complete up to ``limit``)."""

    topic: str
    topic_id: int
    messages: list[KeyMatch]
    unindexed: int
    SCHEMA = (STR, INT, lst(tup(INT, INT, STR, INT, lst(STR))), INT)


@dataclass(frozen=True, slots=True)
class FindByKeyRequest(Request):
    """Messages of a topic carrying ``key`` (RocketMQ's query by key), at most ``limit``."""

    topic: str
    key: str
    limit: int
    API_KEY = ApiKey.FIND_BY_KEY
    RESPONSE = FindByKeyResponse
    SCHEMA = (STR, STR, INT)


@dataclass(frozen=True, slots=True)
class CancelScheduledRequest(Request):
    """Cancel a scheduled message that is not yet due (``NOT_SCHEDULED`` otherwise)."""

    msg_id: str
    API_KEY = ApiKey.CANCEL_SCHEDULED
    RESPONSE = Empty
    SCHEMA = (STR,)


class TransactionState(enum.IntEnum):
    """A transaction's outcome as a producer reports it (END_TRANSACTION ``state``)."""

    UNKNOWN = 0  # not decided yet: the broker asks the group's checker later
    COMMIT = 1
    ROLLBACK = 2


@dataclass(frozen=True, slots=True)
class PrepareTransactionResponse(Body):
    """The stored half message: ``txn_id`` is its message id (in the internal ``%HALF%``
    topic), the transaction id that END_TRANSACTION and ``message status`` take."""

    txn_id: str
    durability: int
    SCHEMA = (STR, INT)


@dataclass(frozen=True, slots=True)
class PrepareTransactionRequest(Request):
    """Store a half message: durable, invisible to consumers, bound for ``topic``/``queue``
    once committed. ``batch`` holds exactly one record (a plain or scheduled batch); the check
    settings (ms, ms, count; 0: the broker's defaults) are the producer group's."""

    group: str
    client_id: str
    topic: str
    queue: int
    batch: bytes
    check_after_ms: int
    check_interval_ms: int
    max_checks: int
    API_KEY = ApiKey.PREPARE_TRANSACTION
    RESPONSE = PrepareTransactionResponse
    SCHEMA = (STR, STR, STR, INT, BYTES, INT, INT, INT)


@dataclass(frozen=True, slots=True)
class EndTransactionResponse(Body):
    """The transaction's state after the request (PREPARED, COMMITTED, ROLLED_BACK) and, when
    committed, where the committed copy is (``msg_id`` "" and -1s otherwise)."""

    state: str
    msg_id: str
    topic: str
    queue: int
    offset: int
    durability: int
    SCHEMA = (STR, STR, STR, INT, INT, INT)


@dataclass(frozen=True, slots=True)
class EndTransactionRequest(Request):
    """Commit, roll back, or report UNKNOWN (:class:`TransactionState`) for a half message.
    Repeating the same outcome is harmless (the first result is answered again)."""

    group: str
    txn_id: str
    state: int
    from_check: bool
    reason: str
    API_KEY = ApiKey.END_TRANSACTION
    RESPONSE = EndTransactionResponse
    SCHEMA = (STR, STR, INT, BOOL, STR)


TxnCheck = tuple[str, str, int, bytes, int]
"""(transaction id, target topic, target queue, one-record batch (the message as it will be
committed, ``%TXN_ID`` among its properties), check number (1 = first))."""


@dataclass(frozen=True, slots=True)
class TxnCheckPollResponse(Body):
    """Half messages whose outcome the broker asks this producer to check."""

    checks: list[TxnCheck]
    SCHEMA = (lst(tup(STR, STR, INT, BYTES, INT)),)


@dataclass(frozen=True, slots=True)
class TxnCheckPollRequest(Request):
    """Long poll (up to ``wait_ms``) for transaction checks of ``group``: the broker has no
    server push, so a transactional producer keeps one of these outstanding and answers each
    check with END_TRANSACTION (``from_check``)."""

    group: str
    client_id: str
    wait_ms: int
    max_checks: int
    API_KEY = ApiKey.TXN_CHECK_POLL
    RESPONSE = TxnCheckPollResponse
    SCHEMA = (STR, STR, INT, INT)


# --- exactly-once transactions (read-process-write; docs/exactly-once.md) ----------------------


class Isolation(enum.IntEnum):
    """What a fetch returns of transactional data."""

    LEGACY = -1
    READ_UNCOMMITTED = 0
    READ_COMMITTED = 1


class EndTxnAction(enum.IntEnum):
    """END_TXN's ``action``."""

    COMMIT = 1
    ABORT = 2
    STAGE = 3


class TxnState(enum.IntEnum):
    """A transactional id's coordinator state (``docs/exactly-once.md``)."""

    EMPTY = 0
    ONGOING = 1
    PREPARE_COMMIT = 2
    PREPARE_ABORT = 3
    COMPLETE_COMMIT = 4
    COMPLETE_ABORT = 5
    STAGED = 6


@dataclass(frozen=True, slots=True)
class InitTxnResponse(Body):
    """The producer id and epoch to use from now on, and the timeout granted."""

    producer_id: int
    producer_epoch: int
    txn_timeout_ms: int
    SCHEMA = (INT, INT, INT)


@dataclass(frozen=True, slots=True)
class InitTxnRequest(Request):
    """Start (or restart) a transactional producer: aborts the id's open transaction, bumps the
    epoch (fencing older instances) and answers once that is durable. ``expected_*`` (-1: none)
    resume a producer whose transaction the broker timed out."""

    transactional_id: str
    txn_timeout_ms: int
    expected_producer_id: int
    expected_epoch: int
    API_KEY = ApiKey.INIT_TXN
    RESPONSE = InitTxnResponse
    SCHEMA = (STR, INT, INT, INT)


@dataclass(frozen=True, slots=True)
class EndTxnResponse(Body):
    """The transaction's state after the call (:class:`TxnState`) and how durable it is."""

    state: int
    durability: int
    SCHEMA = (INT, INT)


@dataclass(frozen=True, slots=True)
class EndTxnRequest(Request):
    """Commit, abort or stage (:class:`EndTxnAction`) the open transaction. Stage needs a
    ``sink_id`` and ``batch_id``; ``staged_ttl_ms`` 0 takes the broker's default."""

    transactional_id: str
    producer_id: int
    producer_epoch: int
    action: int
    sink_id: str
    batch_id: int
    staged_ttl_ms: int
    API_KEY = ApiKey.END_TXN
    RESPONSE = EndTxnResponse
    SCHEMA = (STR, INT, INT, INT, STR, INT, INT)


@dataclass(frozen=True, slots=True)
class TxnOffsetCommitRequest(Request):
    """Consumer offsets that become the group's committed offsets when the transaction
    commits (and are dropped if it aborts). ``generation`` -1: not fenced by membership."""

    transactional_id: str
    producer_id: int
    producer_epoch: int
    group: str
    member_id: str
    generation: int
    entries: list[tuple[str, int, int]]
    API_KEY = ApiKey.TXN_OFFSET_COMMIT
    RESPONSE = CommitOffsetsResponse
    SCHEMA = (STR, INT, INT, STR, STR, INT, lst(tup(STR, INT, INT)))


StagedMember = tuple[str, int, int]
"""(transactional id, producer id, producer epoch) of a staged transaction."""


@dataclass(frozen=True, slots=True)
class CommitStagedResponse(Body):
    """The batch's outcome (:class:`TxnState` COMPLETE_COMMIT) and the sink's last batch id."""

    state: int
    committed_batch_id: int
    SCHEMA = (INT, INT)


@dataclass(frozen=True, slots=True)
class CommitStagedRequest(Request):
    """Commit every staged transaction of one sink batch at once, fenced by
    (``sink_id``, ``batch_id``): a batch id at or below the sink's last is refused with
    BATCH_ALREADY_COMMITTED and the staged rows dropped."""

    sink_id: str
    batch_id: int
    members: list[StagedMember]
    API_KEY = ApiKey.COMMIT_STAGED
    RESPONSE = CommitStagedResponse
    SCHEMA = (STR, INT, lst(tup(STR, INT, INT)))


@dataclass(frozen=True, slots=True)
class AbortStagedResponse(Body):
    """How many staged transactions were aborted."""

    aborted: int
    SCHEMA = (INT,)


@dataclass(frozen=True, slots=True)
class AbortStagedRequest(Request):
    """Abort staged transactions of one sink batch (``members`` empty: all of them)."""

    sink_id: str
    batch_id: int
    members: list[StagedMember]
    API_KEY = ApiKey.ABORT_STAGED
    RESPONSE = AbortStagedResponse
    SCHEMA = (STR, INT, lst(tup(STR, INT, INT)))


TxnDescription = tuple[str, int, int, int, int, int, list[tuple[str, int]], list[str], str, int]
"""(transactional id, producer id, epoch, state (:class:`TxnState`), started ms (0: none),
timeout ms, queues, groups, sink id, batch id)."""


@dataclass(frozen=True, slots=True)
class DescribeTxnsResponse(Body):
    """Transactional ids and sink fences (sink id, last committed batch id, at ms)."""

    txns: list[TxnDescription]
    sinks: list[tuple[str, int, int]]
    SCHEMA = (lst(tup(STR, INT, INT, INT, INT, INT, lst(tup(STR, INT)), lst(STR), STR, INT)),
              lst(tup(STR, INT, INT)))


@dataclass(frozen=True, slots=True)
class DescribeTxnsRequest(Request):
    """Describe transactional ids (``transactional_id`` "": all) and sinks (``sink_id``)."""

    transactional_id: str
    sink_id: str
    API_KEY = ApiKey.DESCRIBE_TXNS
    RESPONSE = DescribeTxnsResponse
    SCHEMA = (STR, STR)


# --- authentication (SCRAM-SHA-256 style; see protocol/auth.py and docs/security.md) ----------


@dataclass(frozen=True, slots=True)
class AuthStartResponse(Body):
    """The broker's challenge: the user's salt and PBKDF2 rounds, and a fresh server nonce."""

    salt: bytes
    iterations: int
    server_nonce: bytes
    SCHEMA = (BYTES, INT, BYTES)


@dataclass(frozen=True, slots=True)
class AuthStartRequest(Request):
    """First step of authentication: mechanism (``SCRAM-SHA-256``), user name, client nonce."""

    mechanism: str
    user: str
    client_nonce: bytes
    API_KEY = ApiKey.AUTH_START
    RESPONSE = AuthStartResponse
    SCHEMA = (STR, STR, BYTES)


@dataclass(frozen=True, slots=True)
class AuthFinishResponse(Body):
    """Authenticated: the broker's signature (the client checks it) and who the client is now."""

    server_signature: bytes
    user: str
    admin: bool
    SCHEMA = (BYTES, STR, BOOL)


@dataclass(frozen=True, slots=True)
class AuthFinishRequest(Request):
    """Second step: the client proof (``ClientKey XOR HMAC(StoredKey, AuthMessage)``)."""

    client_proof: bytes
    API_KEY = ApiKey.AUTH_FINISH
    RESPONSE = AuthFinishResponse
    SCHEMA = (BYTES,)


@dataclass(frozen=True, slots=True)
class WhoAmIResponse(Body):
    """The connection's principal and rights ("" and admin when authentication is off)."""

    user: str
    admin: bool
    produce: list[str]
    consume: list[str]
    groups: list[str]
    SCHEMA = (STR, BOOL, lst(STR), lst(STR), lst(STR))


@dataclass(frozen=True, slots=True)
class WhoAmIRequest(Request):
    """Who this connection is authenticated as, with the user's ACL patterns."""

    API_KEY = ApiKey.WHOAMI
    RESPONSE = WhoAmIResponse


# --- user administration (admin right; see broker/handlers/users.py and docs/security.md) ------


@dataclass(frozen=True, slots=True)
class UpsertUserResponse(Body):
    """Whether the user was created (False: an existing user was replaced)."""

    created: bool
    SCHEMA = (BOOL,)


@dataclass(frozen=True, slots=True)
class UpsertUserRequest(Request):
    """Create or replace a user: its SCRAM-SHA-256 stored credential (derived from the secret
    by the client: the secret never crosses the wire) and its rights. ``replace`` false refuses
    an existing name (USER_ALREADY_EXISTS)."""

    name: str
    salt: bytes
    iterations: int
    stored_key: bytes = field(repr=False)
    server_key: bytes = field(repr=False)
    admin: bool
    produce: list[str]
    consume: list[str]
    groups: list[str]
    produce_bytes_per_s: int
    replace: bool
    API_KEY = ApiKey.UPSERT_USER
    RESPONSE = UpsertUserResponse
    SCHEMA = (STR, BYTES, INT, BYTES, BYTES, BOOL, lst(STR), lst(STR), lst(STR), INT, BOOL)


@dataclass(frozen=True, slots=True)
class DeleteUserResponse(Body):
    """How many open connections of the deleted user the broker closed."""

    connections_closed: int
    SCHEMA = (INT,)


@dataclass(frozen=True, slots=True)
class DeleteUserRequest(Request):
    """Delete a user; its open connections are closed."""

    name: str
    API_KEY = ApiKey.DELETE_USER
    RESPONSE = DeleteUserResponse
    SCHEMA = (STR,)


UserInfo = tuple[str, bool, list[str], list[str], list[str], int]
"""(name, admin, produce patterns, consume patterns, group patterns, produce_bytes_per_s):
a user's rights, never its credential."""


@dataclass(frozen=True, slots=True)
class ListUsersResponse(Body):
    """Every user with its rights, sorted by name (no credential material)."""

    users: list[UserInfo]
    SCHEMA = (lst(tup(STR, BOOL, lst(STR), lst(STR), lst(STR), INT)),)


@dataclass(frozen=True, slots=True)
class ListUsersRequest(Request):
    """The broker's users and their rights."""

    API_KEY = ApiKey.LIST_USERS
    RESPONSE = ListUsersResponse


REQUESTS: dict[int, type[Request]] = {
    cls.API_KEY: cls
    for cls in (
        HelloRequest, PingRequest, MetadataRequest, CreateTopicRequest, DeleteTopicRequest,
        DescribeTopicRequest, InitProducerRequest, ProduceRequest, FetchRequest,
        ListOffsetsRequest, CommitOffsetsRequest, FetchOffsetsRequest, JoinGroupRequest,
        HeartbeatRequest, LeaveGroupRequest, ListGroupsRequest, DescribeGroupRequest,
        ResetOffsetsRequest, ConsumerHeartbeatRequest, ReceiveRequest, AckRequest,
        NackRequest, ChangeInvisibleRequest, ConsumerLeaveRequest, DescribeDeliveryRequest,
        MessageStatusRequest, DlqAdminRequest, FindByKeyRequest, CancelScheduledRequest,
        SkipMessageRequest, PrepareTransactionRequest, EndTransactionRequest,
        TxnCheckPollRequest, InitTxnRequest, EndTxnRequest, TxnOffsetCommitRequest,
        CommitStagedRequest, AbortStagedRequest, DescribeTxnsRequest,
        AuthStartRequest, AuthFinishRequest, WhoAmIRequest,
        UpsertUserRequest, DeleteUserRequest, ListUsersRequest, DeleteGroupRequest,
    )
}
assert set(REQUESTS) == set(ApiKey), "every ApiKey needs a request type"
