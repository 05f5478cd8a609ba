"""A broker's membership of a cluster: registration, the lease, the metadata view, queue roles.

Theory of operation
-------------------
:class:`ClusterNode` is what ``--metadata`` adds to a broker. At start it:

1. reaches the metadata store (unreachable: :class:`~ferrymq.errors.MetadataUnavailableError`,
   the broker exits non-zero), creates the cluster's identity if the cluster is new, and checks
   that the data directory belongs to this cluster (``meta/cluster``; another cluster's:
   :class:`~ferrymq.errors.ClusterStartError`);
2. registers ``brokers/<id>`` (its address, and its Kafka port's when it has one) with a lease
   of ``metadata_lease_ms``, only if absent: a live
   broker with the same id makes the second one refuse to start. The create's revision is this
   start's **incarnation** (it only grows);
3. reads the whole cluster (brokers, topics, queues), creates locally every topic it does not
   have and deletes those the cluster no longer has, then takes its role for each queue from the
   queue records (leader, follower, none) through the
   :class:`~ferrymq.cluster.replication.ReplicaManager`;
4. keeps its lease alive, follows every change through a watch, and runs for controller
   (:class:`~ferrymq.cluster.controller.Controller`).

Losing the store: the lease is renewed every third of its TTL. When no renewal has succeeded
for half the TTL, the node **fences** its replica manager: ``acks="all"`` writes are no longer
acknowledged (they fail retriably) well before the lease could expire and the controller give
the queues to other brokers; reads of committed data go on. It is logged once when it starts and
once when it ends. If the lease did expire, the node drops its roles, registers again (a new
incarnation) and takes the roles the controller gave it meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from ferrymq.cluster.metadata.store import (
    Check,
    KeyValue,
    MetadataStore,
    Put,
    WatchEvent,
    open_store,
)
from ferrymq.cluster.model import (
    NO_LEADER,
    BrokerRecord,
    ClusterIdentity,
    ControllerRecord,
    Keys,
    ProducerIdBlock,
    QueueRecord,
    TopicRecord,
)
from ferrymq.errors import (
    ClusterStartError,
    LeaderNotAvailableError,
    MetadataError,
    MetadataLeaseExpiredError,
    MetadataUnavailableError,
    NotLeaderError,
    UnknownTopicError,
)
from ferrymq.storage import atomic_write

log = logging.getLogger(__name__)

CANCEL_AGAIN_AFTER_S = 0.5
"""How long :meth:`ClusterNode.stop` waits for a cancelled background task before cancelling it
again (a cancel can be lost inside ``asyncio.wait_for`` on Python 3.11)."""
CLUSTER_FILE = Path("meta") / "cluster"
"""The data directory's record of the cluster it belongs to."""


@dataclass(slots=True)
class QueueRole:
    """What this broker is for one queue, as last applied."""

    role: str  # "leader", "follower" or "none"
    leader_epoch: int


class ClusterView:
    """The cluster as this broker last read it: brokers, controller, topics and queues."""

    def __init__(self) -> None:
        self.brokers: dict[int, BrokerRecord] = {}
        self.controller: int = NO_LEADER
        self.topics: dict[str, TopicRecord] = {}
        self.queues: dict[tuple[str, int], QueueRecord] = {}
        self.users: dict[str, bytes] = {}
        """The cluster's users by name, each a users-file entry (the broker parses them)."""

    def address_of(self, broker_id: int) -> tuple[str, int] | None:
        """The address of a live broker, or None."""
        b = self.brokers.get(broker_id)
        return None if b is None else (b.host, b.port)


