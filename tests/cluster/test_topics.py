"""Cluster topics in the metadata store: create (one CAS commit), delete, load."""

from __future__ import annotations

import asyncio

import pytest

from ferrymq.broker.topics import CLUSTER_TOPIC_ID_BASE
from ferrymq.cluster.model import Keys, TopicRecord
from ferrymq.cluster.topics import DEFAULT, create_topic, delete_topic, load_topics
from ferrymq.errors import (
    InvalidReplicationFactorError,
    InvalidRequestError,
    InvalidTopicNameError,
    TopicAlreadyExistsError,
    UnknownTopicError,
)
from ferrymq.testing import FakeClock
from tests.cluster.support import YieldingStore, memory_store, register, sync

KEYS = Keys("c")


@sync
async def test_a_create_writes_the_topic_and_every_queue_in_one_commit() -> None:
    store = memory_store(FakeClock())
    for b in (1, 2, 3):
        await register(store, KEYS, b)
    before = store.revision
    t = await create_topic(store, KEYS, "orders", 6, 3, 2, {"retention_ms": "1000"}, 123,
                           start=0)
    assert store.revision == before + 1
    assert t == TopicRecord("orders", CLUSTER_TOPIC_ID_BASE, 6, 3, 2, {"retention_ms": "1000"},
                            123)
    topics, queues, rev = await load_topics(store, KEYS)
    assert rev == store.revision
    assert topics == {"orders": t}
    assert sorted(queues) == [("orders", q) for q in range(6)]
    for q in range(6):
        rec = queues[("orders", q)]
        assert rec.leader == rec.replicas[0] and rec.leader_epoch == 0
        assert rec.isr == rec.replicas and len(set(rec.replicas)) == 3
        assert rec.version == rev
    assert [queues[("orders", q)].leader for q in range(6)] == [1, 2, 3, 1, 2, 3]


@sync
async def test_topic_ids_grow_from_the_cluster_base_even_under_concurrent_creates() -> None:
    store = memory_store(FakeClock())
    await register(store, KEYS, 1)
    racing = YieldingStore(store)  # every call yields: the creates interleave
    made = await asyncio.gather(*(create_topic(racing, KEYS, f"t{i}", 1, 1, 1, {}, 0)
                                  for i in range(8)))
    assert racing.failed_commits > 0
    assert sorted(t.topic_id for t in made) == list(range(CLUSTER_TOPIC_ID_BASE,
                                                          CLUSTER_TOPIC_ID_BASE + 8))
    await delete_topic(store, KEYS, "t0")
    again = await create_topic(store, KEYS, "t0", 1, 1, 1, {}, 0)
    assert again.topic_id == CLUSTER_TOPIC_ID_BASE + 8  # ids are never reused


@sync
async def test_two_creates_of_one_name_one_wins_and_the_other_is_refused() -> None:
    store = memory_store(FakeClock())
    for b in (1, 2):
        await register(store, KEYS, b)
    racing = YieldingStore(store)
    results = await asyncio.gather(create_topic(racing, KEYS, "x", 2, 2, 1, {}, 0),
                                   create_topic(racing, KEYS, "x", 4, 1, 1, {}, 0),
                                   return_exceptions=True)
    won = [r for r in results if isinstance(r, TopicRecord)]
    lost = [r for r in results if isinstance(r, TopicAlreadyExistsError)]
    assert len(won) == 1 and len(lost) == 1
    topics, queues, _ = await load_topics(store, KEYS)
    assert topics["x"] == won[0] and len(queues) == won[0].queues
    with pytest.raises(TopicAlreadyExistsError, match="topic 'x' exists"):
        await create_topic(store, KEYS, "x", 1, 1, 1, {}, 0)


@sync
async def test_defaults_follow_the_live_brokers() -> None:
    store = memory_store(FakeClock())
    await register(store, KEYS, 1)
    one = await create_topic(store, KEYS, "one", 1, DEFAULT, DEFAULT, {}, 0)
    assert (one.replicas, one.min_insync) == (1, 1)
    for b in (2, 3, 4):
        await register(store, KEYS, b)
    four = await create_topic(store, KEYS, "four", 1, DEFAULT, DEFAULT, {}, 0)
    assert (four.replicas, four.min_insync) == (3, 2)
    cfg = await create_topic(store, KEYS, "cfg", 1, DEFAULT, DEFAULT, {}, 0,
                             default_replicas_setting=4, default_min_insync_setting=3)
    assert (cfg.replicas, cfg.min_insync) == (4, 3)


@sync
async def test_bad_input_is_refused_and_nothing_is_written() -> None:
    clock = FakeClock()
    store = memory_store(clock)
    for b in (1, 2):
        await register(store, KEYS, b)
    before = store.revision
    with pytest.raises(InvalidReplicationFactorError,
                       match="replicas 3 is more than the 2 live brokers"):
        await create_topic(store, KEYS, "t", 1, 3, 1, {}, 0)
    with pytest.raises(InvalidReplicationFactorError, match=r"min_insync must be 1\.\.2"):
        await create_topic(store, KEYS, "t", 1, 2, 3, {}, 0)
    with pytest.raises(InvalidReplicationFactorError, match="replicas must be >= 1, not 0"):
        await create_topic(store, KEYS, "t", 1, 0, 1, {}, 0)
    with pytest.raises(InvalidRequestError, match="queues must be >= 1, not 0"):
        await create_topic(store, KEYS, "t", 0, 1, 1, {}, 0)
    with pytest.raises(InvalidTopicNameError):
        await create_topic(store, KEYS, "bad/name", 1, 1, 1, {}, 0)
    assert store.revision == before
    clock.advance(10)  # every broker's lease ran out: no live broker to place replicas on
    store.expire_leases()
    with pytest.raises(InvalidReplicationFactorError, match="more than the 0 live brokers"):
        await create_topic(store, KEYS, "t", 1, 1, 1, {}, 0)


@sync
async def test_a_delete_removes_the_topic_and_its_queues_at_once() -> None:
    store = memory_store(FakeClock())
    await register(store, KEYS, 1)
    await create_topic(store, KEYS, "a", 3, 1, 1, {}, 0)
    await create_topic(store, KEYS, "ab", 2, 1, 1, {}, 0)
    gone = await delete_topic(store, KEYS, "a")
    assert gone.name == "a" and gone.queues == 3
    topics, queues, _ = await load_topics(store, KEYS)
    assert set(topics) == {"ab"} and sorted(queues) == [("ab", 0), ("ab", 1)]
    with pytest.raises(UnknownTopicError, match="unknown topic 'a'"):
        await delete_topic(store, KEYS, "a")
