"""The keyless queue choice: a round robin that sticks to a queue for ``sticky_bytes``."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from ferrymq.client.partitioner import RoundRobin, queue_for_key


def test_sticks_until_the_byte_share_then_moves_to_the_next_queue() -> None:
    rr = RoundRobin(100, rng=random.Random(1))
    first = rr.pick("t", 4)
    picks = [rr("t", 4, 40) for _ in range(9)]
    # 40 + 40 + 40 >= 100: the third message still goes to the queue, the fourth moves on
    q = [first, (first + 1) % 4, (first + 2) % 4]
    assert picks == [q[0]] * 3 + [q[1]] * 3 + [q[2]] * 3


def test_every_queue_gets_the_same_share_over_time() -> None:
    rr = RoundRobin(1000, rng=random.Random(2))
    counts = Counter(rr("t", 5, 100) for _ in range(5 * 10 * 7))
    assert sorted(counts) == [0, 1, 2, 3, 4]
    assert set(counts.values()) == {70}


def test_zero_is_a_round_robin_per_call() -> None:
    rr = RoundRobin(0, rng=random.Random(3))
    picks = [rr("t", 3, 10) for _ in range(7)]
    assert [(b - a) % 3 for a, b in itertools.pairwise(picks)] == [1] * 6
    # pick alone does not move on; only counted bytes do
    assert rr.pick("t", 3) == rr.pick("t", 3)


def test_topics_are_independent_and_start_at_a_random_queue() -> None:
    rr = RoundRobin(0, rng=random.Random(4))
    starts = {RoundRobin(0, rng=random.Random(seed)).pick("t", 8) for seed in range(40)}
    assert len(starts) > 1  # not always queue 0: many short-lived producers spread out
    a = [rr("a", 4) for _ in range(4)]
    b0 = rr("b", 4)
    assert rr("a", 4) == a[0]  # "b" did not move "a" on
    assert sorted(a) == [0, 1, 2, 3] and 0 <= b0 < 4
    assert RoundRobin(0).pick("one-queue", 1) == 0


def test_a_queue_count_change_keeps_the_pick_in_range() -> None:
    rr = RoundRobin(0, rng=random.Random(5))
    for _ in range(3):
        rr("t", 8)
    assert all(0 <= rr("t", 2) < 2 for _ in range(5))


def test_negative_share_is_refused() -> None:
    with pytest.raises(ValueError, match="sticky_bytes"):
        RoundRobin(-1)


def test_sharding_key_queue_is_stable() -> None:
    # CRC32C of the UTF-8 bytes: the same queue in every process (test_cli relies on these)
    assert [queue_for_key(k, 2) for k in "abcdef"] == [0, 0, 1, 0, 1, 1]


def test_producer_refuses_a_negative_share() -> None:
    from ferrymq.client.producer import AsyncProducer
    from ferrymq.errors import ConfigError

    with pytest.raises(ConfigError, match="sticky_queue_bytes must be >= 0"):
        AsyncProducer("127.0.0.1:1", sticky_queue_bytes=-1)
