"""A cluster's topics in the metadata store: create, delete, read. Any broker may call these
(not only the controller): every write is one compare-and-swap commit.

A create writes the :class:`~ferrymq.cluster.model.TopicRecord`, every
:class:`~ferrymq.cluster.model.QueueRecord` (leader = the first replica, epoch 0, ISR = every
replica) and the next topic id in **one** commit, checked on the topic key being absent and on
the topic-id counter's revision: two creates of one name cannot both succeed, no two topics get
one id, and no reader ever sees a topic without its queues. The brokers then create their
replicas from the watch (:class:`~ferrymq.cluster.node.ClusterNode`).
"""

from __future__ import annotations

from collections.abc import Mapping

from ferrymq.broker.topics import CLUSTER_TOPIC_ID_BASE, check_topic_name
from ferrymq.cluster.assignment import (
    assign_replicas,
    check_min_insync,
    check_replicas,
    default_min_insync,
    default_replicas,
)
from ferrymq.cluster.metadata.store import Check, MetadataStore, Put
from ferrymq.cluster.model import Counter, Keys, QueueRecord, TopicRecord
from ferrymq.errors import InvalidRequestError, TopicAlreadyExistsError, UnknownTopicError

DEFAULT = -1
"""``replicas`` / ``min_insync`` of :func:`create_topic` meaning "the cluster's default" (the
wire's -1 in CREATE_TOPIC)."""

MAX_CREATE_ATTEMPTS = 100
"""Most commits one create or delete tries when other writers keep changing what it checked
(the topic-id counter, taken by concurrent creates): each failure is another's success."""


async def live_brokers(store: MetadataStore, keys: Keys) -> list[int]:
    """The ids of the brokers registered now (their lease is alive), sorted."""
    kvs, _ = await store.range(keys.brokers)
    return sorted(int(kv.key[len(keys.brokers):]) for kv in kvs)


async def create_topic(store: MetadataStore, keys: Keys, name: str, queues: int, replicas: int,
                       min_insync: int, config: Mapping[str, str], now_ms: int, *,
                       default_replicas_setting: int = 0, default_min_insync_setting: int = 0,
                       start: int | None = None, internal_ok: bool = False) -> TopicRecord:
    """Create topic ``name`` with ``queues`` queues placed on the live brokers (see the module
    docstring); the record written (its ``topic_id`` at least ``CLUSTER_TOPIC_ID_BASE``).

    ``replicas`` and ``min_insync`` < 0 (:data:`DEFAULT`) take the defaults
    (:func:`~ferrymq.cluster.assignment.default_replicas` and
    :func:`~ferrymq.cluster.assignment.default_min_insync` with the broker's
    ``default_replicas`` / ``default_min_insync`` settings). ``config`` is the topic's settings,
    already checked by the caller; ``unclean_leader_election=true`` lets the controller elect a
    replica outside the ISR when every ISR member is down. ``start``: the placement's start
    (None: random). ``internal_ok``: ``name`` may be an internal topic's (``%GROUPS%offsets``,
    created by the brokers themselves).

    Raises:
        InvalidTopicNameError: ``name`` is not a valid topic name.
        InvalidRequestError: ``queues`` is below 1.
        InvalidReplicationFactorError: ``replicas`` is 0 or more than the live brokers, or
            ``min_insync`` is 0 or more than ``replicas``.
        TopicAlreadyExistsError: the cluster has a topic of that name.
        MetadataUnavailableError: the store cannot be reached (nothing was created).
    """
    check_topic_name(name, internal_ok=internal_ok)
    if queues < 1:
        raise InvalidRequestError(f"queues must be >= 1, not {queues}")
    topic_key = keys.topic(name)
    for _ in range(MAX_CREATE_ATTEMPTS):
        if await store.get(topic_key) is not None:
            raise TopicAlreadyExistsError(f"topic {name!r} exists")
        brokers = await live_brokers(store, keys)
        n = replicas if replicas >= 0 else default_replicas(len(brokers),
                                                            default_replicas_setting)
        check_replicas(n, len(brokers))
        isr_min = (min_insync if min_insync >= 0
                   else default_min_insync(n, default_min_insync_setting))
        check_min_insync(isr_min, n)
        placement = assign_replicas(brokers, queues, n, start)
        counter = await store.get(keys.topic_ids)
        topic_id = max(CLUSTER_TOPIC_ID_BASE,
                       Counter.decode(counter).value if counter is not None else 0)
        topic = TopicRecord(name, topic_id, queues, n, isr_min, dict(config), now_ms)
        puts = [Put(topic_key, topic.encode()), Put(keys.topic_ids, Counter(topic_id + 1).encode())]
        puts += [Put(keys.queue(name, q), QueueRecord(r, r[0], 0, list(r)).encode())
                 for q, r in enumerate(placement)]
        # queue keys left by a half-seen delete would be overwritten: the delete removes them
        # in the same commit as the topic key, so none can exist while the topic key is absent
        checks = [Check(topic_key, 0),
                  Check(keys.topic_ids, counter.mod_revision if counter is not None else 0)]
        if await store.commit(checks, puts) is not None:
            return topic
    raise TopicAlreadyExistsError(  # pragma: no cover - 100 concurrent creates in a row
        f"topic {name!r}: gave up after {MAX_CREATE_ATTEMPTS} concurrent changes")


async def delete_topic(store: MetadataStore, keys: Keys, name: str) -> TopicRecord:
    """Delete topic ``name`` and its queue records in one commit; the record deleted. The
    brokers drop their replicas from the watch.

    Raises:
        UnknownTopicError: the cluster has no topic of that name.
        MetadataUnavailableError: the store cannot be reached (nothing was deleted).
    """
    topic_key = keys.topic(name)
    for _ in range(MAX_CREATE_ATTEMPTS):
        kv = await store.get(topic_key)
        if kv is None:
            raise UnknownTopicError(f"unknown topic {name[:249]!r}")
        queue_kvs, _ = await store.range(keys.queue_prefix(name))
        deletes = [topic_key, *(q.key for q in queue_kvs)]
        if await store.commit([Check(topic_key, kv.mod_revision)], deletes=deletes) is not None:
            return TopicRecord.decode(kv)
    raise UnknownTopicError(  # pragma: no cover - the topic recreated 100 times meanwhile
        f"topic {name!r}: gave up after {MAX_CREATE_ATTEMPTS} concurrent changes")


async def load_topics(store: MetadataStore, keys: Keys) -> tuple[
        dict[str, TopicRecord], dict[tuple[str, int], QueueRecord], int]:
    """Every topic and queue record, read at one revision: (topics by name, queues by
    (topic, queue), that revision)."""
    kvs, revision = await store.range(keys.root)
    topics: dict[str, TopicRecord] = {}
    queues: dict[tuple[str, int], QueueRecord] = {}
    for kv in kvs:
        if kv.key.startswith(keys.topics):
            topics[kv.key[len(keys.topics):]] = TopicRecord.decode(kv)
        elif kv.key.startswith(keys.queues):
            queues[keys.parse_queue(kv.key)] = QueueRecord.decode(kv)
    return topics, queues, revision
