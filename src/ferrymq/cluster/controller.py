"""The cluster's controller: one broker, elected through the metadata store, that moves queue
leadership when brokers come and go.

Theory of operation
-------------------
**Election.** Every broker runs :meth:`Controller.run`. It campaigns by creating the
``controller`` key only if absent, with a lease (the broker's own, so the seat goes when the
broker's lease does) and a controller epoch one above the last (``counters/controller_epoch``,
bumped in the same commit). The winner's **seat** is that key's mod revision. The others watch
the key and campaign again when it goes.

**Fencing.** A lease says who should act; it does not stop a controller that was paused past its
lease from acting (Jepsen's lesson on etcd). So every write of the controller carries
``Check(controller, seat)`` besides the CAS on the queue key's version: once the seat is gone or
taken by another broker, every write of the former controller fails, and it steps down
(:class:`~ferrymq.errors.NotControllerError`). It also steps down at once when the watch shows
the key deleted or replaced.

**Decisions** are level-triggered: :meth:`Controller.reconcile` reads the live brokers (the
``brokers/`` keys: present = lease alive) and every queue, and :func:`decide_leadership` says what
each queue's record should be with those brokers alive:

* leader alive: ISR members that are not alive leave the ISR (it never empties: the leader is in
  it);
* leader gone (or none): the first replica, in replica order, that is in the ISR and alive
  leads; the ISR keeps only its live members; the epoch goes up by one;
* no ISR member alive: the queue goes offline (``NO_LEADER``, epoch + 1 so that the last leader
  is fenced if it comes back, ISR unchanged: its members hold every acknowledged record, and the
  first of them to come back leads). Only a topic whose config says
  ``unclean_leader_election=true`` takes a live replica outside the ISR instead (it may lack
  acknowledged records).

It runs when the controller takes its seat (which also repairs what happened while there was
none) and after every change of the ``brokers/`` or ``topics/`` keys seen by its watch. A broker
that **restarted** is first treated as gone, then as back: its in-memory state is new, so it
leaves the ISR it was in (unless it was the last member: then it leads again, at a new epoch).
No memory of the controller is needed to tell: a leader or ISR member whose broker key was
created (its incarnation, ``create_revision``) after the queue record was last written
(``version``) was in the ISR as a former incarnation, since a leader adds a broker to the ISR
only while it is registered (:func:`~ferrymq.cluster.isr.change_isr`). So a controller that
takes over also sees restarts that happened while there was none.

Writes race with the leaders' own ISR changes (:func:`~ferrymq.cluster.isr.change_isr`): when a
queue's CAS fails, the controller re-reads that queue and decides again.

A queue being reassigned (``QueueRecord.target``, started by
:func:`~ferrymq.cluster.operations.reassign_queue`) is finished here, by
:func:`decide_reassigned`, once every target replica is in its ISR: the controller's watch
reconciles on such a queue record. The admin's other moves (the preferred-leader election,
draining a broker) are :mod:`ferrymq.cluster.operations`: any broker runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial

from ferrymq.cluster.metadata.store import Check, KeyValue, MetadataStore, Put, WatchEvent
from ferrymq.cluster.model import (
    NO_LEADER,
    ControllerRecord,
    Counter,
    Keys,
    QueueRecord,
    TopicRecord,
)
from ferrymq.cluster.operations import elect_preferred_leaders
from ferrymq.cluster.snapshot import MAX_QUEUE_WRITE_ATTEMPTS, read_cluster
from ferrymq.errors import (
    MetadataLeaseExpiredError,
    MetadataUnavailableError,
    NotControllerError,
)

log = logging.getLogger(__name__)

UNCLEAN_LEADER_ELECTION = "unclean_leader_election"
"""Topic setting: ``"true"`` lets the controller elect a replica outside the ISR when no ISR
member is alive (availability over acknowledged records; off by default, as in Kafka)."""


RETRY_AFTER_UNAVAILABLE_S = 0.5
"""Pause before reading the store again after it could not be reached."""


def decide_leadership(record: QueueRecord, live: set[int], *,
                      unclean: bool = False) -> QueueRecord | None:
    """The record a queue should have with the brokers ``live`` alive, or None when it is right
    as it is (see the module docstring)."""
    if record.leader != NO_LEADER and record.leader in live:
        isr = [b for b in record.isr if b in live]
        if isr and isr != record.isr:
            return replace(record, isr=isr)
        return None
    candidates = [b for b in record.replicas if b in record.isr and b in live]
    if candidates:
        return record.with_leader(candidates[0], [b for b in record.isr if b in live])
    if unclean:
        alive = [b for b in record.replicas if b in live]
        if alive:
            return record.with_leader(alive[0], [alive[0]])
    if record.leader != NO_LEADER:
        return record.with_leader(NO_LEADER)
    return None


def decide_reassigned(record: QueueRecord, live: set[int]) -> QueueRecord | None:
    """The record after its reassignment finished: every broker of ``target`` in the ISR, so
    ``replicas`` becomes ``target``, the ISR keeps only its members, and leadership moves to the
    first of them alive in the ISR if the leader is not one (epoch + 1); None while a new replica
    is still catching up (or nothing is being reassigned)."""
    target = record.target
    if not target or not set(target) <= set(record.isr):
        return None
    isr = [b for b in record.isr if b in target]
    done = replace(record, replicas=list(target), isr=isr, target=None)
    if record.leader in target:
        return done
    leaders = [b for b in target if b in isr and b in live]
    if not leaders:
        return None  # wait for one of them to be alive: the old leader still serves
    return done.with_leader(leaders[0])


def is_unclean(topic: TopicRecord) -> bool:
    """Whether ``topic`` allows unclean leader elections."""
    return topic.config.get(UNCLEAN_LEADER_ELECTION, "false").lower() == "true"


class Controller:
    """The controller's logic for broker ``broker_id`` (see the module docstring).

    ``lease_of``: the lease to hold the seat with, read at each campaign (the broker's current
    lease, so that the seat goes with the broker); None: the controller grants its own lease of
    ``lease_ttl_s`` seconds and keeps it alive while it runs. ``clock``: monotonic seconds.
    """

    def __init__(self, store: MetadataStore, keys: Keys, broker_id: int, *, lease_ttl_s: int,
                 clock: Callable[[], float] = time.monotonic,
                 lease_of: Callable[[], int] | None = None) -> None:
        self.store = store
        self.keys = keys
        self.broker_id = broker_id
        self.lease_ttl_s = lease_ttl_s
        self.clock = clock
        self._lease_of = lease_of
        self._own_lease = 0
        self.epoch = 0
        """The controller epoch of the seat held (or last held)."""
        self.seat = 0
        """The controller key's mod revision while this broker holds it; 0 when it does not."""
        self.read_revision = 0
        """The store revision of the last reconcile's read."""
        self.renewed_at = 0.0
        """When the own lease was last renewed (``clock``), with ``lease_of`` None."""

    @property
    def active(self) -> bool:
        """Whether this broker believes it holds the seat (its writes prove it or fail)."""
        return self.seat != 0

    # --- the seat ------------------------------------------------------------------------------

    async def campaign(self) -> bool:
        """Take the seat if it is free; whether this broker holds it now.

        Raises:
            MetadataLeaseExpiredError: the broker's lease (``lease_of``) has expired.
            MetadataUnavailableError: the store cannot be reached.
        """
        key = self.keys.controller
        kv = await self.store.get(key)
        if kv is not None:
            if self.seat and kv.mod_revision == self.seat:
                return True
            self.seat = 0
            return False
        lease = await self._lease()
        if not lease:  # the broker is between leases (registering again): a seat without a
            return False  # lease would outlive it
        counter = await self.store.get(self.keys.controller_epoch)
        epoch = (Counter.decode(counter).value if counter is not None else 0) + 1
        checks = [Check(key, 0), Check(self.keys.controller_epoch,
                                       counter.mod_revision if counter is not None else 0)]
        puts = [Put(key, ControllerRecord(self.broker_id, epoch).encode(), lease),
                Put(self.keys.controller_epoch, Counter(epoch).encode())]
        try:
            rev = await self.store.commit(checks, puts)
        except MetadataLeaseExpiredError:
            if self._lease_of is not None:
                raise
            self._own_lease = 0  # ours expired: a new one next time
            return False
        if rev is None:
            return False
        self.seat, self.epoch = rev, epoch
        log.info("broker %d is the controller (epoch %d)", self.broker_id, epoch)
        return True

    async def resign(self) -> None:
        """Give the seat up now (at shutdown), so another broker takes it without waiting for
        the lease; nothing if this broker does not hold it."""
        if self.seat:
            seat, self.seat = self.seat, 0
            await self.store.commit([Check(self.keys.controller, seat)],
                                    deletes=[self.keys.controller])
        if self._own_lease:
            lease, self._own_lease = self._own_lease, 0
            await self.store.revoke_lease(lease)

    async def _lease(self) -> int:
        if self._lease_of is not None:
            return self._lease_of()
        if not self._own_lease:
            self._own_lease = await self.store.grant_lease(self.lease_ttl_s)
            self.renewed_at = self.clock()
        return self._own_lease

    def _deposed(self, why: str) -> NotControllerError:
        self.seat = 0
        return NotControllerError(f"broker {self.broker_id} is no longer the controller "
                                  f"(epoch {self.epoch}): {why}")

    # --- decisions ---------------------------------------------------------------------------

    async def reconcile(self) -> int:
        """Bring every queue in line with the live brokers (see the module docstring); the
        number of queue records written.

        Raises:
            NotControllerError: this broker does not hold the seat (a write failed on it).
            MetadataUnavailableError: the store cannot be reached.
        """
        if not self.seat:
            raise NotControllerError(f"broker {self.broker_id} is not the controller")
        brokers, topics, queues, self.read_revision = await self._read()
        live = set(brokers)
        written = 0
        for (name, q), record in sorted(queues.items()):
            topic = topics.get(name)
            if topic is None or q >= topic.queues:
                continue
            unclean = is_unclean(topic)
            current: QueueRecord | None = record
            restarted = {b for b in (record.leader, *record.isr)
                         if brokers.get(b, 0) > record.version}
            if restarted:
                gone = live - restarted
                current, n = await self._update(
                    name, q, record, partial(decide_leadership, live=gone, unclean=unclean))
                written += n
            if current is not None:
                current, n = await self._update(
                    name, q, current, partial(decide_leadership, live=live, unclean=unclean))
                written += n
            if current is not None and current.target is not None:
                _, n = await self._update(name, q, current, partial(decide_reassigned, live=live))
                written += n
        return written

    async def elect_preferred_leaders(self, topics: Iterable[str] | None = None) -> int:
        """:func:`elect_preferred_leaders` as this controller: its writes also check that it
        still holds the seat; the number of queues moved.

        Raises:
            NotControllerError: this broker does not hold the seat.
            UnknownTopicError: a named topic does not exist.
            MetadataUnavailableError: the store cannot be reached.
        """
        if not self.seat:
            raise NotControllerError(f"broker {self.broker_id} is not the controller")
        try:
            return await elect_preferred_leaders(self.store, self.keys, topics, seat=self.seat)
        except NotControllerError as exc:
            raise self._deposed(str(exc)) from None

    async def _read(self) -> tuple[dict[int, int], dict[str, TopicRecord],
                                   dict[tuple[str, int], QueueRecord], int]:
        """Live brokers (id -> incarnation), topics and queues at one revision, and that
        revision.

        Raises:
            NotControllerError: the seat is not this broker's at that revision.
        """
        snap = await read_cluster(self.store, self.keys)
        if snap.seat != self.seat:
            raise self._deposed("the seat is " + ("free" if not snap.seat else "another broker's"))
        brokers = {bid: kv.create_revision for bid, kv in snap.brokers.items()}
        return brokers, snap.topics, snap.queues, snap.revision

    async def _update(self, topic: str, queue: int, record: QueueRecord,
                      decide: Callable[[QueueRecord], QueueRecord | None],
                      ) -> tuple[QueueRecord | None, int]:
        """Write ``decide(record)`` by CAS, deciding again on a fresher record after each CAS
        failure: (the record now, None if the queue is gone; 1 if written else 0)."""
        key = self.keys.queue(topic, queue)
        for _ in range(MAX_QUEUE_WRITE_ATTEMPTS):
            new = decide(record)
            if new is None:
                return record, 0
            seat = self.seat
            if not seat:
                raise NotControllerError(f"broker {self.broker_id} is not the controller")
            rev = await self.store.commit([Check(key, record.version),
                                           Check(self.keys.controller, seat)],
                                          [Put(key, new.encode())])
            if rev is not None:
                if new.leader != record.leader:
                    log.info("%s/%d: leader %d -> %d (epoch %d, ISR %s)", topic, queue,
                             record.leader, new.leader, new.leader_epoch, new.isr)
                return replace(new, version=rev), 1
            held = await self.store.get(self.keys.controller)
            if held is None or held.mod_revision != seat:
                raise self._deposed("its write was refused: the seat is "
                                    + ("free" if held is None else "another broker's"))
            kv = await self.store.get(key)
            if kv is None:
                return None, 0
            record = QueueRecord.decode(kv)
        log.warning("%s/%d: gave up after %d concurrent changes; the next reconcile retries",
                    topic, queue, MAX_QUEUE_WRITE_ATTEMPTS)
        return record, 0

    # --- running -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Campaign until elected (through an unreachable store or a lapsed broker lease:
        trying again), then serve until deposed; returns when deposed (the caller runs it again
        to campaign again). Cancelling it leaves the seat to its lease (call :meth:`resign` to
        free it at once)."""
        while True:
            try:
                if await self.campaign():
                    break
                await self._wait_for_vacancy()
            except (MetadataUnavailableError, MetadataLeaseExpiredError) as exc:
                log.debug("controller campaign of broker %d: %s; trying again", self.broker_id,
                          exc)
                await asyncio.sleep(RETRY_AFTER_UNAVAILABLE_S)
        keeper = (asyncio.get_running_loop().create_task(self._keep_own_lease())
                  if self._lease_of is None else None)
        try:
            await self.serve()
        except NotControllerError as exc:
            log.warning("%s", exc)
        finally:
            if keeper is not None:
                keeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await keeper

    async def serve(self) -> None:
        """Reconcile, then follow the watch, reconciling after each change of brokers or
        topics, until deposed.

        Raises:
            NotControllerError: the seat is gone or another broker's.
        """
        while True:
            try:
                revision = await self._reconcile_from()
                async for batch in self.store.watch(self.keys.root, revision + 1):
                    if self._changes_need_reconcile(batch):
                        await self.reconcile()
            except MetadataUnavailableError as exc:
                log.warning("controller: metadata store unreachable (%s); reading again", exc)
                await asyncio.sleep(RETRY_AFTER_UNAVAILABLE_S)

    async def _reconcile_from(self) -> int:
        """Reconcile and return the revision it read at (the watch goes on after it)."""
        await self.reconcile()
        return self.read_revision

    def _changes_need_reconcile(self, batch: list[WatchEvent]) -> bool:
        k = self.keys
        need = False
        for e in batch:
            key = e.kv.key
            if key == k.controller:
                if e.deleted or e.kv.mod_revision != self.seat:
                    raise self._deposed("the watch saw its seat "
                                        + ("deleted" if e.deleted else "taken"))
            elif key.startswith(k.brokers) or key.startswith(k.topics):
                need = True
            elif key.startswith(k.queues) and not e.deleted:
                rec = QueueRecord.decode(e.kv)  # a reassignment whose new replicas caught up
                need = need or (rec.target is not None and set(rec.target) <= set(rec.isr))
        return need

    async def _wait_for_vacancy(self) -> None:
        """Return once the controller key is gone (or the watch ended: campaign again)."""
        held: KeyValue | None = await self.store.get(self.keys.controller)
        if held is None:
            return
        with contextlib.suppress(MetadataUnavailableError):
            async for batch in self.store.watch(self.keys.controller, held.mod_revision + 1):
                if any(e.deleted and e.kv.key == self.keys.controller for e in batch):
                    return
        await asyncio.sleep(RETRY_AFTER_UNAVAILABLE_S)

    async def _keep_own_lease(self) -> None:
        """Renew the own lease every third of its TTL; step down when it is gone."""
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            try:
                await self.store.keep_alive(self._own_lease)
                self.renewed_at = self.clock()
            except MetadataLeaseExpiredError:
                self._own_lease = 0
                self.seat = 0
                log.warning("controller: its lease expired; stepping down")
                return
            except MetadataUnavailableError as exc:
                log.warning("controller: cannot renew its lease (%s) for %.1f s", exc,
                            self.clock() - self.renewed_at)
