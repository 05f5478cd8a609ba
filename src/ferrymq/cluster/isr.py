"""A queue's in-sync replica set (ISR) in the metadata store: the leader's compare-and-swap,
and settling a write whose answer was lost.

Theory of operation
-------------------
The leader decides ISR changes (:mod:`ferrymq.cluster.replication.isr` keeps its followers'
positions and proposes shrinks and expansions) and writes each with :func:`change_isr`: a CAS
on the queue key's version, so a leader that has been replaced (the controller bumped the
epoch) fails and steps down instead of overwriting; the controller's own writes are CAS too, so
neither loses the other's change. A member added must be alive (its broker key is checked in
the same commit).

A write whose answer was lost (a timeout: etcd may have applied the transaction, or may still)
is settled by :func:`settle_isr` from what the store holds, fencing the lost write when it has
not applied, so the leader never computes its high watermark over fewer members than the
store's ISR (KIP-497's maximal ISR: the proposal counts until its outcome is known).
"""

from __future__ import annotations

from dataclasses import replace

from ferrymq.cluster.metadata.store import Check, MetadataStore, Put
from ferrymq.cluster.model import Keys, QueueRecord


async def change_isr(store: MetadataStore, keys: Keys, topic: str, queue: int,
                     expected: QueueRecord, new_isr: list[int]) -> QueueRecord | None:
    """Write ``new_isr`` as the queue's ISR if its record is still ``expected`` (a CAS on its
    version); the record written (or ``expected`` when nothing changes), None when stale: the
    caller re-reads the record and, if it no longer leads, steps down.

    A member added must be alive: the commit also checks each added member's broker key, and
    members whose key is absent are left out (the controller would remove them at once).

    Raises:
        ValueError: ``new_isr`` leaves out the leader, or names a broker that is not a replica.
        MetadataUnavailableError: the store cannot be reached.
    """
    if expected.leader not in new_isr:
        raise ValueError(f"the ISR {new_isr} of {topic}/{queue} must hold its leader "
                         f"{expected.leader}")
    if not set(new_isr) <= set(expected.replicas):
        raise ValueError(f"the ISR {new_isr} of {topic}/{queue} names brokers that are not "
                         f"replicas ({expected.replicas})")
    checks = [Check(keys.queue(topic, queue), expected.version)]
    isr = []
    for b in dict.fromkeys(new_isr):
        if b not in expected.isr:
            kv = await store.get(keys.broker(b))
            if kv is None:
                continue
            checks.append(Check(kv.key, kv.mod_revision))
        isr.append(b)
    if isr == expected.isr:
        return expected
    record = replace(expected, isr=isr)
    rev = await store.commit(checks, [Put(keys.queue(topic, queue), record.encode())])
    if rev is None:
        return None
    return replace(record, version=rev)


async def settle_isr(store: MetadataStore, keys: Keys, topic: str, queue: int,
                     expected: QueueRecord, new_isr: list[int]) -> QueueRecord | None:
    """Whether an ISR write of ``new_isr`` over ``expected`` holds, when :func:`change_isr`
    failed its CAS or lost its answer (a timeout: the transaction may still apply later).

    Reads the record: at ``expected``'s version still, the write did not apply yet, and a CAS
    rewriting ``expected`` as it is moves the version so that it never can (None: refused);
    at another version, the record if it is this leader's at this epoch with the ISR that
    :func:`change_isr` writes for ``new_isr`` (committed: all of ``new_isr`` that was in
    ``expected``, and only members of ``new_isr``), else None. A leader keeps counting its proposal
    in the high watermark until this answers.

    Raises:
        MetadataUnavailableError: the store cannot be reached (the outcome is still unknown).
    """
    key = keys.queue(topic, queue)
    while True:
        kv = await store.get(key)
        if kv is None:
            return None
        current = QueueRecord.decode(kv)
        if current.version == expected.version:
            if await store.commit([Check(key, expected.version)],
                                  [Put(key, expected.encode())]) is not None:
                return None
            continue
        same = (current.leader, current.leader_epoch) == (expected.leader, expected.leader_epoch)
        kept = [b for b in new_isr if b in expected.isr]
        written = (current.isr != expected.isr and set(current.isr) <= set(new_isr)
                   and all(b in current.isr for b in kept))
        return current if same and written else None
