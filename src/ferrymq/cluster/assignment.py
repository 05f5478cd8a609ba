"""Replica placement: which brokers hold each queue of a new topic, and the topic defaults.

Pure functions, no I/O. The placement is Kafka's rack-unaware one
(``AdminUtils.assignReplicasToBrokers``): brokers sorted by id; queue ``q``'s first replica (its
preferred leader) is broker ``(start + q) % n``, so leaders go round the brokers; its followers
follow at a distance ``1 + (shift + j) % (n - 1)`` from it, where ``shift`` grows by one every
``n`` queues, so the followers of one broker's leaders spread over the other brokers instead of
always being its neighbours. Every broker leads ``queues / n`` queues (± 1); when ``queues`` is a
multiple of ``n``, every broker also holds the same number of replicas (± 1).
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from ferrymq.errors import InvalidReplicationFactorError, InvalidRequestError

DEFAULT_MAX_REPLICAS = 3
"""``replicas`` of a topic created without it on a cluster of more than one broker (0 in
``default_replicas``): Kafka's usual replication factor, enough to survive one failure with
``min_insync`` 2."""

DEFAULT_MAX_MIN_INSYNC = 2
"""``min_insync`` of a topic created without it (0 in ``default_min_insync``), at most its
replicas: an acknowledged write is on two brokers."""


def assign_replicas(broker_ids: Iterable[int], queues: int, replicas: int,
                    start: int | None = None) -> list[list[int]]:
    """The replicas of each of ``queues`` queues, over ``broker_ids``: the first of each list
    is the queue's preferred leader (see the module docstring).

    ``start`` picks where the round robin begins (and its first shift); None: at random, so
    topics with fewer queues than brokers do not all lead on the lowest ids.

    Raises:
        InvalidReplicationFactorError: ``replicas`` is below 1 or above the number of brokers.
        InvalidRequestError: ``queues`` is below 1.
    """
    brokers = sorted(set(broker_ids))
    n = len(brokers)
    check_replicas(replicas, n)
    if queues < 1:
        raise InvalidRequestError(f"queues must be >= 1, not {queues}")
    if start is None:
        start = random.randrange(n)
    first_index = start % n
    shift = start % n
    out: list[list[int]] = []
    for q in range(queues):
        if q > 0 and q % n == 0:
            shift += 1
        first = (q + first_index) % n
        chosen = [brokers[first]]
        for j in range(replicas - 1):
            chosen.append(brokers[(first + 1 + (shift + j) % (n - 1)) % n])
        out.append(chosen)
    return out


def check_replicas(replicas: int, live_brokers: int) -> None:
    """Raise :class:`InvalidReplicationFactorError` unless ``1 <= replicas <= live_brokers``."""
    if replicas < 1:
        raise InvalidReplicationFactorError(f"replicas must be >= 1, not {replicas}")
    if replicas > live_brokers:
        raise InvalidReplicationFactorError(
            f"replicas {replicas} is more than the {live_brokers} live "
            f"broker{'' if live_brokers == 1 else 's'} of the cluster")


def check_min_insync(min_insync: int, replicas: int) -> None:
    """Raise :class:`InvalidReplicationFactorError` unless ``1 <= min_insync <= replicas``."""
    if not 1 <= min_insync <= replicas:
        raise InvalidReplicationFactorError(
            f"min_insync must be 1..{replicas} (the topic's replicas), not {min_insync}")


def default_replicas(live_brokers: int, configured: int) -> int:
    """The replicas of a topic created without them: the broker's ``default_replicas`` when
    set (``configured`` > 0), else 1 on a one-broker cluster and
    ``min(DEFAULT_MAX_REPLICAS, live_brokers)`` on bigger ones."""
    if configured > 0:
        return configured
    return 1 if live_brokers <= 1 else min(DEFAULT_MAX_REPLICAS, live_brokers)


def default_min_insync(replicas: int, configured: int) -> int:
    """The ``min_insync`` of a topic created without it: the broker's ``default_min_insync``
    when set (``configured`` > 0), at most ``replicas`` (a default may not make a topic
    unwritable with ``acks="all"``), else ``min(DEFAULT_MAX_MIN_INSYNC, replicas)``."""
    if configured > 0:
        return max(1, min(configured, replicas))
    return max(1, min(DEFAULT_MAX_MIN_INSYNC, replicas))
