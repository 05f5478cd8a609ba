"""The schema machinery every message type is built on: bodies, field specs, the fast paths.

Every body is a msgpack array of the message's fields in declaration order (record batches
travel as msgpack ``bin``, so a batch is copied once and never re-encoded). Each type declares a
schema; :meth:`Body.decode` checks every field against it, so a handler only ever sees
well-typed values. Unknown trailing fields are ignored (a newer peer may append fields in a
later version); missing fields are an error, except trailing fields that declare a default
(fields added after release: an older peer's message gets the default).

Versions: every API is at version 1, except DLQ_ADMIN, at 2 when it names one letter. A request
is sent at the lowest version that carries what it asks for (:meth:`Request.wire_version`), and
one with a version outside ``[MIN_VERSION, MAX_VERSION]`` of its type is answered with
``UNSUPPORTED_VERSION``.

The message types themselves live in one module per API family next to this one (see
:mod:`ferrymq.protocol.messages`); :class:`ApiKey` numbers them all.
"""

from __future__ import annotations

import enum
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, TypeVar

import msgpack

from ferrymq.errors import RemoteProtocolError

MAX_LIST_ITEMS = 100_000
"""Largest list in any request or response (entries of a produce or fetch, topics, ...)."""


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
    DELIVERY_HEARTBEAT = 19
    RECEIVE = 20
    ACK = 21
    NACK = 22
    CHANGE_INVISIBLE = 23
    DELIVERY_LEAVE = 24
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
    PREPARE_HALF = 40
    END_HALF = 41
    HALF_CHECK_POLL = 42
    INIT_TXN = 43
    END_TXN = 44
    TXN_OFFSET_COMMIT = 45
    COMMIT_STAGED = 46
    ABORT_STAGED = 47
    DESCRIBE_TXNS = 48
    TXN_ADD_QUEUE = 49
    CLUSTER_METADATA = 50
    REPLICA_FETCH = 51
    OFFSET_FOR_EPOCH = 52
    ELECT_PREFERRED_LEADERS = 53
    DRAIN_BROKER = 54
    REASSIGN_QUEUE = 55
    TXN_MARKERS = 64


# --- schema ---------------------------------------------------------------------------------


