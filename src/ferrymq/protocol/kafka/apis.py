"""Kafka's message schemas through ``kio``, the versions FerryMQ serves, its error codes. Sans-IO.

``kio`` (Aiven, Apache-2.0) is generated from Kafka's own JSON message schemas: one frozen
dataclass per API, version and direction, with a native reader and writer that handle flexible
versions (compact strings, tagged fields). FerryMQ uses it for every request and response body
but Produce's (the hot path, :mod:`ferrymq.protocol.kafka.produce_codec`); the record batches
inside Produce and Fetch are FerryMQ's own code (:mod:`ferrymq.protocol.kafka.records`).

:func:`build` fills a response class of any version from plain values: fields that version
does not have are dropped, nested lists are built with that version's nested classes, so one
handler serves every version of its API. :func:`error_response` builds the response of any API
kio knows with every ``error_code`` set (what an unsupported version is answered with).
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import typing
import uuid
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

from kio.index import load_request_schema, load_response_schema
from kio.schema.errors import ErrorCode as KafkaError
from kio.serial import entity_reader, entity_writer

from ferrymq.errors import RemoteProtocolError
from ferrymq.protocol.codes import ErrorCode

PRODUCE = 0
FETCH = 1
LIST_OFFSETS = 2
METADATA = 3
OFFSET_COMMIT = 8
OFFSET_FETCH = 9
FIND_COORDINATOR = 10
JOIN_GROUP = 11
HEARTBEAT = 12
LEAVE_GROUP = 13
SYNC_GROUP = 14
DESCRIBE_GROUPS = 15
LIST_GROUPS = 16
SASL_HANDSHAKE = 17
API_VERSIONS = 18
CREATE_TOPICS = 19
DELETE_TOPICS = 20
INIT_PRODUCER_ID = 22
ADD_PARTITIONS_TO_TXN = 24
ADD_OFFSETS_TO_TXN = 25
END_TXN = 26
TXN_OFFSET_COMMIT = 28
OFFSET_FOR_LEADER_EPOCH = 23
DESCRIBE_CONFIGS = 32
SASL_AUTHENTICATE = 36
DELETE_GROUPS = 42
DESCRIBE_CLUSTER = 60

SUPPORTED: dict[int, tuple[int, int]] = {
    PRODUCE: (3, 9),
    FETCH: (4, 12),
    LIST_OFFSETS: (1, 6),
    METADATA: (0, 12),
    OFFSET_COMMIT: (2, 8),
    OFFSET_FETCH: (1, 7),
    FIND_COORDINATOR: (0, 3),
    JOIN_GROUP: (0, 7),
    HEARTBEAT: (0, 4),
    LEAVE_GROUP: (0, 4),
    SYNC_GROUP: (0, 5),
    DESCRIBE_GROUPS: (0, 5),
    LIST_GROUPS: (0, 4),
    SASL_HANDSHAKE: (0, 1),
    API_VERSIONS: (0, 3),
    CREATE_TOPICS: (2, 5),
    DELETE_TOPICS: (1, 5),
    INIT_PRODUCER_ID: (0, 4),
    ADD_PARTITIONS_TO_TXN: (0, 3),
    ADD_OFFSETS_TO_TXN: (0, 3),
    END_TXN: (0, 3),
    TXN_OFFSET_COMMIT: (0, 3),
    OFFSET_FOR_LEADER_EPOCH: (2, 4),
    DESCRIBE_CONFIGS: (1, 4),
    SASL_AUTHENTICATE: (0, 2),
    DELETE_GROUPS: (0, 2),
    DESCRIBE_CLUSTER: (0, 1),
}
"""The versions served of each API key (ApiVersions lists exactly these). The upper ends stop
before topic ids replace topic names (Fetch 13, Produce 13) and before features this slice does
not have; every client negotiates down to them."""
PRE_AUTH = frozenset((API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE))
"""The only APIs served on a connection that has not authenticated (on a broker with users)."""

_ERRORS: dict[int, KafkaError] = {
    ErrorCode.NONE: KafkaError.none,
    ErrorCode.CORRUPT_MESSAGE: KafkaError.corrupt_message,
    ErrorCode.MESSAGE_TOO_LARGE: KafkaError.message_too_large,
    ErrorCode.BATCH_TOO_LARGE: KafkaError.record_list_too_large,
    ErrorCode.FRAME_TOO_LARGE: KafkaError.record_list_too_large,
    ErrorCode.INVALID_REQUEST: KafkaError.invalid_request,
    ErrorCode.UNSUPPORTED_VERSION: KafkaError.unsupported_version,
    ErrorCode.UNKNOWN_TOPIC: KafkaError.unknown_topic_or_partition,
    ErrorCode.UNKNOWN_QUEUE: KafkaError.unknown_topic_or_partition,
    ErrorCode.TOPIC_ALREADY_EXISTS: KafkaError.topic_already_exists,
    ErrorCode.INVALID_TOPIC_NAME: KafkaError.invalid_topic_exception,
    ErrorCode.OFFSET_OUT_OF_RANGE: KafkaError.offset_out_of_range,
    ErrorCode.OUT_OF_ORDER_SEQUENCE: KafkaError.out_of_order_sequence_number,
    ErrorCode.DUPLICATE_SEQUENCE: KafkaError.duplicate_sequence_number,
    ErrorCode.PRODUCER_FENCED: KafkaError.invalid_producer_epoch,
    ErrorCode.UNKNOWN_PRODUCER_ID: KafkaError.unknown_producer_id,
    ErrorCode.BROKER_SHUTTING_DOWN: KafkaError.not_leader_or_follower,
    ErrorCode.STORAGE_ERROR: KafkaError.kafka_storage_error,
    ErrorCode.STORAGE_FULL: KafkaError.kafka_storage_error,
    ErrorCode.REQUEST_TIMED_OUT: KafkaError.request_timed_out,
    ErrorCode.INVALID_CONFIG: KafkaError.invalid_config,
    ErrorCode.ACCESS_DENIED: KafkaError.topic_authorization_failed,
    ErrorCode.AUTHENTICATION_FAILED: KafkaError.sasl_authentication_failed,
    ErrorCode.BUSY: KafkaError.throttling_quota_exceeded,
    ErrorCode.POLICY_VIOLATION: KafkaError.policy_violation,
    ErrorCode.INVALID_TXN_STATE: KafkaError.invalid_txn_state,
    ErrorCode.TRANSACTION_TIMED_OUT: KafkaError.invalid_producer_epoch,
    ErrorCode.INVALID_TXN_TIMEOUT: KafkaError.invalid_transaction_timeout,
    ErrorCode.CONCURRENT_TRANSACTIONS: KafkaError.concurrent_transactions,
    ErrorCode.NOT_LEADER: KafkaError.not_leader_or_follower,
    ErrorCode.FENCED_LEADER_EPOCH: KafkaError.fenced_leader_epoch,
    ErrorCode.NOT_ENOUGH_REPLICAS: KafkaError.not_enough_replicas,
    ErrorCode.LEADER_NOT_AVAILABLE: KafkaError.leader_not_available,
    ErrorCode.NOT_COORDINATOR: KafkaError.not_coordinator,
    ErrorCode.INVALID_REPLICATION_FACTOR: KafkaError.invalid_replication_factor,
    ErrorCode.UNKNOWN_GROUP: KafkaError.group_id_not_found,
    ErrorCode.UNKNOWN_MEMBER: KafkaError.unknown_member_id,
    ErrorCode.ILLEGAL_GENERATION: KafkaError.illegal_generation,
    ErrorCode.REBALANCE_IN_PROGRESS: KafkaError.rebalance_in_progress,
    ErrorCode.NON_EMPTY_GROUP: KafkaError.non_empty_group,
    ErrorCode.INVALID_OFFSET: KafkaError.offset_out_of_range,
}


def kafka_error(code: int) -> KafkaError:
    """The Kafka error code of a FerryMQ one (UNKNOWN_SERVER_ERROR when Kafka has none like it;
    the FerryMQ message goes with it where the response has a message field)."""
    return _ERRORS.get(code, KafkaError.unknown_server_error)


def is_supported(api_key: int, version: int) -> bool:
    """Whether FerryMQ serves this API at this version."""
    span = SUPPORTED.get(api_key)
    return span is not None and span[0] <= version <= span[1]


@cache
def request_class(api_key: int, version: int) -> type[Any] | None:
    """kio's request class of an API version (None: kio does not know it)."""
    try:
        return load_request_schema(api_key, version)
    except Exception:  # noqa: BLE001 - kio raises its own KioIndexError for unknown ones
        return None


