"""The cluster read at one metadata-store revision: what the controller's and the admin
operations' decisions are made on (each write then checks that what it read still holds)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ferrymq.cluster.metadata.store import KeyValue, MetadataStore
from ferrymq.cluster.model import Keys, QueueRecord, TopicRecord

MAX_QUEUE_WRITE_ATTEMPTS = 100
"""Most CAS attempts on one queue in one reconcile. Each failure is another writer's success (a
leader changing its ISR); past this, the queue is left to the next reconcile."""


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """The cluster's keys at one store revision, decoded."""

    revision: int
    seat: int
    """The controller key's mod revision (0: the seat is free)."""
    brokers: dict[int, KeyValue]
    """Live brokers' keys by broker id."""
    topics: dict[str, TopicRecord]
    queues: dict[tuple[str, int], QueueRecord]


async def read_cluster(store: MetadataStore, keys: Keys) -> ClusterSnapshot:
    """Every key of the cluster at one revision.

    Raises:
        MetadataUnavailableError: the store cannot be reached.
    """
    kvs, revision = await store.range(keys.root)
    snap = ClusterSnapshot(revision, 0, {}, {}, {})
    for kv in kvs:
        if kv.key == keys.controller:
            snap = replace(snap, seat=kv.mod_revision)
        elif kv.key.startswith(keys.brokers):
            snap.brokers[int(kv.key[len(keys.brokers):])] = kv
        elif kv.key.startswith(keys.topics):
            snap.topics[kv.key[len(keys.topics):]] = TopicRecord.decode(kv)
        elif kv.key.startswith(keys.queues):
            snap.queues[keys.parse_queue(kv.key)] = QueueRecord.decode(kv)
    return snap
