"""Topics and their messages: METADATA, CREATE_TOPIC, DELETE_TOPIC, DESCRIBE_TOPIC,
FIND_BY_KEY, CANCEL_SCHEDULED; the rules for topic names."""

from __future__ import annotations

from dataclasses import dataclass

from ferrymq.protocol.messages.schema import (
    BOOL,
    INT,
    STR,
    STRMAP,
    ApiKey,
    Body,
    Empty,
    Request,
    lst,
    opt,
    tup,
)

MAX_NAME_CHARS = 249
"""Topic and group names: at most this many characters."""

INTERNAL_TOPIC_PREFIX = "%"
"""Names of the broker's own topics start with this (``%RETRY%<group>``, ``%DLQ%<group>``,
``%HALF%transactions``, ``%TXN%state``); a user's topic name never does."""


def is_internal_topic(name: str) -> bool:
    """Whether ``name`` is one of the broker's own topics (see INTERNAL_TOPIC_PREFIX)."""
    return name.startswith(INTERNAL_TOPIC_PREFIX)


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
    """Create a topic with ``queues`` queues and optional per-topic config overrides; on a
    cluster, ``replicas`` copies of each queue, ``min_insync`` of them needed by ``acks="all"``
    (-1: the broker's defaults)."""

    name: str
    queues: int
    config: dict[str, str]
    replicas: int = -1
    min_insync: int = -1
    API_KEY = ApiKey.CREATE_TOPIC
    RESPONSE = CreateTopicResponse
    SCHEMA = (STR, INT, STRMAP, INT, INT)


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
