"""How a broker takes part in a cluster: the glue between the broker and :mod:`ferrymq.cluster`.

Only a broker started with ``--metadata`` has a :class:`ClusterLink`. It owns the
:class:`~ferrymq.cluster.node.ClusterNode` (membership, the metadata view, roles), the
:class:`~ferrymq.cluster.replication.ReplicaManager` (the data path of replication) and the
:class:`~ferrymq.cluster.controller.Controller` campaign, and answers the handlers' cluster
questions: who leads a queue, creating and deleting topics through the metadata store, the
CLUSTER_METADATA answer. Consumer groups are coordinated by the leaders of ``%GROUPS%offsets``
(:mod:`ferrymq.broker.cluster_groups`), transactions by the leader of ``%TXN%state``
(:mod:`ferrymq.broker.txn.cluster`), half messages by the leader of ``%HALF%transactions``
(:mod:`ferrymq.broker.half_messages.cluster`); :attr:`ClusterLink.groups`, :attr:`ClusterLink.txn`
and :attr:`ClusterLink.halves` hear of this broker's roles for those topics. A queue this
broker starts leading gets its open transactions from its copy's producer state (its LSO holds
at them until their markers).

Every broker of a cluster holds every cluster topic with all its queues (the queues it does not
replicate stay empty and refuse produce and fetch with NOT_LEADER), so the topic registry and
every feature built on it work unchanged; only the queues' roles differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from ferrymq.broker.cluster_delivery import ClusterDelivery
from ferrymq.broker.cluster_groups import ClusterGroups
from ferrymq.broker.cluster_users import ClusterUsers
from ferrymq.broker.half_messages.cluster import HalfCluster
from ferrymq.broker.tls import peer_context
from ferrymq.broker.topics import CLUSTER_TOPIC_ID_BASE, INTERNAL_PREFIX
from ferrymq.broker.txn.cluster import TxnCluster
from ferrymq.cluster.controller import Controller
from ferrymq.cluster.isr import change_isr, settle_isr
from ferrymq.cluster.liveness import DeadBrokerProbe
from ferrymq.cluster.metadata.store import MetadataStore
from ferrymq.cluster.model import NO_LEADER, QueueRecord, TopicRecord
from ferrymq.cluster.node import ClusterNode, QueueRole
from ferrymq.cluster.operations import drain_leaders, elect_preferred_leaders, reassign_queue
from ferrymq.cluster.replication import ReplicaManager
from ferrymq.cluster.replication.follower import PeerLogin
from ferrymq.cluster.topics import create_topic, delete_topic
from ferrymq.errors import (
    ConfigError,
    MetadataError,
    MetadataUnavailableError,
    RequestTimedOutError,
    UnknownTopicError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, TXN_TOPIC
from ferrymq.protocol.half_messages import HALF_TOPIC
from ferrymq.protocol.letters import DLQ_TOPIC_PREFIX, RETRY_TOPIC_PREFIX

if TYPE_CHECKING:
    from ferrymq.broker.config import BrokerConfig
    from ferrymq.broker.server import BrokerServer
    from ferrymq.broker.topics import QueueState

log = logging.getLogger(__name__)

TOPIC_APPLY_TIMEOUT_S = 10.0
"""How long a topic create waits for this broker to apply the new topic from the store."""


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` as a tuple (checked by the configuration already)."""
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