class Spec:
    """One node of a message's schema: :meth:`check` returns a decoded value if it fits."""

    __slots__ = ()

    def check(self, v: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


class Scalar(Spec):
    """A value of exactly one of ``types`` (no subclasses: ``bool`` is not an ``int``)."""

    __slots__ = ("types",)

    def __init__(self, *types: type) -> None:
        self.types = types

    def check(self, v: Any) -> Any:
        if type(v) not in self.types:
            raise RemoteProtocolError(f"expected {self.types[0].__name__}, got {type(v).__name__}")
        return v


class Opt(Spec):
    """``inner`` or None (built by :func:`opt`)."""

    __slots__ = ("inner",)

    def __init__(self, inner: Spec) -> None:
        self.inner = inner

    def check(self, v: Any) -> Any:
        return None if v is None else self.inner.check(v)


class ListOf(Spec):
    """A list of ``inner``, at most :data:`MAX_LIST_ITEMS` long (built by :func:`lst`)."""

    __slots__ = ("inner",)

    def __init__(self, inner: Spec) -> None:
        self.inner = inner

    def check(self, v: Any) -> Any:
        if type(v) is not list:
            raise RemoteProtocolError(f"expected a list, got {type(v).__name__}")
        if len(v) > MAX_LIST_ITEMS:
            raise RemoteProtocolError(f"list of {len(v)} items exceeds {MAX_LIST_ITEMS}")
        check = self.inner.check
        return [check(x) for x in v]


class Tup(Spec):
    """A fixed array, decoded as a tuple; extra trailing items are ignored (built by
    :func:`tup`)."""

    __slots__ = ("items",)

    def __init__(self, *items: Spec) -> None:
        self.items = items

    def check(self, v: Any) -> Any:
        if type(v) is not list or len(v) < len(self.items):
            raise RemoteProtocolError(f"expected an array of {len(self.items)} fields")
        return tuple(s.check(x) for s, x in zip(self.items, v, strict=False))


class StrMap(Spec):
    """A map of str to str (topic config)."""

    __slots__ = ()

    def check(self, v: Any) -> Any:
        if type(v) is not dict or not all(
            type(k) is str and type(x) is str for k, x in v.items()
        ):
            raise RemoteProtocolError("expected a map of str to str")
        return v


INT = Scalar(int)
STR = Scalar(str)
BYTES = Scalar(bytes)
BOOL = Scalar(bool)
FLOAT = Scalar(float, int)
STRMAP = StrMap()


def opt(s: Spec) -> Spec:
    """Schema: ``s`` or None."""
    return Opt(s)


def lst(s: Spec) -> Spec:
    """Schema: a list of ``s``."""
    return ListOf(s)


def tup(*s: Spec) -> Spec:
    """Schema: a fixed array (decoded as a tuple)."""
    return Tup(*s)


# --- hand-rolled msgpack for the bulk messages -----------------------------------------------
# PRODUCE requests and FETCH (and RECEIVE) responses carry megabytes of record batches. Building them as a
# list of buffers (msgpack headers + the batches themselves) lets the transport write them with
# one vectored write instead of copying every batch into one big bytes object, and the broker
# reads produce batches as views into the received frame. The bytes are exactly what
# ``msgpack.packb`` would produce, so the generic decoder reads them too.


def array_header(n: int) -> bytes:
    """The msgpack header of an array of ``n`` items."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def bin_header(n: int) -> bytes:
    """The msgpack header of ``n`` bytes of ``bin``."""
    if n < 0x100:
        return b"\xc4" + bytes((n,))
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def rows_with_data(
    prefix: bytes, rows: list[Any]
) -> list[bytes | bytearray | memoryview]:
    """``prefix`` then an array of rows of 7 small fields and a trailing ``bin``, as buffers:
    the record data of each row is a buffer of its own (not copied)."""
    parts: list[bytes | bytearray | memoryview] = [prefix + array_header(len(rows))]
    for *head, data in rows:
        fields = msgpack.packb(head, use_bin_type=True)  # a fixarray of 7
        parts.append(b"\x98" + fields[1:] + bin_header(len(data)))
        if data:
            parts.append(data)
    return parts


class Reader:
    """A strict reader of the few msgpack types the fast paths use; anything else -> None."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def _take(self, n: int) -> memoryview:
        p = self.pos
        end = p + n
        if end > len(self.buf):
            raise Unexpected
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
        raise Unexpected

    def int_(self) -> int:
        b = self._take(1)[0]
        if b < 0x80:
            return b
        if b >= 0xE0:
            return b - 0x100
        sizes = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
        n = sizes.get(b)
        if n is None:
            raise Unexpected
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
            raise Unexpected
        try:
            return str(self._take(n), "utf-8")
        except UnicodeDecodeError:
            raise Unexpected from None

    def bin_(self) -> memoryview:
        b = self._take(1)[0]
        width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(b)
        if width is None:
            raise Unexpected
        return self._take(int.from_bytes(self._take(width), "big"))


class Unexpected(Exception):
    """The fast path met something it does not handle: use the generic decoder."""


# --- base classes ---------------------------------------------------------------------------

M = TypeVar("M", bound="Body")


@dataclass(frozen=True, slots=True)
class Body:
    """Base of every request and response body."""

    SCHEMA: ClassVar[tuple[Spec, ...]] = ()

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
        return decode_generic(cls, data)


def decode_generic(cls: type[M], data: bytes | memoryview) -> M:
    """Decode a body of ``cls`` with msgpack and check it field by field against its
    ``SCHEMA`` (what :meth:`Body.decode` does; the fast paths fall back to it).

    Raises:
        RemoteProtocolError: not msgpack, too few fields, or a field of the wrong type.
    """
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

    def wire_version(self) -> int:
        """The version this request is sent as: the lowest that carries what it asks for (a
        broker refuses a version it does not know, so a field an older broker would ignore
        is never silently dropped)."""
        return self.MIN_VERSION


@dataclass(frozen=True, slots=True)
class Empty(Body):
    """A body with no fields."""
