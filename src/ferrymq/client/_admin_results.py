"""What the admin client returns: typed results with named fields, made from the wire answers.

Theory of operation
-------------------
The broker answers admin requests with protocol messages whose rows are plain tuples
(:mod:`ferrymq.protocol.messages`). :class:`~ferrymq.client.admin.AsyncAdminClient` turns each
answer into one of the results here, so that its callers (the CLI's renderers in
:mod:`ferrymq.admin.output`, and users) read ``queue.end_offset``, not ``queue[2]``.

Compatibility with the wire types these methods returned before: every result keeps the
attribute names of the wire answer (``describe_topic(...).queues``, ``.config``, ...), and every
row is a :class:`~typing.NamedTuple` in the wire's field order, so code that indexes or unpacks
rows (``for q, first, end, *_ in d.queues``) works as before; a row also equals the plain tuple
it was made from. Answers that had named fields only (``create_topic``, ``delete_group``,
``dlq_redrive``, ``whoami``) are returned as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ferrymq.errors import CorruptRecordError
from ferrymq.protocol import messages as m
from ferrymq.protocol.letters import Letter, parse_letter, user_properties
from ferrymq.protocol.records import Record, encode_msg_id

# -- topics ------------------------------------------------------------------------------------


class TopicListing(NamedTuple):
    """A topic in :meth:`~ferrymq.client.admin.AsyncAdminClient.list_topics`."""

    name: str
    topic_id: int
    queues: int
    error_code: int
    dedup_window_ms: int
    """The topic's dedup window (0: none)."""


class QueueDescription(NamedTuple):
    """One queue of a topic: offsets ``[first_offset, end_offset)``, size and last append."""

    queue: int
    first_offset: int
    end_offset: int
    size_bytes: int
    segments: int
    last_append_ms: int
    """Wall ms of the last append, -1 if none."""

    @property
    def last_offset(self) -> int | None:
        """The offset of the last message, None when the queue is empty."""
        return self.end_offset - 1 if self.end_offset > self.first_offset else None


@dataclass(frozen=True, slots=True)
class TopicDescription:
    """A topic's queues (:class:`QueueDescription`), its config, its scheduled messages (how
    many are pending, the earliest due time in wall ms, -1: none) and its dedup window (ms, 0:
    none) with the number of keys the broker remembers for it."""

    name: str
    topic_id: int
    queues: list[QueueDescription]
    config: dict[str, str]
    scheduled_pending: int = 0
    next_due_ms: int = -1
    dedup_window_ms: int = 0
    dedup_keys: int = 0

    @classmethod
    def from_wire(cls, resp: m.DescribeTopicResponse) -> TopicDescription:
        """From the broker's DESCRIBE_TOPIC answer."""
        return cls(resp.name, resp.topic_id, [QueueDescription._make(q) for q in resp.queues],
                   resp.config, resp.scheduled_pending, resp.next_due_ms, resp.dedup_window_ms,
                   resp.dedup_keys)


# -- the cluster -------------------------------------------------------------------------------


class BrokerDescription(NamedTuple):
    """A broker of :class:`ClusterDescription`: a live one with the address clients and
    replicas reach it at, or one named as a replica whose lease ended (``alive`` False, no
    address)."""

    broker_id: int
    host: str
    port: int
    alive: bool

    @property
    def address(self) -> str:
        """``host:port`` ("" for a broker that is not alive)."""
        return f"{self.host}:{self.port}" if self.alive else ""


class QueueReplication(NamedTuple):
    """One queue of :class:`ClusterDescription`: its leader (-1: none), the leader's epoch, its
    replicas (the preferred leader first) and in-sync replicas."""

    topic: str
    queue: int
    leader: int
    leader_epoch: int
    replicas: list[int]
    isr: list[int]
    min_insync: int
    offline: bool
    """No live leader: the queue takes no sends and serves no reads until one is elected."""
    under_replicated: bool
    """Fewer in-sync replicas than replicas: a broker is down or lagging."""


