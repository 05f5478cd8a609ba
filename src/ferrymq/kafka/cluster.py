"""The cluster as Kafka clients see it: the brokers at their Kafka addresses, each partition's
leader, epoch and replicas, the coordinators of groups and transactions.

Theory of operation
-------------------
On a single broker, this broker is all of it: the only broker Metadata lists (at the address the
client reached its Kafka port on, or ``kafka_advertised_address``), leader and only replica of
every partition, coordinator of every group and transactional id.

On a cluster (``metadata``) everything comes from the broker's view of the metadata store
(:class:`~ferrymq.cluster.node.ClusterView`), so every broker answers the same:

- each broker registers its Kafka address in its ``brokers/<id>`` record
  (:class:`~ferrymq.cluster.model.BrokerRecord`: ``kafka_advertised_address``, else the
  advertised host with the Kafka port); Kafka node id = FerryMQ broker id. A live broker without
  a Kafka port (``kafka_port = 0``, or a broker from before this record field) is not listed,
  and a partition it leads is answered LEADER_NOT_AVAILABLE (leader -1), which clients retry;
- a partition's leader, leader epoch, replicas and ISR are its queue record's; offline replicas
  are the replicas whose broker is not alive;
- the controller is the broker holding the controller's seat;
- a group's coordinator is the leader of its queue of ``%GROUPS%offsets``
  (:mod:`ferrymq.broker.cluster_groups`), the transaction coordinator the leader of
  ``%TXN%state`` (:mod:`ferrymq.broker.txn.cluster`). Asked before those topics exist, the
  cluster is asked to create them and the answer is COORDINATOR_NOT_AVAILABLE (retriable).

Requests for a partition this broker does not lead are refused by FerryMQ's own handlers with
NOT_LEADER, which is Kafka's NOT_LEADER_OR_FOLLOWER: clients refresh their metadata and go to
the new leader. Group requests at a broker that does not coordinate the group are answered
NOT_COORDINATOR (another broker leads the group's queue), COORDINATOR_LOAD_IN_PROGRESS (this
broker leads it but is still replaying it) or COORDINATOR_NOT_AVAILABLE (no leader now), as a
Kafka broker answers (:func:`group_error`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kio.schema.errors import ErrorCode as KafkaError

from ferrymq.broker.topics import CLUSTER_TOPIC_ID_BASE
from ferrymq.cluster.model import NO_LEADER
from ferrymq.errors import NotCoordinatorError
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, TXN_TOPIC, coordinator_queue

if TYPE_CHECKING:
    from ferrymq.broker.cluster_link import ClusterLink
    from ferrymq.broker.context import BrokerContext
    from ferrymq.kafka.groups import KafkaGroupCoordinator
    from ferrymq.kafka.handlers import KafkaPeer

CLUSTER_ID = "ferrymq"
"""The cluster id a single broker gives Kafka clients (a cluster gives its name)."""


@dataclass(frozen=True, slots=True)
class KafkaNode:
    """A broker as Kafka clients know it: node id (the FerryMQ broker id) and Kafka address."""

    node_id: int
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class PartitionState:
    """A partition's row of a Metadata answer."""

    error: KafkaError
    leader: int
    leader_epoch: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]
    offline: tuple[int, ...]


def _this(peer: KafkaPeer) -> KafkaNode:
    host, port = peer.local_address
    return KafkaNode(peer.conn.server.config.broker_id, host, port)


def cluster_id(peer: KafkaPeer) -> str:
    """The cluster id Kafka clients see: the cluster's name (``ferrymq`` on a single broker)."""
    link = peer.conn.server.cluster
    return CLUSTER_ID if link is None else link.node.cluster


def brokers(peer: KafkaPeer) -> list[KafkaNode]:
    """Every live broker that has a Kafka port, by node id."""
    link = peer.conn.server.cluster
    if link is None:
        return [_this(peer)]
    out = []
    for b in sorted(link.node.view.brokers.values(), key=lambda b: b.broker_id):
        addr = b.kafka_address
        if addr is not None:
            out.append(KafkaNode(b.broker_id, *addr))
    return out


def controller_id(peer: KafkaPeer) -> int:
    """The controller's node id (-1: none now)."""
    link = peer.conn.server.cluster
    return peer.conn.server.config.broker_id if link is None else link.node.view.controller


def _kafka_node(link: ClusterLink, broker_id: int) -> KafkaNode | None:
    b = link.node.view.brokers.get(broker_id)
    addr = None if b is None else b.kafka_address
    return None if addr is None else KafkaNode(broker_id, *addr)


def partitions(peer: KafkaPeer, topic: str, queues: int) -> list[PartitionState]:
    """The partitions of ``topic`` (``queues`` of them): leader, epoch, replicas, ISR."""
    me = peer.conn.server.config.broker_id
    link = peer.conn.server.cluster
    t = None if link is None else link.node.view.topics.get(topic)
    if link is None or t is None:  # a single broker's, or a cluster broker's own local topic
        return [PartitionState(KafkaError.none, me, -1, (me,), (me,), ())] * queues
    view = link.node.view
    out = []
    for q in range(queues):
        rec = view.queues.get((topic, q))
        if rec is None:
            out.append(PartitionState(KafkaError.leader_not_available, -1, -1, (), (), ()))
            continue
        replicas = tuple(rec.replicas)
        offline = tuple(r for r in replicas if r not in view.brokers)
        leader = rec.leader
        error = KafkaError.none
        if leader == NO_LEADER or _kafka_node(link, leader) is None:
            leader, error = -1, KafkaError.leader_not_available
        out.append(PartitionState(error, leader, rec.leader_epoch, replicas, tuple(rec.isr),
                                  offline))
    return out