class ClusterNode:
    """This broker's part in a cluster (see the module docstring)."""

    def __init__(self, *, broker_id: int, cluster: str, metadata_url: str, data_dir: Path,
                 advertised: tuple[str, int], lease_ms: int,
                 kafka_advertised: tuple[str, int] | None = None,
                 store: MetadataStore | None = None,
                 monotonic: Callable[[], float]) -> None:
        self.broker_id = broker_id
        self.keys = Keys(cluster)
        self.cluster = cluster
        self._url = metadata_url
        self._data_dir = data_dir
        self.advertised = advertised
        self.kafka_advertised = kafka_advertised
        """Where Kafka clients reach this broker's Kafka port (None: it has none)."""
        self.lease_ttl_s = max(2, lease_ms // 1000)
        self.store: MetadataStore = store if store is not None else open_store(metadata_url)
        self._owns_store = store is None
        self._monotonic = monotonic
        self.view = ClusterView()
        self.incarnation = 0
        self.lease = 0
        self.fenced = False
        self._last_renewal = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        """Set by :meth:`stop`: the background loops end."""
        self._revision = 0
        self._topics_changed = asyncio.Event()
        self.roles: dict[tuple[str, int], QueueRole] = {}
        self.on_topics_changed: Callable[[], None] = lambda: None
        """Called after the local topics were reconciled with the cluster's."""
        self.on_role: Callable[[str, int, QueueRole | None, QueueRole, QueueRecord, int],
                               None] = lambda *a: None
        """Called on a role change: (topic, queue, old role, new role, record, min_insync)."""
        self.on_fence: Callable[[bool], None] = lambda fenced: None
        self.on_users_changed: Callable[[], None] = lambda: None
        """Called after a read or a watch batch changed :attr:`ClusterView.users`."""
        """Called when the node fences (True) or unfences (False) acks=all writes."""
        self.ensure_topic: Callable[[TopicRecord], None] = lambda t: None
        """Creates a cluster topic locally if missing (set by the broker)."""
        self.drop_topic: Callable[[str], None] = lambda name: None
        """Deletes a local topic the cluster no longer has (set by the broker)."""
        self.local_topics: Callable[[], dict[str, int]] = dict
        """Local topics that belong to the cluster: name -> topic id (set by the broker)."""

    # --- start and stop --------------------------------------------------------------------

    async def start(self) -> None:
        """Join the cluster (see the module docstring).

        Raises:
            MetadataUnavailableError: the store cannot be reached.
            ClusterStartError: the id is held by a live broker, or the data directory belongs
                to another cluster.
        """
        try:
            identity = await self._identity()
        except MetadataUnavailableError as exc:
            raise MetadataUnavailableError(
                f"cannot reach the metadata store {self._url} (--metadata): {exc}; is etcd "
                f"running there?") from exc
        restart = self._check_data_dir(identity)
        await self._register(wait_for_former_self=restart)
        await self._load()

    def start_background(self, controller_run: Callable[[], Awaitable[None]] | None = None
                         ) -> None:
        """Start the lease keeper, the watch and (if given) the controller's campaign."""
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._keep_lease()))
        self._tasks.append(loop.create_task(self._follow()))
        if controller_run is not None:
            self._tasks.append(loop.create_task(self._run_controller(controller_run)))

    async def stop(self) -> None:
        """Leave the cluster: stop the tasks and revoke the lease (the controller moves the
        queues this broker led at once instead of after the lease's TTL)."""
        self._stopping = True  # the loops end by themselves too: on Python 3.11 a cancel that
        # lands as an asyncio.wait_for inside them gets its result is lost (CPython gh-86296),
        # and the loop would go on sleeping while this waits for it
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            # a task that swallowed its cancel that way (the controller's loops retry an
            # unreachable store for ever) is cancelled again until it ends
            while not t.done():
                await asyncio.wait([t], timeout=CANCEL_AGAIN_AFTER_S)
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self.lease:
            with contextlib.suppress(MetadataError, OSError):
                await asyncio.wait_for(self.store.revoke_lease(self.lease), 2)
        if self._owns_store:  # a store given by the caller is the caller's to close
            with contextlib.suppress(MetadataError, OSError):
                await self.store.close()

    async def _identity(self) -> ClusterIdentity:
        kv = await self.store.get(self.keys.identity)
        if kv is None:
            fresh = ClusterIdentity(self.cluster, uuid.uuid4().hex)
            await self.store.commit([Check(self.keys.identity, 0)],
                                    [Put(self.keys.identity, fresh.encode())])
            kv = await self.store.get(self.keys.identity)
            if kv is None:  # pragma: no cover - the store lost a committed key
                raise MetadataUnavailableError("the cluster identity vanished after its create")
        return ClusterIdentity.decode(kv)

    def _check_data_dir(self, identity: ClusterIdentity) -> bool:
        """Check (or record) that the data directory is this broker's of this cluster; True if
        it already was (a restart)."""
        path = self._data_dir / CLUSTER_FILE
        mine = {"cluster": identity.name, "cluster_id": identity.cluster_id,
                "broker_id": self.broker_id}
        if path.exists():
            saved = json.loads(path.read_text())
            if saved.get("cluster_id") != identity.cluster_id:
                raise ClusterStartError(
                    f"data directory {self._data_dir} belongs to cluster "
                    f"{saved.get('cluster')!r} ({saved.get('cluster_id')}), not to "
                    f"{identity.name!r} ({identity.cluster_id}): use another --data-dir")
            if saved.get("broker_id") != self.broker_id:
                raise ClusterStartError(
                    f"data directory {self._data_dir} holds broker {saved.get('broker_id')} "
                    f"of cluster {identity.name!r}, not broker {self.broker_id}")
            return True
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(mine).encode())
        return False

    async def _register(self, *, wait_for_former_self: bool = False) -> None:
        """Create this broker's key under a new lease.

        ``wait_for_former_self``: the data directory is this broker's (a restart), so a key
        held now is most likely this broker's own before a kill -9 or a crash, whose lease has
        not run out yet: wait up to one and a half TTLs for it to go (a live holder renews it
        and keeps it). Otherwise a held key is refused at once."""
        key = self.keys.broker(self.broker_id)
        self.lease = await self.store.grant_lease(self.lease_ttl_s)
        record = self._record(0)
        rev = await self.store.commit([Check(key, 0)], [Put(key, record.encode(), self.lease)])
        if rev is None and wait_for_former_self:
            log.info("broker id %d is still registered (this broker before a restart?): "
                     "waiting up to %.0f s for that lease to end", self.broker_id,
                     1.5 * self.lease_ttl_s)
            deadline = self._monotonic() + 1.5 * self.lease_ttl_s
            while rev is None and self._monotonic() < deadline:
                await asyncio.sleep(0.25)
                await self.store.keep_alive(self.lease)  # ours must outlive the wait
                rev = await self.store.commit([Check(key, 0)],
                                              [Put(key, record.encode(), self.lease)])
        if rev is None:
            with contextlib.suppress(MetadataError):
                await self.store.revoke_lease(self.lease)
            self.lease = 0
            holder = await self.store.get(key)
            where = ""
            if holder is not None:
                b = BrokerRecord.decode(holder)
                where = f" at {b.host}:{b.port}"
            raise ClusterStartError(
                f"broker id {self.broker_id} is held by a live broker{where} of cluster "
                f"{self.cluster!r}: give this broker another --broker-id")
        self.incarnation = rev
        # the record carries the incarnation (a second write under the same lease)
        record = self._record(rev)
        await self.store.commit([], [Put(key, record.encode(), self.lease)])
        self._last_renewal = self._monotonic()
        log.info("joined cluster %s as broker %d (incarnation %d, advertised %s:%d)",
                 self.cluster, self.broker_id, rev, *self.advertised)

    def _record(self, incarnation: int) -> BrokerRecord:
        kafka = self.kafka_advertised or ("", 0)
        return BrokerRecord(self.broker_id, self.advertised[0], self.advertised[1], incarnation,
                            kafka[0], kafka[1])

    # --- the view ---------------------------------------------------------------------------

    async def _load(self) -> int:
        kvs, revision = await self.store.range(self.keys.root)
        view = ClusterView()
        for kv in kvs:
            self._apply_kv(view, kv.key, kv, deleted=False)
        self.view = view
        self._reconcile_topics()
        self._apply_roles()
        self._revision = revision
        self.on_users_changed()
        return revision

    def _apply_kv(self, view: ClusterView, key: str, kv: KeyValue, *, deleted: bool) -> None:
        k = self.keys
        if key.startswith(k.brokers):
            bid = int(key[len(k.brokers):])
            if deleted:
                view.brokers.pop(bid, None)
            else:
                view.brokers[bid] = BrokerRecord.decode(kv)
        elif key == k.controller:
            view.controller = (NO_LEADER if deleted
                               else ControllerRecord.decode(kv).broker_id)
        elif key.startswith(k.topics):
            name = key[len(k.topics):]
            if deleted:
                view.topics.pop(name, None)
            else:
                view.topics[name] = TopicRecord.decode(kv)
        elif key.startswith(k.queues):
            tq = k.parse_queue(key)
            if deleted:
                view.queues.pop(tq, None)
            else:
                view.queues[tq] = QueueRecord.decode(kv)
        elif key.startswith(k.users):
            name = key[len(k.users):]
            if deleted:
                view.users.pop(name, None)
            else:
                view.users[name] = kv.value

    def _apply_events(self, events: list[WatchEvent]) -> None:
        topics_changed = users_changed = False
        for e in events:
            if e.kv.key.startswith(self.keys.topics):
                topics_changed = True
            elif e.kv.key.startswith(self.keys.users):
                users_changed = True
            self._apply_kv(self.view, e.kv.key, e.kv, deleted=e.deleted)
            self._revision = max(self._revision, e.kv.mod_revision)
        if topics_changed:
            self._reconcile_topics()
        self._apply_roles()
        if users_changed:
            self.on_users_changed()

    def _reconcile_topics(self) -> None:
        local = self.local_topics()
        for name, t in self.view.topics.items():
            if local.get(name) != t.topic_id:
                if name in local:
                    self.drop_topic(name)
                self.ensure_topic(t)
        for name in local:
            if name not in self.view.topics:
                self.drop_topic(name)
        self.on_topics_changed()
        self._topics_changed.set()
        self._topics_changed = asyncio.Event()

    def _apply_roles(self) -> None:
        seen = set()
        for (topic, queue), rec in self.view.queues.items():
            t = self.view.topics.get(topic)
            if t is None or queue >= t.queues:
                continue
            seen.add((topic, queue))
            if rec.leader == self.broker_id:
                new = QueueRole("leader", rec.leader_epoch)
            elif self.broker_id in rec.replicas:
                new = QueueRole("follower", rec.leader_epoch)
            else:
                new = QueueRole("none", rec.leader_epoch)
            old = self.roles.get((topic, queue))
            self.roles[(topic, queue)] = new
            self.on_role(topic, queue, old, new, rec, t.min_insync)
        for tq in [tq for tq in self.roles if tq not in seen]:
            old = self.roles.pop(tq)
            if old.role != "none":
                gone = QueueRole("none", old.leader_epoch)
                self.on_role(tq[0], tq[1], old, gone, QueueRecord([], NO_LEADER, 0, []), 1)

    # --- the data path's questions -----------------------------------------------------------

    def check_leader(self, topic: str, queue: int) -> QueueRecord:
        """The queue's record if this broker leads it.

        Raises:
            UnknownTopicError: the cluster has no such topic (or queue).
            NotLeaderError: another broker leads it (the message names it).
            LeaderNotAvailableError: no broker leads it now.
        """
        rec = self.view.queues.get((topic, queue))
        if rec is None:
            raise UnknownTopicError(f"unknown topic {topic[:249]!r} or queue {queue}")
        role = self.roles.get((topic, queue))
        if rec.leader == self.broker_id and role is not None and role.role == "leader":
            return rec
        if rec.leader == NO_LEADER:
            raise LeaderNotAvailableError(f"{topic}/{queue} has no leader now (ISR {rec.isr})")
        raise NotLeaderError(f"broker {self.broker_id} does not lead {topic}/{queue}: broker "
                             f"{rec.leader} does (epoch {rec.leader_epoch})")

    async def wait_for_topic(self, name: str, topic_id: int | None, timeout_s: float) -> bool:
        """Wait until this broker applied topic ``name`` with ``topic_id`` (None: any id; after
        a create through the store, the watch brings it); False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            t = self.view.topics.get(name)
            if t is not None and (topic_id is None or t.topic_id == topic_id):
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._topics_changed.wait(), left)

    async def reserve_producer_ids(self, size: int = 1000) -> tuple[int, int]:
        """Reserve the block [start, start + size) of producer ids in the store (CAS)."""
        key = self.keys.producer_ids
        while True:
            kv = await self.store.get(key)
            start = ProducerIdBlock.decode(kv).next_id if kv is not None else 0
            rev = await self.store.commit(
                [Check(key, kv.mod_revision if kv is not None else 0)],
                [Put(key, ProducerIdBlock(start + size).encode())])
            if rev is not None:
                return start, start + size

    # --- background --------------------------------------------------------------------------

    async def _keep_lease(self) -> None:
        interval = self.lease_ttl_s / 3
        while True:
            await asyncio.sleep(min(interval, 0.5) if self.fenced else interval)
            if self._stopping:
                return
            try:
                await asyncio.wait_for(self.store.keep_alive(self.lease), interval)
                self._last_renewal = self._monotonic()
                if self.fenced:
                    self.fenced = False
                    log.warning("metadata store reachable again: acknowledging acks=all "
                                "writes again")
                    self.on_fence(False)
            except MetadataLeaseExpiredError:
                log.error("this broker's lease in the metadata store expired: the cluster "
                          "moved its queues; registering again")
                await self._rejoin()
            except (MetadataUnavailableError, TimeoutError, OSError) as exc:
                if (not self.fenced
                        and self._monotonic() - self._last_renewal > self.lease_ttl_s / 2):
                    self.fenced = True
                    log.error("metadata store unreachable for %.1f s (%s): not acknowledging "
                              "acks=all writes until it is back (the lease could expire)",
                              self._monotonic() - self._last_renewal, exc)
                    self.on_fence(True)

    async def _rejoin(self) -> None:
        if not self.fenced:
            self.fenced = True
            self.on_fence(True)
        for (topic, queue), old in list(self.roles.items()):
            gone = QueueRole("none", old.leader_epoch)
            self.roles[(topic, queue)] = gone
            self.on_role(topic, queue, old, gone, QueueRecord([], NO_LEADER, 0, []), 1)
        self.roles.clear()
        while True:
            try:
                await self._register()
                await self._load()
                break
            except ClusterStartError:  # our old key not gone yet: it goes with its lease
                await asyncio.sleep(self.lease_ttl_s / 3)
            except (MetadataUnavailableError, OSError):
                await asyncio.sleep(0.5)
        self.fenced = False
        self.on_fence(False)

    async def _follow(self) -> None:
        while not self._stopping:
            try:
                async for events in self.store.watch(self.keys.root, self._revision + 1):
                    self._apply_events(events)
            except (MetadataUnavailableError, OSError) as exc:
                log.debug("metadata watch ended (%s); reading again", exc)
            await asyncio.sleep(0.2)
            with contextlib.suppress(MetadataUnavailableError, OSError):
                await self._load()

    async def _run_controller(self, run: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the controller stopped; campaigning again")
            await asyncio.sleep(0.5)