@dataclass(frozen=True, slots=True)
class ClusterDescription:
    """The cluster as a broker sees it (``cluster`` "" and one broker, leader of every queue at
    epoch 0, for a single broker). ``queues`` come offline first, then under-replicated, then
    the others, each by topic and queue."""

    cluster: str
    controller: int
    """The controller's broker id (-1: none elected now)."""
    brokers: list[BrokerDescription]
    queues: list[QueueReplication]

    @property
    def offline(self) -> list[QueueReplication]:
        """Queues without a live leader."""
        return [q for q in self.queues if q.offline]

    @property
    def under_replicated(self) -> list[QueueReplication]:
        """Queues with fewer in-sync replicas than replicas."""
        return [q for q in self.queues if q.under_replicated]

    @classmethod
    def from_wire(cls, resp: m.ClusterMetadataResponse) -> ClusterDescription:
        """From a CLUSTER_METADATA answer (topics answered with an error are left out)."""
        alive = {bid: (host, port) for bid, host, port in resp.brokers}
        named: set[int] = set()
        queues: list[QueueReplication] = []
        for topic, code, _topic_id, min_insync, rows in resp.topics:
            if code:
                continue
            for queue, leader, epoch, replicas, isr in rows:
                named.update(replicas)
                queues.append(QueueReplication(
                    topic, queue, leader, epoch, list(replicas), list(isr), min_insync,
                    offline=leader not in alive, under_replicated=len(isr) < len(replicas)))
        queues.sort(key=lambda q: (0 if q.offline else 1 if q.under_replicated else 2,
                                   q.topic, q.queue))
        brokers = [BrokerDescription(bid, host, port, True) for bid, (host, port) in alive.items()]
        brokers += [BrokerDescription(bid, "", 0, False) for bid in named - alive.keys()]
        brokers.sort(key=lambda b: b.broker_id)
        return cls(resp.cluster, resp.controller, brokers, queues)


# -- consumer (pull) groups ----------------------------------------------------------------------


def merge_group_listings(rows: Iterable[GroupListing]) -> list[GroupListing]:
    """Several brokers' LIST_GROUPS rows as one list: one row per (group, kind), members
    summed for a delivery group (members on several brokers), the fullest row of a consumer
    group (listed twice only while its coordinator moves)."""
    merged: dict[tuple[str, bool], GroupListing] = {}
    for row in rows:
        key = (row.group, row.state == m.DELIVERY_GROUP_STATE)
        seen = merged.get(key)
        if seen is None:
            merged[key] = row
        elif key[1]:
            merged[key] = seen._replace(members=seen.members + row.members)
        elif row.members > seen.members:
            merged[key] = row
    return sorted(merged.values())


class DrainResult(NamedTuple):
    """What :meth:`~ferrymq.client.admin.AsyncAdminClient.drain_broker` did."""

    moved: int
    """Queues whose leadership moved to another replica."""
    left: int
    """Queues the broker still leads: no other replica alive and in sync."""


class Reassignment(NamedTuple):
    """What :meth:`~ferrymq.client.admin.AsyncAdminClient.reassign_queue` started."""

    adding: list[int]
    """Brokers that copy the queue and join its replicas."""
    removing: list[int]
    """Brokers that leave its replicas once the new ones are in sync."""


class GroupListing(NamedTuple):
    """A group in :meth:`~ferrymq.client.admin.AsyncAdminClient.list_groups` (a delivery
    group's state is ``DELIVERY``)."""

    group: str
    state: str
    members: int


class GroupMember(NamedTuple):
    """A live member of a consumer group and the queues assigned to it."""

    member_id: str
    client_id: str
    host: str
    queues: list[tuple[str, int]]


class CommittedOffset(NamedTuple):
    """A consumer group's progress on one queue (``committed`` -1: nothing committed)."""

    topic: str
    queue: int
    committed: int
    end_offset: int
    lag: int


@dataclass(frozen=True, slots=True)
class GroupDescription:
    """A consumer group: state, generation, members and per-queue progress."""

    group: str
    state: str
    generation: int
    members: list[GroupMember]
    offsets: list[CommittedOffset]

    @classmethod
    def from_wire(cls, resp: m.DescribeGroupResponse) -> GroupDescription:
        """From the broker's DESCRIBE_GROUP answer."""
        return cls(resp.group, resp.state, resp.generation,
                   [GroupMember._make(x) for x in resp.members],
                   [CommittedOffset._make(x) for x in resp.offsets])


class QueueOffset(NamedTuple):
    """An offset of one queue: where a reset moved a group, or what LIST_OFFSETS found."""

    topic: str
    queue: int
    offset: int


