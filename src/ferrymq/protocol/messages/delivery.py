"""Delivery groups (push and simple consumers): per-message leases, acks, retries, dead letters.

DELIVERY_HEARTBEAT, RECEIVE, ACK, NACK, CHANGE_INVISIBLE, DELIVERY_LEAVE, DESCRIBE_DELIVERY,
MESSAGE_STATUS, SKIP_MESSAGE, DLQ_ADMIN (docs/delivery.md)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgpack

from ferrymq.protocol.messages.schema import (
    BOOL,
    BYTES,
    INT,
    STR,
    ApiKey,
    Body,
    Empty,
    Request,
    lst,
    opt,
    rows_with_data,
    tup,
)


@dataclass(frozen=True, slots=True)
class DeliveryHeartbeatResponse(Body):
    """The member id to use from now on, how many members the group has, and whether the
    group is ephemeral (added after release: a broker that predates it sends none, and its
    groups are all durable)."""

    member_id: str
    members: int
    ephemeral: bool = False
    SCHEMA = (STR, INT, BOOL)


@dataclass(frozen=True, slots=True)
class DeliveryHeartbeatRequest(Request):
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
    API_KEY = ApiKey.DELIVERY_HEARTBEAT
    RESPONSE = DeliveryHeartbeatResponse
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
        return rows_with_data(b"\x92" + msgpack.packb(self.invisible_ms), self.deliveries)


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
class DeliveryLeaveRequest(Request):
    """Leave a delivery group; leases still held go back to the group at once."""

    group: str
    member_id: str
    API_KEY = ApiKey.DELIVERY_LEAVE
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
    """The DLQ offsets the action covered (``[first, end)``) and how many it moved or dropped.

    ``done`` (added after release; an older broker sends none) lists the offsets at or above
    ``first`` whose letters were redriven or purged one by one (a request with an ``offset``):
    they are no longer dead letters, and browsing skips them."""

    first: int
    end: int
    count: int
    done: list[int] = field(default_factory=list)
    SCHEMA = (INT, INT, INT, lst(INT))


@dataclass(frozen=True, slots=True)
class DlqAdminRequest(Request):
    """Redrive or purge a group's dead letters, at most ``max_messages`` of them (0: all),
    oldest first. With ``dry_run`` nothing changes; the answer says what would.

    ``offset`` (added after release, version 2; -1: absent) names one dead letter by its
    offset in the dead-letter queue: only that letter is redriven or purged, wherever it is
    (``max_messages`` is then ignored). A request carrying it is sent as version 2, so a broker
    that predates it refuses it (``UNSUPPORTED_VERSION``) instead of acting on the oldest."""

    group: str
    action: int
    max_messages: int
    dry_run: bool
    offset: int = -1
    API_KEY = ApiKey.DLQ_ADMIN
    MAX_VERSION = 2
    RESPONSE = DlqAdminResponse
    SCHEMA = (STR, INT, INT, BOOL, INT)

    def wire_version(self) -> int:
        """Version 2 when it names one letter (``offset``), else 1 (any broker takes it)."""
        return 2 if self.offset >= 0 else 1