def leader_epoch(peer: KafkaPeer, topic: str, queue: int) -> int:
    """The partition's leader epoch (-1 on a single broker and for a broker's local topics)."""
    link = peer.conn.server.cluster
    rec = None if link is None else link.node.view.queues.get((topic, queue))
    return -1 if rec is None else rec.leader_epoch


def epoch_error(peer: KafkaPeer, topic: str, queue: int, current: int) -> KafkaError:
    """What a request carrying the client's ``current_leader_epoch`` of a partition (KIP-320;
    -1: not said) gets: NONE when it is the partition's (or either is unknown),
    FENCED_LEADER_EPOCH when older (the client's metadata is stale), UNKNOWN_LEADER_EPOCH when
    newer (this broker's is): either way the client refreshes its metadata and retries."""
    if current < 0:
        return KafkaError.none
    epoch = leader_epoch(peer, topic, queue)
    if epoch < 0 or current == epoch:
        return KafkaError.none
    return KafkaError.fenced_leader_epoch if current < epoch else KafkaError.unknown_leader_epoch


def group_coordinator(peer: KafkaPeer, group: str) -> KafkaNode | None:
    """The broker coordinating ``group`` (None: none now; the cluster is asked to create
    ``%GROUPS%offsets`` if it does not exist)."""
    link = peer.conn.server.cluster
    if link is None:
        return _this(peer)
    leader = _group_leader(link, group)
    return None if leader == NO_LEADER else _kafka_node(link, leader)


def _group_leader(link: ClusterLink, group: str) -> int:
    t = link.server.topics.topics.get(OFFSETS_TOPIC)
    if t is None or t.topic_id < CLUSTER_TOPIC_ID_BASE:
        try:
            link.groups.check_coordinator(group)  # asks the cluster to create the topic
        except NotCoordinatorError:
            pass
        return NO_LEADER
    rec = link.node.view.queues.get((OFFSETS_TOPIC, coordinator_queue(group, len(t.queues))))
    return NO_LEADER if rec is None else rec.leader


def txn_coordinator(peer: KafkaPeer) -> KafkaNode | None:
    """The broker coordinating transactions (None: none now; the cluster is asked to create
    ``%TXN%state`` if it does not exist)."""
    link = peer.conn.server.cluster
    if link is None:
        return _this(peer)
    if TXN_TOPIC not in link.server.topics.topics:
        try:
            link.txn.check_owner("transactions")  # asks the cluster to create the topic
        except NotCoordinatorError:
            pass
        return None
    leader = link.txn.owner()
    return None if leader == NO_LEADER else _kafka_node(link, leader)


def group_error(server: BrokerContext, group: str) -> KafkaError:
    """NONE if ``server`` coordinates ``group`` (always, on a single broker), else the Kafka
    error a client answers by finding the coordinator again: NOT_COORDINATOR,
    COORDINATOR_LOAD_IN_PROGRESS or COORDINATOR_NOT_AVAILABLE."""
    link = server.cluster
    if link is None:
        return KafkaError.none
    try:
        link.groups.check_coordinator(group)
        return KafkaError.none
    except NotCoordinatorError:
        pass
    leader = _group_leader(link, group)
    if leader == NO_LEADER:
        return KafkaError.coordinator_not_available
    if leader == link.node.broker_id:
        return KafkaError.coordinator_load_in_progress
    return KafkaError.not_coordinator


def check_group(peer: KafkaPeer, group: str) -> KafkaError:
    """:func:`group_error`; where it is not NONE, the Kafka port's membership of ``group``
    here is forgotten (:meth:`~ferrymq.kafka.groups.KafkaGroupCoordinator.drop`): a group's
    members live only on its coordinator."""
    error = group_error(peer.conn.server, group)
    if error != KafkaError.none:
        peer.groups.drop(group, error)
    return error


def drop_moved_groups(server: BrokerContext, groups: KafkaGroupCoordinator) -> None:
    """Forget the Kafka groups ``server`` no longer coordinates (its leadership of their
    queues of ``%GROUPS%offsets`` moved): their members, waiting or not, are sent to the new
    coordinator. Called by the listener's housekeeping; nothing to do on a single broker."""
    if server.cluster is None:
        return
    for name in list(groups.groups):
        error = group_error(server, name)
        if error != KafkaError.none:
            groups.drop(name, error)


__all__ = ["KafkaNode", "PartitionState", "brokers", "check_group", "cluster_id",
           "controller_id", "drop_moved_groups", "epoch_error", "group_coordinator", "group_error",
           "leader_epoch", "partitions", "txn_coordinator"]
