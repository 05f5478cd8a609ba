"""Who leads each queue, as a client knows it: the routing table built from CLUSTER_METADATA.

Sans-IO, shared by the asyncio clients (:mod:`ferrymq.client._cluster`) and the Spark
connector's blocking workers (:mod:`ferrymq.spark._route`).

Theory of operation
-------------------
:class:`Leaders` holds, from the CLUSTER_METADATA answers a client got, the live brokers'
addresses and per queue its leader and leader epoch. :meth:`Leaders.update` folds one answer
in; :meth:`Leaders.leader` is the lookup the producer and consumer make for every batch and
fetch (two dict look-ups).

An answer does not blindly replace what is known: brokers learn of leader changes from the
metadata store at slightly different times, so a lagging broker may answer with an older
leader. A queue's entry is replaced only by one with the same or a higher leader epoch (Kafka's
metadata cache does the same, KIP-320); a topic deleted and created again under the same name
has a new topic id, and then its entries are replaced whatever their epochs, since epochs start
over with the new topic.

A queue without a live leader (``NO_LEADER``, or a leader whose address the answer does not
list) routes to None: the caller waits for a refresh (a failover is under way). A single broker
answers as a cluster of one, leader of every queue at epoch 0.

No I/O here: :mod:`ferrymq.client._cluster` (asyncio) and :mod:`ferrymq.spark._route`
(blocking) ask the brokers and feed the answers in.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode

NO_LEADER = -1
"""The leader field of a queue that has no live leader (as the model's ``NO_LEADER``)."""

Address = tuple[str, int]
T = TypeVar("T", bound=tuple[Any, ...])  # (topic, queue, ...)
C = TypeVar("C", bound=Hashable)  # a connection or session

MIN_REFRESH_INTERVAL_S = 0.1
"""Least time between two metadata refreshes asked for by errors (Kafka's
``retry.backoff.ms``): leaders move rarely, and a burst of NOT_LEADER answers must not become a
burst of metadata requests."""

STALE_VIEW_CODES = frozenset({ErrorCode.NOT_LEADER, ErrorCode.FENCED_LEADER_EPOCH,
                              ErrorCode.LEADER_NOT_AVAILABLE})
"""Codes of a per-queue request that say the sender's view of the leaders may be stale: it
refreshes the table and sends again, to the leader it names then."""


class Leaders:
    """Brokers' addresses and per queue (leader broker id, leader epoch)."""

    def __init__(self) -> None:
        self.brokers: dict[int, Address] = {}
        """Live brokers by id, as the last answer listed them."""
        self.controller = NO_LEADER
        self.cluster = ""
        self.queues: dict[tuple[str, int], tuple[int, int]] = {}
        """(topic, queue) -> (leader broker id or NO_LEADER, leader epoch)."""
        self.topic_ids: dict[str, int] = {}
        """Topics an answer described, with their ids."""

    def knows(self, topic: str) -> bool:
        """Whether an answer described ``topic``."""
        return topic in self.topic_ids

    def queue_count(self, topic: str) -> int:
        """How many queues ``topic`` has, as the answers described it (0: unknown)."""
        return sum(1 for t, _ in self.queues if t == topic) if topic in self.topic_ids else 0

    def leader(self, topic: str, queue: int) -> int | None:
        """The id of the live broker leading ``queue`` of ``topic`` (None: unknown, or no live
        leader now)."""
        entry = self.queues.get((topic, queue))
        if entry is None or entry[0] not in self.brokers:
            return None
        return entry[0]

    def epoch(self, topic: str, queue: int) -> int | None:
        """The leader epoch known for ``queue`` of ``topic`` (None: unknown)."""
        entry = self.queues.get((topic, queue))
        return None if entry is None else entry[1]

    def update(self, resp: m.ClusterMetadataResponse) -> list[tuple[str, int]]:
        """Fold one CLUSTER_METADATA answer in; returns the queues whose leader changed."""
        self.cluster = resp.cluster
        self.controller = resp.controller
        self.brokers = {bid: (host, port) for bid, host, port in resp.brokers}
        moved: list[tuple[str, int]] = []
        for name, code, topic_id, _min_insync, queues in resp.topics:
            if code == ErrorCode.UNKNOWN_TOPIC:
                self.forget([name])
                continue
            if code:
                continue  # not ours to judge here (a bad name is reported by the topic look-up)
            fresh = self.topic_ids.get(name) != topic_id  # new, or deleted and created again
            if fresh:
                self.forget([name])
                self.topic_ids[name] = topic_id
            for queue, leader, epoch, _replicas, _isr in queues:
                key = (name, queue)
                old = self.queues.get(key)
                if old is not None and old[1] > epoch:
                    continue  # a lagging broker's older view
                if not fresh and (old is None or old[0] != leader):
                    moved.append(key)
                self.queues[key] = (leader, epoch)
            stale = {q for (t, q) in self.queues if t == name} - {e[0] for e in queues}
            for q in stale:  # queues the topic no longer has
                del self.queues[(name, q)]
        return moved

    def describe_moves(self, moved: list[tuple[str, int]]) -> str:
        """``moved`` (from :meth:`update`) for a log line: the first ten with their leaders."""
        more = f" and {len(moved) - 10} more" if len(moved) > 10 else ""
        return ", ".join(f"{t}/{q} -> broker {self.leader(t, q)}" for t, q in moved[:10]) + more

    def forget(self, topics: Iterable[str]) -> None:
        """Drop what is known of ``topics``."""
        gone = set(topics)
        for name in gone:
            self.topic_ids.pop(name, None)
        for key in [k for k in self.queues if k[0] in gone]:
            del self.queues[key]


def split_by_route(items: Iterable[T], route: Callable[[str, int], C | None],
                   ) -> tuple[dict[C, list[T]], list[T]]:
    """``items`` (each starting with topic and queue) grouped by ``route(topic, queue)`` (the
    connection to the queue's leader), and those it routes to None (no live leader known)."""
    groups: dict[C, list[T]] = {}
    unrouted: list[T] = []
    for item in items:
        to = route(item[0], item[1])
        if to is None:
            unrouted.append(item)
        else:
            groups.setdefault(to, []).append(item)
    return groups, unrouted