class OffsetLookup(NamedTuple):
    """A result of :meth:`~ferrymq.client.admin.AsyncAdminClient.list_offsets`."""

    topic: str
    queue: int
    error_code: int
    offset: int


# -- delivery groups -------------------------------------------------------------------------------


class DeliveryMember(NamedTuple):
    """A member of a delivery group online now."""

    member_id: str
    client_id: str
    host: str
    last_heartbeat_ms_ago: int
    in_flight: int


class DeliveryQueue(NamedTuple):
    """A delivery group's progress on one queue: everything below ``acked_below`` is
    finished, ``next_offset`` is the next never-delivered offset; ``oldest_age_ms`` is the age
    of the oldest unfinished message (-1: none)."""

    topic: str
    queue: int
    acked_below: int
    next_offset: int
    end_offset: int
    in_flight: int
    oldest_age_ms: int


class BlockedKey(NamedTuple):
    """An orderly group's failing sharding key: the message at its head, failed attempts,
    first failure and next attempt (wall ms; -1: being delivered now), last reason."""

    topic: str
    queue: int
    key: str
    msg_id: str
    attempts: int
    since_ms: int
    next_attempt_ms: int
    reason: str


@dataclass(frozen=True, slots=True)
class DeliveryGroupDescription:
    """A delivery group: members, per-queue progress, retry and dead-letter sizes, policy.

    ``lag`` is the broker's per-queue lag, one entry per row of ``queues`` (empty from a broker
    that predates it: :meth:`queue_lags` estimates it then).
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

    @classmethod
    def from_wire(cls, resp: m.DescribeDeliveryResponse) -> DeliveryGroupDescription:
        """From the broker's DESCRIBE_DELIVERY answer."""
        return cls(resp.group, [DeliveryMember._make(x) for x in resp.members],
                   [DeliveryQueue._make(x) for x in resp.queues], resp.retry_pending,
                   resp.retry_in_flight, resp.dlq_size, resp.retry_delays_ms, resp.max_reconsume,
                   resp.orderly, [BlockedKey._make(x) for x in resp.blocked], resp.lag)

    def queue_lags(self) -> list[int]:
        """Per queue, the messages the group has not finished: the broker's ``lag``, or from an
        older broker ``end - next + in_flight``."""
        if len(self.lag) == len(self.queues):
            return self.lag
        return [max(0, q.end_offset - q.next_offset) + q.in_flight for q in self.queues]

    @property
    def total_lag(self) -> int:
        """Messages not finished: every queue's lag plus the retry queue's (pending and in
        flight)."""
        return sum(self.queue_lags()) + self.retry_pending + self.retry_in_flight


# -- messages ------------------------------------------------------------------------------------


class DeliveryStatus(NamedTuple):
    """A message's state in one delivery group: WAITING, DELIVERED (to ``member`` until
    ``lease_until_ms``), CONSUMED, FILTERED, RETRYING (``next_attempt_ms``), DEAD; for a
    transaction's half message PREPARED, COMMITTED or ROLLED_BACK. Times are wall ms (-1:
    unknown); ``at_ms`` is when it was acknowledged or dead-lettered."""

    group: str
    state: str
    member: str
    lease_until_ms: int
    reconsume_times: int
    next_attempt_ms: int
    reason: str
    at_ms: int


@dataclass(frozen=True, slots=True)
class MessageStatus:
    """Where a message is (``offset`` -1: a transaction's half message not committed) and its
    state in each delivery group that reads its topic."""

    topic: str
    queue: int
    offset: int
    statuses: list[DeliveryStatus]

    @classmethod
    def from_wire(cls, resp: m.MessageStatusResponse) -> MessageStatus:
        """From the broker's MESSAGE_STATUS answer."""
        return cls(resp.topic, resp.queue, resp.offset,
                   [DeliveryStatus._make(x) for x in resp.statuses])


def merge_message_statuses(answers: Sequence[m.MessageStatusResponse]) -> m.MessageStatusResponse:
    """Several brokers' MESSAGE_STATUS answers as one (a cluster: each broker answers for the
    delivery groups it coordinates): one row per group, the first answer's that has one, by
    group name; a placeholder row (group ``-``) only when no broker had a group row."""
    rows: dict[str, m.MessageGroupStatus] = {}
    for a in answers:
        for row in a.statuses:
            rows.setdefault(row[0], row)
    if len(rows) > 1:
        rows.pop("-", None)
    first = answers[0]
    return m.MessageStatusResponse(first.topic, first.queue, first.offset,
                                   [rows[g] for g in sorted(rows)])


