"""Consumer groups (offset-based pull groups, Kafka's) and their offsets: JOIN_GROUP, HEARTBEAT,
LEAVE_GROUP, LIST_GROUPS, DESCRIBE_GROUP, DELETE_GROUP (consumer and delivery groups),
COMMIT_OFFSETS, FETCH_OFFSETS, RESET_OFFSETS."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ferrymq.protocol.messages.schema import (
    BOOL,
    INT,
    STR,
    ApiKey,
    Body,
    Empty,
    Request,
    lst,
    opt,
    tup,
)


class GroupKinds(enum.IntFlag):
    """Which kinds of group of a name DELETE_GROUP deletes."""

    CONSUMER = 1
    """The consumer (pull) group and its committed offsets."""
    DELIVERY = 2
    """The delivery (push, simple) group, its state, retry and dead-letter queues."""
    BOTH = 3


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


DELIVERY_GROUP_STATE = "DELIVERY"
"""The state LIST_GROUPS shows for a delivery group (push and simple consumers, per-message
acks); consumer groups show their rebalance state (STABLE, ...)."""


@dataclass(frozen=True, slots=True)
class ListGroupsResponse(Body):
    """(group, state, live members) for every known group; a delivery group's state is
    :data:`DELIVERY_GROUP_STATE`."""

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
    members, or dead letters unless ``delete_dlq``; UNKNOWN_GROUP when no group has the name.

    ``kinds`` (:class:`GroupKinds`) says which kinds to delete (clients: both); a cluster's
    broker asks the delivery group's coordinator for its part with ``DELIVERY``, first with
    ``validate_only`` (every check, nothing deleted), then to delete."""

    group: str
    delete_dlq: bool
    kinds: int = 3
    validate_only: bool = False
    API_KEY = ApiKey.DELETE_GROUP
    RESPONSE = DeleteGroupResponse
    SCHEMA = (STR, BOOL, INT, BOOL)


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
