"""The cluster: CLUSTER_METADATA (who leads what), ELECT_PREFERRED_LEADERS and DRAIN_BROKER (an
admin's requests), REPLICA_FETCH and OFFSET_FOR_EPOCH (the followers' side of replication). See
``docs/cluster.md`` and ``docs/protocol.md``."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from ferrymq.protocol.messages.schema import (
    BYTES,
    INT,
    MAX_LIST_ITEMS,
    STR,
    ApiKey,
    Body,
    Reader,
    Request,
    Unexpected,
    decode_generic,
    lst,
    opt,
    rows_with_data,
    tup,
)

BrokerAddress = tuple[int, str, int]
"""(broker id, host, port) of a live broker, as clients and replicas reach it."""

QueueLeadership = tuple[int, int, int, list[int], list[int]]
"""(queue, leader broker id or -1, leader epoch, replicas, in-sync replicas)."""

TopicLeadership = tuple[str, int, int, int, list[QueueLeadership]]
"""(topic, error code, topic id, min_insync, one entry per queue)."""


@dataclass(frozen=True, slots=True)
class ClusterMetadataResponse(Body):
    """The cluster as this broker sees it. A single broker (no ``--metadata``) answers with
    ``cluster`` empty, itself as the only broker and the leader of every queue at epoch 0."""

    cluster: str
    controller: int
    brokers: list[BrokerAddress]
    topics: list[TopicLeadership]
    SCHEMA = (STR, INT, lst(tup(INT, STR, INT)),
              lst(tup(STR, INT, INT, INT, lst(tup(INT, INT, INT, lst(INT), lst(INT))))))


@dataclass(frozen=True, slots=True)
class ClusterMetadataRequest(Request):
    """Brokers, the controller and, per queue, leader, epoch, replicas and ISR: of ``topics``
    (None: every topic; an unknown name gets UNKNOWN_TOPIC in its entry)."""

    topics: list[str] | None
    API_KEY = ApiKey.CLUSTER_METADATA
    RESPONSE = ClusterMetadataResponse
    SCHEMA = (opt(lst(STR)),)


@dataclass(frozen=True, slots=True)
class ElectPreferredLeadersResponse(Body):
    """How many queues' leadership moved to their preferred replica."""

    moved: int
    SCHEMA = (INT,)


@dataclass(frozen=True, slots=True)
class ElectPreferredLeadersRequest(Request):
    """Move the leadership of each queue of ``topics`` (None: of every topic) back to its
    preferred replica (the first of its replicas) where that one is alive and in the ISR. Any
    broker of a cluster answers it; a single broker answers 0 (nothing to move)."""

    topics: list[str] | None
    API_KEY = ApiKey.ELECT_PREFERRED_LEADERS
    RESPONSE = ElectPreferredLeadersResponse
    SCHEMA = (opt(lst(STR)),)


@dataclass(frozen=True, slots=True)
class DrainBrokerResponse(Body):
    """How many queues' leadership moved away from the broker, and how many it still leads
    (no other replica alive and in sync)."""

    moved: int
    left: int
    SCHEMA = (INT, INT)


@dataclass(frozen=True, slots=True)
class DrainBrokerRequest(Request):
    """Move the leadership of every queue ``broker_id`` leads to another replica alive and in
    its ISR (before maintenance); the broker stays a follower. Any broker of a cluster answers
    it; a single broker refuses it."""

    broker_id: int
    API_KEY = ApiKey.DRAIN_BROKER
    RESPONSE = DrainBrokerResponse
    SCHEMA = (INT,)


@dataclass(frozen=True, slots=True)
class ReassignQueueResponse(Body):
    """The brokers joining the queue's replicas and those leaving it once they caught up."""

    adding: list[int]
    removing: list[int]
    SCHEMA = (lst(INT), lst(INT))


@dataclass(frozen=True, slots=True)
class ReassignQueueRequest(Request):
    """Move ``queue`` of ``topic`` to the replicas ``replicas`` (the first is the preferred
    leader): the new ones copy it as followers, then the old ones leave (the controller
    finishes it once every new one is in sync). Any broker of a cluster answers it."""

    topic: str
    queue: int
    replicas: list[int]
    API_KEY = ApiKey.REASSIGN_QUEUE
    RESPONSE = ReassignQueueResponse
    SCHEMA = (STR, INT, lst(INT))


ReplicaFetchEntry = tuple[str, int, int, int, int]
"""(topic, queue, the follower's leader epoch, fetch offset = the follower's log end, the
follower's durable offset)."""

ReplicaFetchResult = tuple[str, int, int, str, int, int, int, bytes | memoryview]
"""(topic, queue, error code, error message, high watermark, leader's log end, leader's log
start, record batches as the leader stored them)."""

EpochEntries = tuple[str, int, list[tuple[int, int]]]
"""(topic, queue, leader epochs as (epoch, start offset)): the entries of the leader's epoch
cache that start in the returned range or cover its first offset."""