class KeyMatch(NamedTuple):
    """A message found by key: where, its id, when stored (wall ms) and its keys."""

    queue: int
    offset: int
    msg_id: str
    stored_ms: int
    keys: list[str]


@dataclass(frozen=True, slots=True)
class KeySearch:
    """The messages of ``topic`` carrying a key, newest first; ``unindexed`` offsets were not
    searched yet (0: complete)."""

    topic: str
    topic_id: int
    messages: list[KeyMatch]
    unindexed: int

    @classmethod
    def from_wire(cls, resp: m.FindByKeyResponse) -> KeySearch:
        """From the broker's FIND_BY_KEY answer."""
        return cls(resp.topic, resp.topic_id, [KeyMatch._make(x) for x in resp.messages],
                   resp.unindexed)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message in a delivery group's dead-letter queue (``%DLQ%<group>``), not yet redriven
    or purged.

    Attributes:
        group: the delivery group.
        dlq_offset: its offset in the dead-letter queue.
        dlq_msg_id: its id in the dead-letter queue.
        topic, queue, offset, msg_id: where the message was first stored, and its id there.
        attempts: deliveries that failed before it was dead-lettered.
        reason: why the last delivery failed.
        dead_ms: when it was dead-lettered (ms since the epoch; -1 if unknown).
        born_ms: when the producer created it.
        tag, keys, sharding_key, body: as sent.
        properties: the user properties (the broker's ``%`` bookkeeping removed).
    """

    group: str
    dlq_offset: int
    dlq_msg_id: str
    topic: str
    queue: int
    offset: int
    msg_id: str
    attempts: int
    reason: str
    dead_ms: int
    born_ms: int
    tag: str | None
    keys: tuple[str, ...]
    sharding_key: str | None
    properties: dict[str, str]
    body: bytes

    @classmethod
    def from_record(cls, group: str, topic_id: int, r: Record) -> DeadLetter:
        """A dead letter from a record of ``%DLQ%<group>`` (missing letter fields: -1 / "")."""
        try:
            letter = parse_letter(r.properties)
        except CorruptRecordError:  # not written by a broker: show what there is
            letter = Letter("", -1, -1, "", -1, reason=r.properties.get("%REASON", ""))
        return cls(
            group=group,
            dlq_offset=r.offset,
            dlq_msg_id=encode_msg_id(topic_id, 0, r.offset),
            topic=letter.topic,
            queue=letter.queue,
            offset=letter.offset,
            msg_id=letter.msg_id,
            attempts=letter.reconsume,
            reason=letter.reason,
            dead_ms=letter.dead_wall,
            born_ms=r.timestamp,
            tag=r.tag,
            keys=r.keys,
            sharding_key=r.sharding_key,
            properties=user_properties(r.properties),
            body=r.body,
        )


# -- transactions and users ------------------------------------------------------------------------


class TxnDescription(NamedTuple):
    """A transactional id: its producer id and epoch, state (:class:`~ferrymq.protocol.messages.
    TxnState`), when its open transaction started (wall ms, 0: none) and its timeout, the
    queues and groups in it, and the sink batch it is staged for (``""``, -1: none)."""

    transactional_id: str
    producer_id: int
    producer_epoch: int
    state: int
    started_ms: int
    timeout_ms: int
    queues: list[tuple[str, int]]
    groups: list[str]
    sink_id: str
    batch_id: int


class SinkFence(NamedTuple):
    """A sink's last committed batch id, and when it was committed (wall ms)."""

    sink_id: str
    batch_id: int
    at_ms: int


@dataclass(frozen=True, slots=True)
class TxnsDescription:
    """Transactional ids and sink fences."""

    txns: list[TxnDescription]
    sinks: list[SinkFence]

    @classmethod
    def from_wire(cls, resp: m.DescribeTxnsResponse) -> TxnsDescription:
        """From the broker's DESCRIBE_TXNS answer."""
        return cls([TxnDescription._make(x) for x in resp.txns],
                   [SinkFence._make(x) for x in resp.sinks])


class UserInfo(NamedTuple):
    """A user of the broker and its rights (never its credential)."""

    name: str
    admin: bool
    produce: list[str]
    consume: list[str]
    groups: list[str]
    produce_bytes_per_s: int