@cache
def response_class(api_key: int, version: int) -> type[Any] | None:
    """kio's response class of an API version (None: kio does not know it)."""
    try:
        return load_response_schema(api_key, version)
    except Exception:  # noqa: BLE001 - as above
        return None


_READERS: dict[type[Any], Callable[[bytes, int], tuple[Any, int]]] = {}
_WRITERS: dict[type[Any], Callable[[io.BytesIO, Any], None]] = {}
_FIELDS: dict[type[Any], tuple[dataclasses.Field[Any], ...]] = {}


def _reader(cls: type[Any]) -> Callable[[bytes, int], tuple[Any, int]]:
    r = _READERS.get(cls)
    if r is None:
        r = _READERS[cls] = typing.cast("Callable[[bytes, int], tuple[Any, int]]",
                                        entity_reader(cls))
    return r


def _writer(cls: type[Any]) -> Callable[[io.BytesIO, Any], None]:
    w = _WRITERS.get(cls)
    if w is None:
        w = _WRITERS[cls] = typing.cast("Callable[[io.BytesIO, Any], None]", entity_writer(cls))
    return w


def decode_request(cls: type[Any], frame: bytes, pos: int) -> Any:
    """Decode a request body of class ``cls`` starting at ``pos`` of ``frame``. Bytes after
    the body are ignored, as a Kafka broker ignores them (librdkafka 2.x sends three after a
    Metadata v12 request for every topic).

    Raises:
        RemoteProtocolError: the body does not parse.
    """
    try:
        value, _size = _reader(cls)(frame, pos)
    except Exception as exc:  # noqa: BLE001 - kio raises several types for bad input
        raise RemoteProtocolError(f"cannot decode {cls.__name__} v{cls.__version__}: "
                                  f"{exc or type(exc).__name__}") from None
    return value