class ClusterLink:
    """A broker's part in a cluster (see the module docstring)."""

    def __init__(self, server: BrokerServer, store: MetadataStore | None = None) -> None:
        self.server = server
        cfg = server.config
        advertised = (parse_address(cfg.advertised_address) if cfg.advertised_address
                      else server.address)
        self.node = ClusterNode(
            broker_id=cfg.broker_id, cluster=cfg.cluster, metadata_url=cfg.metadata,
            data_dir=server.data_dir, advertised=advertised, lease_ms=cfg.metadata_lease_ms,
            kafka_advertised=kafka_advertised(server, advertised[0]),
            store=store, monotonic=server.clock.monotonic)
        node = self.node
        node.local_topics = self._local_topics
        node.ensure_topic = self._ensure_topic
        node.drop_topic = self._drop_topic
        node.on_role = self._on_role
        self.replicas: ReplicaManager | None = None
        self.controller: Controller | None = None
        self.probe: DeadBrokerProbe | None = None
        """The dead-broker probe (:mod:`ferrymq.cluster.liveness`; None: off)."""
        self._probe_task: asyncio.Task[None] | None = None
        self.groups = ClusterGroups(self)
        """The consumer groups this broker coordinates (:mod:`ferrymq.broker.cluster_groups`)."""
        self.txn = TxnCluster(self)
        """Transactions, when this broker coordinates them (:mod:`ferrymq.broker.txn.cluster`)."""
        self.halves = HalfCluster(self)
        """Half messages, when this broker owns them (:mod:`ferrymq.broker.half_messages.cluster`)."""
        self.delivery = ClusterDelivery(self)
        """The delivery groups this broker coordinates
        (:mod:`ferrymq.broker.cluster_delivery`)."""
        self.users = ClusterUsers(server, self.node)
        """The cluster's users, mirrored into this broker's users file
        (:mod:`ferrymq.broker.cluster_users`)."""

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Join the cluster, take this broker's roles, start the background tasks.

        Raises:
            MetadataUnavailableError, ClusterStartError: see :meth:`ClusterNode.start`.
            ConfigError: ``inter_broker_user`` is not an admin of this broker's users file, or
                the TLS files cannot be loaded.
        """
        srv, node = self.server, self.node
        self.replicas = ReplicaManager(
            srv.config.broker_id, 0, srv.topics, srv.config, srv.clock, srv.flusher,
            address_of=lambda bid: node.view.address_of(bid),
            on_isr_change=self._persist_isr, peer_login=peer_login(srv.config))
        srv.replicas = self.replicas
        self.replicas.on_scheduled = srv.scheduler.on_replica_append
        self.replicas.on_truncated = srv.scheduler.on_replica_truncated
        srv.scheduler.on_cluster = True
        node.on_fence = self._on_fence
        await node.start()
        await self.users.start()
        _check_inter_broker_user(srv)  # among the cluster's users, now in the file
        self.replicas.incarnation = node.incarnation
        first = await node.reserve_producer_ids()
        srv.producer_ids.use_cluster_blocks(first, self._refill_producer_ids)
        self.controller = Controller(node.store, node.keys, srv.config.broker_id,
                                     lease_ttl_s=node.lease_ttl_s, clock=srv.clock.monotonic,
                                     lease_of=lambda: node.lease)
        node.start_background(self.controller.run)
        if srv.config.dead_broker_probe_ms:
            controller = self.controller
            self.probe = DeadBrokerProbe(node.store, node.keys, srv.config.broker_id,
                                         srv.config.dead_broker_probe_ms / 1000,
                                         lambda: controller.active)
            self._probe_task = asyncio.get_running_loop().create_task(self.probe.run())
        self.groups.start()
        self.txn.start()

    async def stop(self) -> None:
        """Leave the cluster (the lease is revoked: leadership moves at once)."""
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
        await self.groups.stop()
        await self.txn.stop()
        self.delivery.close()
        await self.node.stop()
        self.txn.close()
        if self.replicas is not None:
            await self.replicas.close()

    # --- the node's callbacks ------------------------------------------------------------------

    def _local_topics(self) -> dict[str, int]:
        return {n: t.topic_id for n, t in self.server.topics.topics.items()
                if t.topic_id >= CLUSTER_TOPIC_ID_BASE}

    def _ensure_topic(self, t: TopicRecord) -> None:
        srv = self.server
        srv.topics.create(t.name, t.queues, dict(t.config), t.created_ms or srv.clock.wall_ms(),
                          topic_id=t.topic_id, internal_ok=t.name.startswith(INTERNAL_PREFIX))
        srv.consumer_groups.sync_queue_counts({t.name: t.queues})

    def _drop_topic(self, name: str) -> None:
        srv = self.server
        topic = srv.topics.topics.get(name)
        if topic is None:
            return
        if self.replicas is not None:
            for q in range(len(topic.queues)):
                self.replicas.stop_replica(name, q)
        self.delivery.on_topic_dropped(name)
        srv.topics.delete(name)
        srv.consumer_groups.forget_topic(name)
        srv.dedup.forget(topic.topic_id)

    def _on_role(self, topic: str, queue: int, old: QueueRole | None, new: QueueRole,
                 rec: QueueRecord, min_insync: int) -> None:
        rm = self.replicas
        if rm is None:
            return
        same_epoch = old is not None and old.leader_epoch == new.leader_epoch
        if new.role == "leader":
            if old is not None and old.role == "leader" and same_epoch:
                rm.update_record(topic, queue, rec)
            else:
                log.info("leading %s/%d at epoch %d (ISR %s)", topic, queue, rec.leader_epoch,
                         rec.isr)
                srv = self.server  # its copy's dedup keys, before the first produce it serves
                qs = srv.topics.queue(topic, queue)
                srv.dedup.rebuild_queue(qs, srv.clock.wall_ms())
                qs.open_txns = qs.log.ongoing_txns()  # the LSO holds until their markers
                rm.become_leader(topic, queue, rec, min_insync)
                srv.scheduler.on_lead(qs)  # fires what its former leader left due
        elif new.role == "follower":
            if old is not None and old.role == "follower" and same_epoch:
                rm.update_record(topic, queue, rec)
            elif rec.leader != NO_LEADER:
                log.info("following %s/%d from broker %d at epoch %d", topic, queue,
                         rec.leader, rec.leader_epoch)
                rm.become_follower(topic, queue, rec)
            else:
                rm.stop_replica(topic, queue)
        elif old is not None and old.role != "none":
            rm.stop_replica(topic, queue)
        if topic == OFFSETS_TOPIC:
            self.groups.on_role(queue, new.role == "leader", not same_epoch)
        elif topic == TXN_TOPIC:
            self.txn.on_role(new.role == "leader", not same_epoch)
        elif topic == HALF_TOPIC:
            self.halves.on_role(new.role == "leader", not same_epoch)
        elif topic.startswith((RETRY_TOPIC_PREFIX, DLQ_TOPIC_PREFIX)):
            self.delivery.on_role(topic, queue, new.role == "leader", not same_epoch)

    def _on_fence(self, fenced: bool) -> None:
        if self.replicas is not None:
            if fenced:
                self.replicas.fence()
            else:
                self.replicas.unfence()

    async def _persist_isr(self, topic: str, queue: int, isr: list[int]) -> list[int] | None:
        """The ISR compare-and-swap (the replica manager's ``on_isr_change``): the ISR committed
        for ``isr`` (without a member added whose broker is not alive), None when refused. A
        lost answer is settled from the store (:func:`settle_isr`); when even that cannot reach
        the store, MetadataUnavailableError: the outcome is still unknown."""
        node = self.node
        rec = node.view.queues.get((topic, queue))
        if rec is None or rec.leader != node.broker_id:
            return None
        try:
            new = await change_isr(node.store, node.keys, topic, queue, rec, isr)
        except (MetadataUnavailableError, TimeoutError, OSError) as exc:
            log.warning("%s/%d: the answer to writing ISR %s was lost (%s): settling it",
                        topic, queue, isr, exc)
            new = None
        if new is None:  # refused, or unknown: what the store holds settles it
            new = await settle_isr(node.store, node.keys, topic, queue, rec, isr)
        if new is None:
            return None
        seen = node.view.queues.get((topic, queue))
        if seen is None or seen.version < new.version:
            node.view.queues[(topic, queue)] = new
        return list(new.isr)

    def _refill_producer_ids(self) -> None:
        async def refill() -> None:
            while True:
                try:
                    block = await self.node.reserve_producer_ids()
                except (MetadataError, OSError) as exc:  # retried: the store may be back soon
                    log.warning("reserving producer ids failed (%s); retrying", exc)
                    await asyncio.sleep(0.5)
                    continue
                self.server.producer_ids.add_block(block)
                return
        asyncio.get_running_loop().create_task(refill())

    # --- the handlers' questions ---------------------------------------------------------------

    def check_serves(self, qs: QueueState) -> None:
        """Raise unless clients may produce to and read ``qs`` here: a cluster topic's queue
        that this broker does not lead is NOT_LEADER (or LEADER_NOT_AVAILABLE:
        :meth:`ClusterNode.check_leader`); the broker's own internal topics are local."""
        if qs.topic_id >= CLUSTER_TOPIC_ID_BASE:
            self.node.check_leader(qs.topic, qs.queue)

    async def create_topic(self, name: str, queues: int, config: dict[str, str],
                           replicas: int, min_insync: int) -> TopicRecord:
        """Create a topic in the cluster and wait until this broker has applied it.

        Raises:
            InvalidReplicationFactorError: more replicas than live brokers, or min_insync out
                of range.
            TopicAlreadyExistsError, InvalidTopicNameError, InvalidConfigError.
        """
        srv, node = self.server, self.node
        srv.topics.check_new_topic(name, queues, config)
        t = await create_topic(node.store, node.keys, name, queues, replicas, min_insync, config,
                               srv.clock.wall_ms(),
                               default_replicas_setting=srv.config.default_replicas,
                               default_min_insync_setting=srv.config.default_min_insync)
        if not await node.wait_for_topic(name, t.topic_id, TOPIC_APPLY_TIMEOUT_S):
            raise RequestTimedOutError(f"topic {name!r} was created in the cluster but this "
                                       f"broker did not apply it within "
                                       f"{TOPIC_APPLY_TIMEOUT_S:.0f} s")
        return t

    async def wait_for_topic(self, name: str) -> bool:
        """Wait until this broker applied topic ``name``, created in the cluster (perhaps
        through another broker, whose watch was faster); False after
        ``TOPIC_APPLY_TIMEOUT_S``."""
        return await self.node.wait_for_topic(name, None, TOPIC_APPLY_TIMEOUT_S)

    async def delete_topic(self, name: str) -> None:
        """Delete a topic from the cluster (every broker drops it when it sees the delete)."""
        if name not in self.node.view.topics:
            raise UnknownTopicError(f"unknown topic {name[:249]!r}")
        await delete_topic(self.node.store, self.node.keys, name)

    async def elect_preferred_leaders(self, topics: list[str] | None
                                      ) -> m.ElectPreferredLeadersResponse:
        """Move leadership back to the preferred replicas (from this broker, whichever holds
        the controller's seat: the writes are checked against it)."""
        node = self.node
        return m.ElectPreferredLeadersResponse(
            await elect_preferred_leaders(node.store, node.keys, topics))

    async def drain_broker(self, broker_id: int) -> m.DrainBrokerResponse:
        """Move broker ``broker_id``'s leaderships to other in-sync replicas (from this broker,
        whichever holds the controller's seat: the writes are checked against it)."""
        node = self.node
        return m.DrainBrokerResponse(*await drain_leaders(node.store, node.keys, broker_id))

    async def reassign_queue(self, topic: str, queue: int, target: list[int]
                             ) -> m.ReassignQueueResponse:
        """Start moving a queue to the replicas ``target`` (the controller finishes it)."""
        node = self.node
        before, after = await reassign_queue(node.store, node.keys, topic, queue, target)
        return m.ReassignQueueResponse([b for b in target if b not in before.replicas],
                                       [b for b in after.replicas if b not in target])

    def cluster_metadata(self, req: m.ClusterMetadataRequest) -> m.ClusterMetadataResponse:
        """The CLUSTER_METADATA answer from this broker's view."""
        view = self.node.view
        names = sorted(view.topics) if req.topics is None else req.topics
        topics: list[m.TopicLeadership] = []
        for name in names:
            t = view.topics.get(name)
            if t is None:
                topics.append((name, ErrorCode.UNKNOWN_TOPIC, -1, 1, []))
                continue
            qs: list[m.QueueLeadership] = []
            for q in range(t.queues):
                rec = view.queues.get((name, q))
                if rec is None:
                    qs.append((q, NO_LEADER, -1, [], []))
                else:
                    qs.append((q, rec.leader, rec.leader_epoch, list(rec.replicas),
                               list(rec.isr)))
            topics.append((name, ErrorCode.NONE, t.topic_id, t.min_insync, qs))
        brokers = [(b.broker_id, b.host, b.port) for b in sorted(view.brokers.values(),
                                                                  key=lambda b: b.broker_id)]
        return m.ClusterMetadataResponse(self.node.cluster, view.controller, brokers, topics)


def kafka_advertised(server: BrokerServer, host: str) -> tuple[str, int] | None:
    """Where Kafka clients reach ``server``'s Kafka port, as registered in the cluster:
    ``kafka_advertised_address``, else the advertised ``host`` of the native port with the
    Kafka port's bound port (None: no Kafka port)."""
    if server.kafka is None:
        return None
    if server.config.kafka_advertised_address:
        return parse_address(server.config.kafka_advertised_address)
    return host, server.kafka.address[1]


def peer_login(cfg: BrokerConfig) -> PeerLogin:
    """How this broker's followers connect to their leaders: as ``inter_broker_user`` (when
    set) over the TLS of the brokers' listeners (when ``tls_cert_file`` is set)."""
    auth = (cfg.inter_broker_user, cfg.inter_broker_password) if cfg.inter_broker_user else None
    return PeerLogin(auth, peer_context(cfg))


def _check_inter_broker_user(srv: BrokerServer) -> None:
    """With authentication on, ``inter_broker_user`` must be an admin of this broker's users
    file (replication requests need admin rights): say so at start, not at every fetch."""
    name = srv.config.inter_broker_user
    if srv.auth is None or not name:
        return
    user = srv.auth.store.get(name)
    if user is None or not user.admin:
        raise ConfigError(
            f"inter_broker_user {name!r} is {'not in' if user is None else 'not an admin of'} "
            f"the users of {srv.config.users_file} (on a cluster: the cluster's users, "
            "docs/cluster.md): followers log in to their leaders as "
            "that user, and replication needs admin rights (ferrymq user add NAME --admin)")
