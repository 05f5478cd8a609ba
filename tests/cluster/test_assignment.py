"""Replica placement and the replication defaults (pure functions)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrymq.cluster.assignment import (
    assign_replicas,
    check_min_insync,
    default_min_insync,
    default_replicas,
)
from ferrymq.errors import InvalidReplicationFactorError, InvalidRequestError


def test_the_placement_is_kafkas_round_robin_with_a_shift() -> None:
    # Kafka's AdminUtils test: brokers 0..4, 10 partitions, replication factor 3, start 0
    assert assign_replicas(range(5), 10, 3, start=0) == [
        [0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 0], [4, 0, 1],
        [0, 2, 3], [1, 3, 4], [2, 4, 0], [3, 0, 1], [4, 1, 2],
    ]


def test_broker_ids_need_not_be_contiguous_or_sorted() -> None:
    assert assign_replicas([30, 10, 20], 3, 2, start=0) == [[10, 20], [20, 30], [30, 10]]


@settings(max_examples=200, deadline=None)
@given(brokers=st.sets(st.integers(0, 50), min_size=1, max_size=9),
       queues=st.integers(1, 60), data=st.data())
def test_leaders_spread_evenly_and_replicas_are_distinct(brokers: set[int], queues: int,
                                                        data: st.DataObject) -> None:
    replicas = data.draw(st.integers(1, len(brokers)))
    start = data.draw(st.none() | st.integers(0, 100))
    out = assign_replicas(brokers, queues, replicas, start)
    assert len(out) == queues
    for r in out:
        assert len(r) == replicas and len(set(r)) == replicas and set(r) <= brokers
    leaders = Counter(r[0] for r in out)
    counts = [leaders.get(b, 0) for b in brokers]
    assert max(counts) - min(counts) <= 1
    held = Counter(b for r in out for b in r)
    counts = [held.get(b, 0) for b in brokers]
    assert max(counts) - min(counts) <= (1 if queues % len(brokers) == 0 else replicas)


def test_followers_of_one_leader_spread_over_the_other_brokers() -> None:
    out = assign_replicas(range(4), 12, 2, start=0)
    followers_of_0 = {r[1] for r in out if r[0] == 0}
    assert followers_of_0 == {1, 2, 3}


@pytest.mark.parametrize(("brokers", "replicas", "match"), [
    (3, 0, "replicas must be >= 1, not 0"),
    (3, -2, "replicas must be >= 1, not -2"),
    (2, 3, "replicas 3 is more than the 2 live brokers of the cluster"),
    (1, 2, "replicas 2 is more than the 1 live broker of the cluster"),
])
def test_a_replication_factor_out_of_range_is_refused(brokers: int, replicas: int,
                                                       match: str) -> None:
    with pytest.raises(InvalidReplicationFactorError, match=match):
        assign_replicas(range(brokers), 4, replicas)


def test_no_brokers_or_no_queues_is_refused() -> None:
    with pytest.raises(InvalidReplicationFactorError, match="more than the 0 live brokers"):
        assign_replicas([], 4, 1)
    with pytest.raises(InvalidRequestError, match="queues must be >= 1, not 0"):
        assign_replicas([1], 0, 1)


@pytest.mark.parametrize(("live", "configured", "expected"), [
    (1, 0, 1), (2, 0, 2), (3, 0, 3), (7, 0, 3), (0, 0, 1), (7, 5, 5), (1, 2, 2)])
def test_default_replicas(live: int, configured: int, expected: int) -> None:
    assert default_replicas(live, configured) == expected


@pytest.mark.parametrize(("replicas", "configured", "expected"), [
    (1, 0, 1), (2, 0, 2), (3, 0, 2), (5, 0, 2), (3, 3, 3), (2, 3, 2), (5, 1, 1)])
def test_default_min_insync(replicas: int, configured: int, expected: int) -> None:
    assert default_min_insync(replicas, configured) == expected


def test_min_insync_must_be_within_the_replicas() -> None:
    check_min_insync(1, 1)
    check_min_insync(3, 3)
    with pytest.raises(InvalidReplicationFactorError, match=r"min_insync must be 1\.\.3 .*not 4"):
        check_min_insync(4, 3)
    with pytest.raises(InvalidReplicationFactorError, match=r"min_insync must be 1\.\.2 .*not 0"):
        check_min_insync(0, 2)