def encode(value: Any) -> bytes:
    """Encode a kio entity."""
    out = io.BytesIO()
    _writer(type(value))(out, value)
    return out.getvalue()


def _fields(cls: type[Any]) -> tuple[dataclasses.Field[Any], ...]:
    f = _FIELDS.get(cls)
    if f is None:
        f = _FIELDS[cls] = tuple(dataclasses.fields(cls))
    return f


def build(cls: type[Any], values: Mapping[str, Any]) -> Any:
    """An instance of kio class ``cls`` from ``values``: keys ``cls`` does not have are
    ignored, a list of mappings for a field of nested entities builds them, a field left out
    takes its default.

    Raises:
        TypeError: a field without a default is left out (a handler bug).
    """
    kwargs: dict[str, Any] = {}
    for f in _fields(cls):
        if f.name not in values:
            continue
        v = values[f.name]
        inner = _nested(f.type)
        if inner is not None and v is not None:
            if isinstance(v, Mapping):
                v = build(inner, v)
            else:
                v = tuple(build(inner, x) if isinstance(x, Mapping) else x for x in v)
        kwargs[f.name] = v
    return cls(**kwargs)


def _nested(tp: Any) -> type[Any] | None:
    """The entity class a field holds (alone, in a tuple, or optional), else None."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    for arg in typing.get_args(tp):
        found = _nested(arg)
        if found is not None:
            return found
    return None


def error_response(cls: type[Any], error: KafkaError) -> Any:
    """An instance of response class ``cls`` with every field at its default or empty and
    every ``error_code`` set to ``error``."""
    kwargs: dict[str, Any] = {}
    for f in _fields(cls):
        if f.name == "error_code":
            kwargs[f.name] = error
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs[f.name] = _empty(f)
    return cls(**kwargs)


def _empty(f: dataclasses.Field[Any]) -> Any:
    kind = f.metadata.get("kafka_type", "")
    tp = f.type
    if typing.get_origin(tp) is tuple:
        return ()
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return error_response(tp, KafkaError.none)
    if type(None) in typing.get_args(tp):
        return None
    if kind == "string":
        return ""
    if kind == "bool":
        return False
    if kind.startswith("timedelta"):
        return datetime.timedelta(0)
    if kind.startswith("datetime"):
        return datetime.datetime.fromtimestamp(0, datetime.UTC)
    if kind == "uuid":
        return uuid.UUID(int=0)
    if kind in ("bytes", "records"):
        return b""
    if kind == "error_code":
        return KafkaError.none
    return 0


def api_versions_body(error: KafkaError, version: int) -> bytes:
    """The ApiVersions response listing :data:`SUPPORTED`, at ``version`` (v0 when the client
    asked for a version FerryMQ does not serve: every client can read v0's error and list)."""
    cls = response_class(API_VERSIONS, version)
    if cls is None:  # pragma: no cover - kio has every ApiVersions version FerryMQ serves
        raise RuntimeError(f"kio has no ApiVersions v{version}")
    return encode(build(cls, {
        "error_code": error,
        "api_keys": [{"api_key": k, "min_version": lo, "max_version": hi}
                     for k, (lo, hi) in sorted(SUPPORTED.items())],
        "throttle_time": datetime.timedelta(0),
    }))
