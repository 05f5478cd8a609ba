"""The leader's view of one queue's replicas: follower positions, the high watermark, which
followers leave or join the in-sync replica set (ISR), and the compare-and-swap that changes it.

Theory of operation
-------------------
:class:`IsrState` is pure bookkeeping (no I/O, time passed in), kept by the leader of one queue
for one leader epoch. Each replica fetch tells it where the follower is (its log end = the fetch
offset, and its durable offset). From that:

* the **high watermark** is the lowest durable offset over the ISR, the leader's own included
  (with ``flush async`` nothing waits for fsync: the lowest log end). It never goes back while
  this state lives, and never passes the leader's own end;
* a follower is **caught up** at a fetch that reaches the leader's log end, or the end the
  leader had at the follower's previous fetch (Kafka's ``lastCaughtUpTime`` rule: a follower
  fetching continuously under a steady stream of appends stays caught up, one fetch behind);
* **shrink**: ISR followers not caught up for longer than ``replica_lag_ms``;
* **expand**: followers outside the ISR whose log end (with ``flush sync``: durable offset) has
  reached the high watermark and the start offset of the leader's epoch (so they hold this
  epoch's beginning: nothing of an older leader's uncommitted tail);
* ``acks="all"`` may be answered only while the ISR has at least ``min_insync`` members.

The leader writes an ISR change with :func:`change_isr`: a CAS on the queue key's version, so a
leader that has been replaced (the controller bumped the epoch) fails and steps down instead of
overwriting; the controller's own writes are CAS too, so neither loses the other's change.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ferrymq.cluster.metadata.store import Check, MetadataStore, Put
from ferrymq.cluster.model import Keys, QueueRecord


@dataclass(slots=True)
class FollowerPosition:
    """Where one follower is, as its last fetch said."""

    log_end: int = 0
    durable: int = 0
    caught_up_ms: int = 0
    """When it last was caught up with the leader (see the module docstring)."""
    last_fetch_ms: int = 0
    leader_end_at_last_fetch: int = 0


class IsrState:
    """One queue's replicas as its leader sees them (see the module docstring).

    ``record``: the queue record this broker leads by (its leader must be ``leader``);
    ``epoch_start``: the offset at which the leader's epoch began (its log end when it took
    over); ``now_ms``: when it took over (every follower counts as caught up then, so the lag
    clock starts at the election, as in Kafka).
    """

    def __init__(self, leader: int, record: QueueRecord, epoch_start: int, now_ms: int) -> None:
        if record.leader != leader:
            raise ValueError(f"broker {leader} does not lead by {record} (leader "
                             f"{record.leader})")
        self.leader = leader
        self.record = record
        self.epoch_start = epoch_start
        self.followers = {b: FollowerPosition(caught_up_ms=now_ms, last_fetch_ms=now_ms)
                          for b in record.replicas if b != leader}
        self._hw = 0

    @property
    def isr(self) -> list[int]:
        """The in-sync replicas of the current record."""
        return self.record.isr

    def apply(self, record: QueueRecord) -> None:
        """Take a newer record of the same leader epoch (an ISR change written)."""
        if record.leader != self.leader or record.leader_epoch != self.record.leader_epoch:
            raise ValueError(f"record {record} is not of broker {self.leader}'s epoch "
                             f"{self.record.leader_epoch}")
        self.record = record

    def update_follower(self, broker_id: int, log_end: int, durable: int, leader_end: int,
                        now_ms: int) -> None:
        """A fetch of follower ``broker_id``: its log end (the fetch offset) and durable offset,
        at ``now_ms``, the leader's log end being ``leader_end``.

        Raises:
            ValueError: ``broker_id`` is not a follower of this queue.
        """
        pos = self.followers.get(broker_id)
        if pos is None:
            raise ValueError(f"broker {broker_id} is not a follower of this queue "
                             f"(replicas {self.record.replicas})")
        if log_end >= leader_end:
            pos.caught_up_ms = now_ms
        elif log_end >= pos.leader_end_at_last_fetch:
            pos.caught_up_ms = max(pos.caught_up_ms, pos.last_fetch_ms)
        pos.log_end = log_end
        pos.durable = min(durable, log_end)
        pos.last_fetch_ms = now_ms
        pos.leader_end_at_last_fetch = leader_end

    def high_watermark(self, leader_end: int, leader_durable: int, *, sync_mode: bool) -> int:
        """The high watermark now: the lowest durable offset over the ISR (``sync_mode``
        False, ``flush async``: the lowest log end), the leader's own included; never lower than
        it was, never above ``leader_end``."""
        low = leader_durable if sync_mode else leader_end
        for b in self.record.isr:
            pos = self.followers.get(b)
            if pos is not None:
                low = min(low, pos.durable if sync_mode else pos.log_end)
        self._hw = min(max(self._hw, low), leader_end)
        return self._hw

    def shrink_candidates(self, now_ms: int, replica_lag_ms: int) -> list[int]:
        """ISR followers not caught up for longer than ``replica_lag_ms``."""
        return [b for b in self.record.isr
                if b in self.followers
                and now_ms - self.followers[b].caught_up_ms > replica_lag_ms]

    def expand_candidates(self, *, sync_mode: bool = False) -> list[int]:
        """Followers outside the ISR that reached the high watermark (last computed) and the
        start of the leader's epoch (with ``sync_mode``: by their durable offset)."""
        need = max(self._hw, self.epoch_start)
        return [b for b in self.record.replicas
                if b in self.followers and b not in self.record.isr
                and (self.followers[b].durable if sync_mode
                     else self.followers[b].log_end) >= need]

    def acks_all_ok(self, min_insync: int) -> bool:
        """Whether an ``acks="all"`` write may be answered: the ISR has at least
        ``min_insync`` members."""
        return len(self.record.isr) >= min_insync


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
