"""What an admin asks of the cluster's leaderships and replicas: the preferred-leader election
(``ferrymq cluster preferred-leaders``), draining a broker (``cluster drain``) and moving a
queue to other brokers (``cluster reassign``).

Any broker runs them, not only the controller: each queue's write is a compare-and-swap that
holds only if, at the commit, the queue record, the registrations of the brokers it gives
leadership or replicas to, and the controller's seat as read are all still what the decision was
made on. So none of them can undo a controller's decision made meanwhile or give leadership to a
broker that left (docs/design.md). A reassignment only starts here: the controller finishes it
(:func:`~ferrymq.cluster.controller.decide_reassigned`) once every new replica is in sync.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace

from ferrymq.cluster.metadata.store import Check, MetadataStore, Put
from ferrymq.cluster.model import NO_LEADER, Keys, QueueRecord
from ferrymq.cluster.snapshot import MAX_QUEUE_WRITE_ATTEMPTS, read_cluster
from ferrymq.errors import (
    InvalidReplicationFactorError,
    InvalidRequestError,
    NotControllerError,
    UnknownQueueError,
    UnknownTopicError,
)

log = logging.getLogger("ferrymq.cluster.controller")


def decide_preferred(record: QueueRecord, live: set[int]) -> QueueRecord | None:
    """The record with leadership on the preferred (first) replica, if it is alive, in the ISR
    and not leading already; else None."""
    preferred = record.replicas[0] if record.replicas else NO_LEADER
    if record.leader != preferred and preferred in live and preferred in record.isr:
        return record.with_leader(preferred)
    return None

def decide_drained(record: QueueRecord, broker_id: int, live: set[int]) -> QueueRecord | None:
    """The record with leadership moved from ``broker_id`` to the first other replica alive and
    in the ISR (``broker_id`` stays in the ISR, as a follower); None when ``broker_id`` does not
    lead it or no other replica can take it."""
    if record.leader != broker_id:
        return None
    for b in record.replicas:
        if b != broker_id and b in record.isr and b in live:
            return record.with_leader(b)
    return None

def start_reassignment(record: QueueRecord, target: list[int]) -> QueueRecord:
    """The record as a reassignment to ``target`` starts: the new replicas join ``replicas``
    (after the old ones: leadership does not move yet) and begin copying as followers."""
    return replace(record, replicas=[*record.replicas,
                                     *(b for b in target if b not in record.replicas)],
                   target=list(target))

async def elect_preferred_leaders(store: MetadataStore, keys: Keys,
                                  topics: Iterable[str] | None = None, *,
                                  seat: int | None = None) -> int:
    """Move each queue's leadership (of ``topics``; None: of every topic) to its first replica
    where that one is alive, in the ISR and not leading already; the number of queues moved.
    Safe from any broker (see the module docstring); ``seat``: the controller key's revision
    the writes must find (a controller's own call), else whatever seat was read.

    Raises:
        NotControllerError: ``seat`` given and the seat is not at that revision.
        UnknownTopicError: a named topic does not exist.
        MetadataUnavailableError: the store cannot be reached.
    """
    snap = await read_cluster(store, keys)
    held, brokers, known = snap.seat, snap.brokers, snap.topics
    if seat is not None and held != seat:
        raise NotControllerError("the seat is " + ("free" if not held else "another broker's"))
    wanted = set(known) if topics is None else set(topics)
    missing = sorted(wanted - set(known))
    if missing:
        raise UnknownTopicError(f"unknown topic {missing[0][:249]!r}")
    live = set(brokers)
    moved = 0
    for (name, q), record in sorted(snap.queues.items()):
        if name not in wanted or q >= known[name].queues:
            continue
        new = decide_preferred(record, live)
        if new is None:
            continue
        key = keys.queue(name, q)
        rev = await store.commit([Check(key, record.version), Check(keys.controller, held),
                                  Check(keys.broker(new.leader), brokers[new.leader].mod_revision)],
                                 [Put(key, new.encode())])
        if rev is not None:
            log.info("%s/%d: preferred leader %d back (was %d, epoch %d)", name, q,
                     new.leader, record.leader, new.leader_epoch)
            moved += 1
        elif seat is not None:
            now = await store.get(keys.controller)
            if now is None or now.mod_revision != seat:
                raise NotControllerError("the seat changed while electing preferred leaders")
        # else: the queue, its preferred broker or the seat changed meanwhile: whoever changed
        # it decided on fresher facts; the next run decides again
    return moved

async def elect_leader(store: MetadataStore, keys: Keys, topic: str, queue: int,
                       broker_id: int) -> bool:
    """Give the leadership of ``topic``/``queue`` to ``broker_id`` if it is alive and in the
    ISR (a new epoch); whether it leads it now. Safe from any broker (see the module
    docstring): a write that lost a race changes nothing, and the caller asks again.

    Raises:
        MetadataUnavailableError: the store cannot be reached.
    """
    snap = await read_cluster(store, keys)
    record = snap.queues.get((topic, queue))
    if record is None:
        return False
    if record.leader == broker_id:
        return True
    reg = snap.brokers.get(broker_id)
    if reg is None or broker_id not in record.isr:
        return False
    new = record.with_leader(broker_id)
    key = keys.queue(topic, queue)
    rev = await store.commit([Check(key, record.version), Check(keys.controller, snap.seat),
                              Check(keys.broker(broker_id), reg.mod_revision)],
                             [Put(key, new.encode())])
    if rev is None:
        return False
    log.info("%s/%d: leadership moved to broker %d (was %d, epoch %d)", topic, queue,
             broker_id, record.leader, new.leader_epoch)
    return True


async def drain_leaders(store: MetadataStore, keys: Keys, broker_id: int) -> tuple[int, int]:
    """Move the leadership of every queue ``broker_id`` leads to another replica alive and in
    its ISR (:func:`decide_drained`), before maintenance of that broker: (queues moved, queues
    it still leads because no other replica could take them). Safe from any broker, as
    :func:`elect_preferred_leaders`: each write checks the queue's record, the seat as read and
    the new leader's registration. The controller leaves a live leader where it is, so the
    leaderships stay moved until the broker restarts or preferred leaders are elected.

    Raises:
        InvalidRequestError: ``broker_id`` is not a live broker of the cluster.
        MetadataUnavailableError: the store cannot be reached.
    """
    snap = await read_cluster(store, keys)
    if broker_id not in snap.brokers:
        raise InvalidRequestError(f"broker {broker_id} is not a live broker of this cluster "
                                  f"(live: {sorted(snap.brokers)})")
    live = set(snap.brokers)
    moved = left = 0
    for (name, q), record in sorted(snap.queues.items()):
        topic = snap.topics.get(name)
        if topic is None or q >= topic.queues or record.leader != broker_id:
            continue
        key = keys.queue(name, q)
        for _ in range(MAX_QUEUE_WRITE_ATTEMPTS):
            new = decide_drained(record, broker_id, live)
            if new is None:  # no other replica can lead it, or it moved meanwhile
                left += record.leader == broker_id
                break
            rev = await store.commit(
                [Check(key, record.version), Check(keys.controller, snap.seat),
                 Check(keys.broker(new.leader), snap.brokers[new.leader].mod_revision)],
                [Put(key, new.encode())])
            if rev is not None:
                log.info("%s/%d: leader %d -> %d to drain broker %d (epoch %d)", name, q,
                         record.leader, new.leader, broker_id, new.leader_epoch)
                moved += 1
                break
            kv = await store.get(key)  # changed meanwhile (an ISR write): decide again
            if kv is None:
                break
            record = QueueRecord.decode(kv)
        else:
            left += 1
    return moved, left

async def reassign_queue(store: MetadataStore, keys: Keys, topic: str, queue: int,
                         target: list[int]) -> tuple[QueueRecord, QueueRecord]:
    """Start moving ``queue`` of ``topic`` to the replicas ``target`` (the first is the
    preferred leader): the new ones join and copy the queue as followers; once all of them are
    in the ISR the controller makes ``target`` the replicas (:func:`decide_reassigned`). Safe
    from any broker: the write checks the queue's record and the new replicas' registrations.
    Returns the record before and the record written.

    Raises:
        UnknownTopicError, UnknownQueueError: no such topic or queue.
        InvalidReplicationFactorError: ``target`` is empty, repeats a broker, names a broker
            that is not live, or has fewer brokers than the topic's ``min_insync``.
        InvalidRequestError: the queue kept changing (try again).
        MetadataUnavailableError: the store cannot be reached.
    """
    if not target or len(set(target)) != len(target):
        raise InvalidReplicationFactorError(
            f"replicas must be distinct broker ids, at least one, not {target}")
    key = keys.queue(topic, queue)
    for _ in range(MAX_QUEUE_WRITE_ATTEMPTS):
        snap = await read_cluster(store, keys)
        t = snap.topics.get(topic)
        if t is None:
            raise UnknownTopicError(f"unknown topic {topic[:249]!r}")
        record = snap.queues.get((topic, queue))
        if record is None or not 0 <= queue < t.queues:
            raise UnknownQueueError(f"topic {topic!r} has queues 0..{t.queues - 1}, not {queue}")
        dead = [b for b in target if b not in snap.brokers]
        if dead:
            raise InvalidReplicationFactorError(
                f"broker(s) {dead} are not live brokers of this cluster (live: "
                f"{sorted(snap.brokers)})")
        if len(target) < t.min_insync:
            raise InvalidReplicationFactorError(
                f"{len(target)} replica(s) are fewer than topic {topic!r}'s min_insync "
                f"{t.min_insync}: acks=all sends could never be acknowledged")
        new = start_reassignment(record, target)
        checks = [Check(key, record.version),
                  *(Check(keys.broker(b), snap.brokers[b].mod_revision) for b in target)]
        if (rev := await store.commit(checks, [Put(key, new.encode())])) is not None:
            log.info("%s/%d: reassigning from %s to %s", topic, queue, record.replicas, target)
            return record, replace(new, version=rev)
        # the queue (an ISR change) or a new replica's registration changed: check again
    raise InvalidRequestError(f"{topic}/{queue} kept changing while its reassignment was "
                              "written: try again")