@dataclass(frozen=True, slots=True)
class ReplicaFetchResponse(Body):
    """Batches per queue, unchanged (same offsets, same bytes), and the epochs they belong to."""

    results: list[ReplicaFetchResult]
    epochs: list[EpochEntries] = field(default_factory=list)
    SCHEMA = (lst(tup(STR, INT, INT, STR, INT, INT, INT, BYTES)),
              lst(tup(STR, INT, lst(tup(INT, INT)))))

    def encode_parts(self) -> list[bytes | bytearray | memoryview]:
        """Headers and record data as separate buffers (no copy of the data)."""
        parts = rows_with_data(b"\x92", self.results)
        parts.append(msgpack.packb(self.epochs))
        return parts

    @classmethod
    def decode(cls, data: bytes | memoryview) -> ReplicaFetchResponse:
        """Decode with each queue's batches as a view into ``data`` (no copy: a follower
        appends them as they are); unusual encodings take the generic, fully checked path."""
        r = Reader(memoryview(data))
        try:
            if r.array() != 2:
                raise Unexpected
            results: list[ReplicaFetchResult] = []
            for _ in range(_items(r)):
                if r.array() != 8:
                    raise Unexpected
                results.append((r.str_(), r.int_(), r.int_(), r.str_(), r.int_(), r.int_(),
                                r.int_(), r.bin_()))
            epochs: list[EpochEntries] = []
            for _ in range(_items(r)):
                if r.array() != 3:
                    raise Unexpected
                topic, queue = r.str_(), r.int_()
                entries: list[tuple[int, int]] = []
                for _ in range(_items(r)):
                    if r.array() != 2:
                        raise Unexpected
                    entries.append((r.int_(), r.int_()))
                epochs.append((topic, queue, entries))
            if r.pos != len(r.buf):
                raise Unexpected
        except Unexpected:
            return decode_generic(cls, data)
        return cls(results, epochs)


def _items(r: Reader) -> int:
    """An array header's length, within :data:`MAX_LIST_ITEMS` (else the generic path)."""
    n = r.array()
    if n > MAX_LIST_ITEMS:
        raise Unexpected
    return n


@dataclass(frozen=True, slots=True)
class ReplicaFetchRequest(Request):
    """A follower's fetch from the leader: long-polled (``max_wait_ms``) until some queue has
    data past the follower's end or the high watermark moves. The positions in it are how the
    leader learns what each follower has (ISR and high watermark)."""

    replica_id: int
    incarnation: int
    max_wait_ms: int
    max_bytes: int
    entries: list[ReplicaFetchEntry]
    API_KEY = ApiKey.REPLICA_FETCH
    RESPONSE = ReplicaFetchResponse
    SCHEMA = (INT, INT, INT, INT, lst(tup(STR, INT, INT, INT, INT)))

    @classmethod
    def decode(cls, data: bytes | memoryview) -> ReplicaFetchRequest:
        """Decode without the generic schema walk (the leader decodes one per long poll and
        position report); unusual encodings take the generic, fully checked path."""
        r = Reader(memoryview(data))
        try:
            if r.array() != 5:
                raise Unexpected
            replica, incarnation, wait_ms, max_bytes = r.int_(), r.int_(), r.int_(), r.int_()
            entries: list[ReplicaFetchEntry] = []
            for _ in range(_items(r)):
                if r.array() != 5:
                    raise Unexpected
                entries.append((r.str_(), r.int_(), r.int_(), r.int_(), r.int_()))
            if r.pos != len(r.buf):
                raise Unexpected
        except Unexpected:
            return decode_generic(cls, data)
        return cls(replica, incarnation, wait_ms, max_bytes, entries)


EpochEndResult = tuple[str, int, int, int, int]
"""(topic, queue, error code, the largest epoch <= the asked one the leader knows, the offset
where that epoch ends on the leader: the start of the next epoch, or its log end)."""


@dataclass(frozen=True, slots=True)
class OffsetForEpochResponse(Body):
    """Where each asked epoch ends on the leader (Kafka's OffsetsForLeaderEpoch, KIP-101)."""

    results: list[EpochEndResult]
    SCHEMA = (lst(tup(STR, INT, INT, INT, INT)),)


@dataclass(frozen=True, slots=True)
class OffsetForEpochRequest(Request):
    """A follower asks, after a leader change, where its last epoch ends on the leader; it
    truncates its log there (never to its own high watermark)."""

    replica_id: int
    entries: list[tuple[str, int, int, int]]
    """(topic, queue, the follower's current leader epoch, the epoch asked about)."""
    API_KEY = ApiKey.OFFSET_FOR_EPOCH
    RESPONSE = OffsetForEpochResponse
    SCHEMA = (INT, lst(tup(STR, INT, INT, INT)))
