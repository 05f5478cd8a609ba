"""Delivery groups in a cluster: which broker coordinates a group, and its state replicated.

Theory of operation
-------------------
CLUSTER.md's pattern ("Stateful services") for the delivery groups of push and simple
consumers. A group's state (leases, cursors, retry cursor, orderly failures, policy, ack
history: the journal and snapshots of :mod:`ferrymq.broker.delivery`) and its retry letters
live in **one** replicated log: the group's retry queue ``%RETRY%<group>``, in a cluster a
cluster topic of one queue (the cluster's default replicas and ``min_insync``), created through
the metadata store by the first broker asked about the group. The group's **coordinator** is
that queue's leader: it alone serves the group's requests (DELIVERY_HEARTBEAT, RECEIVE, ACK,
NACK, CHANGE_INVISIBLE, DELIVERY_LEAVE, DESCRIBE_DELIVERY, SKIP_MESSAGE, DLQ_ADMIN); another
broker answers NOT_COORDINATOR (retriable: the client asks for the leader of the retry queue,
:mod:`ferrymq.client._coordinator`, and goes there).

Why the retry queue and not a shared internal topic hashed by group name (as
``%GROUPS%offsets`` is): a failed message is *moved* to the retry queue and then finished in
the state; with both in one log and one writer, a failover truncates them at the same point, so
the state a new coordinator rebuilds never names a letter it does not have, and no write ever
has to reach another broker. A shared state topic would need the letters replicated
separately, under another leader.

Writes: every journal record is appended to the retry queue
(:class:`~ferrymq.broker.delivery.logstore.LogGroupStore`) and every answer that reports a change
(a lease, an ack, a nack) waits until the queue's high watermark covers it, whatever the flush
mode: a lease a member holds is always in the replicated state.

Failover: when this broker becomes the leader of a retry queue (a new epoch) it replays the
queue's state records (the last snapshot and the records after it) into the group, exactly as a
single broker loads a group after kill -9 (:mod:`ferrymq.broker.delivery.recovery`): leases come
back with their wall-clock deadlines, members come back with their member ids (their next
request gets UNKNOWN_MEMBER, they heartbeat and keep their ids), so a lease granted before the
failover is honoured until its deadline; an expired one is redelivered with
``reconsume_times`` + 1. When it stops leading the queue it forgets the group (nothing is
written). docs/delivery.md states the bound on double delivery.

The coordinator reads the group's source queues from its own copies (leader or follower: both
are readable up to the high watermark); a source queue it holds no replica of is read from its
leader, as a consumer would, into a bounded buffer (:mod:`ferrymq.broker.cluster_reads`).

Dead letters: ``%DLQ%<group>`` is a cluster topic of one queue too, created with the retry
queue. The coordinator makes itself its leader (:func:`~ferrymq.cluster.operations.elect_leader`,
a compare-and-swap like the preferred-leader election's, when it is in the queue's ISR), so the
dead-letter code reads and writes it locally as on one broker; until then a move to it is BUSY
(retried: the message stays leased). A dead letter is replicated before the finish of its
original is written.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ferrymq.broker.cluster_groups import create_internal_topic
from ferrymq.broker.cluster_reads import RemoteReads
from ferrymq.broker.delivery.lifecycle import check_delivery_group_name
from ferrymq.broker.delivery.logstore import GroupLog, LogGroupStore, read_state
from ferrymq.broker.peers import Peers
from ferrymq.broker.topics import CLUSTER_TOPIC_ID_BASE
from ferrymq.cluster.model import NO_LEADER
from ferrymq.cluster.operations import elect_leader
from ferrymq.errors import (
    BusyError,
    ConnectionClosedError,
    FerryMQTimeoutError,
    MetadataError,
    NotCoordinatorError,
    UnknownGroupError,
    UnknownTopicError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.letters import DLQ_TOPIC_PREFIX, RETRY_TOPIC_PREFIX

if TYPE_CHECKING:
    from ferrymq.broker.cluster_link import ClusterLink
    from ferrymq.broker.delivery.store import DeliveryStore
    from ferrymq.broker.topics import Topic

log = logging.getLogger("ferrymq.broker")

DLQ_FOLLOW_S = 0.5
"""How often a coordinator looks again whether it leads its group's dead-letter queue."""


class ClusterDelivery:
    """The delivery groups this broker coordinates (see the module docstring)."""

    def __init__(self, link: ClusterLink) -> None:
        self.link = link
        srv = link.server
        self.manager = srv.delivery
        ctx = self.manager.ctx
        ctx.open_store = self._open_store
        ctx.remove_topics = self._remove_topics
        ctx.create_internal = self._create_internal
        ctx.replicated = True
        self.led: set[str] = set()
        """Groups whose retry queue this broker leads (loaded when it holds state)."""
        self._replayed: dict[str, GroupLog] = {}
        self._stores: dict[str, LogGroupStore] = {}
        self._deleting: dict[str, int] = {}
        """Deleted groups -> the id of the retry topic whose cluster delete is under way."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._dlq_moves: set[str] = set()
        """Groups whose dead-letter queue's leadership is being moved here."""
        from ferrymq.broker.cluster_link import peer_login  # a cycle at import time
        node = link.node
        self.peers = Peers(node.broker_id, lambda bid: node.view.address_of(bid),
                           peer_login(srv.config),
                           max(1.0, min(10.0, srv.config.replica_lag_ms / 1000)))
        """Connections to other brokers: remote reads, deletes sent to a group's coordinator."""
        self.reads = RemoteReads(link, self.peers)
        """Source queues of the groups coordinated here that this broker does not replicate,
        read from their leaders (:mod:`ferrymq.broker.cluster_reads`)."""

    # --- who coordinates -------------------------------------------------------------------------

    def check_coordinator(self, group: str, *, create: bool = False) -> None:
        """Raise unless this broker coordinates ``group``; with ``create`` (a heartbeat), ask
        the cluster to create the group's retry queue when it does not exist yet.

        Raises:
            InvalidRequestError: not a group name.
            NotCoordinatorError: another broker does, or none yet.
            UnknownGroupError: no such group (its retry queue does not exist; not ``create``).
        """
        if group in self.led and group not in self._deleting:
            return
        check_delivery_group_name(group)
        topic = RETRY_TOPIC_PREFIX + group
        t = self.link.server.topics.topics.get(topic)
        gone = self._deleting.get(group)
        if gone is not None:
            if t is not None and t.topic_id == gone:
                raise NotCoordinatorError(f"delivery group {group!r} is being deleted; retry")
            del self._deleting[group]
        if t is None:
            if not create:
                raise UnknownGroupError(f"unknown delivery group {group[:200]!r}")
            self._spawn(self._create(topic))
            raise NotCoordinatorError(f"delivery group {group!r} has no coordinator yet: the "
                                      f"cluster is creating {topic}; retry")
        if t.topic_id < CLUSTER_TOPIC_ID_BASE:
            raise NotCoordinatorError(f"delivery group {group!r}: {topic} is a local topic of "
                                      f"broker {self.link.node.broker_id} (from before it joined "
                                      "a cluster): delete the group there first")
        if group not in self.led:
            rec = self.link.node.view.queues.get((topic, 0))
            leader = rec.leader if rec is not None else NO_LEADER
            now = f"broker {leader} leads it" if leader != NO_LEADER else "it has no leader now"
            raise NotCoordinatorError(
                f"broker {self.link.node.broker_id} does not coordinate delivery group "
                f"{group!r}: its state is in {topic} and {now}")

    def coordinator_elsewhere(self, group: str) -> int | None:
        """The broker that coordinates delivery group ``group`` when it is another (the
        leader of its retry queue); None when this broker does or no retry queue exists.

        Raises:
            NotCoordinatorError: the retry queue has no leader now (retry).
        """
        if group in self.led:
            return None
        rec = self.link.node.view.queues.get((RETRY_TOPIC_PREFIX + group, 0))
        if rec is None:
            return None
        if rec.leader == NO_LEADER:
            raise NotCoordinatorError(f"delivery group {group!r} has no coordinator now "
                                      f"({RETRY_TOPIC_PREFIX}{group} has no leader); retry")
        return None if rec.leader == self.link.node.broker_id else rec.leader

    async def delete_at(self, broker_id: int, group: str, delete_dlq: bool, *,
                        validate_only: bool) -> m.DeleteGroupResponse:
        """Ask broker ``broker_id``, the coordinator of delivery group ``group``, to delete it
        (or with ``validate_only`` to check that it may).

        Raises:
            NotCoordinatorError: it is not the coordinator (any more), or it cannot be reached
                (it may be failing over): nothing was deleted; retry.
            UnknownGroupError, NonEmptyGroupError: its answer.
        """
        req = m.DeleteGroupRequest(group, delete_dlq, m.GroupKinds.DELIVERY, validate_only)
        try:
            return await self.peers.request(broker_id, req, m.DeleteGroupResponse)
        except (ConnectionClosedError, FerryMQTimeoutError) as exc:
            raise NotCoordinatorError(f"delivery group {group!r}: its coordinator, broker "
                                      f"{broker_id}, did not answer ({exc}); retry") from None

    async def _create(self, topic: str) -> None:
        name = topic[len(RETRY_TOPIC_PREFIX):]
        await create_internal_topic(self.link, topic, 1, "a delivery group")
        await create_internal_topic(self.link, DLQ_TOPIC_PREFIX + name, 1,
                                    "a delivery group's dead letters")

    def _create_internal(self, name: str) -> Topic:
        """A group's internal topic used before it exists (a dead-letter queue of a group
        created before it had one): the cluster creates it; BUSY until then."""
        self._spawn(create_internal_topic(self.link, name, 1, "a delivery group"))
        raise BusyError(f"{name} is being created in the cluster; retry",
                        retry_after_ms=self.link.server.config.busy_retry_after_ms)

    # --- the dead-letter queue follows the coordinator -------------------------------------------

    def _follow_dlq(self, name: str) -> None:
        """Make this broker, the group's coordinator, the leader of the group's dead-letter
        queue too (in the background, until it is or stops coordinating the group)."""
        if name in self.led and name not in self._dlq_moves:
            self._dlq_moves.add(name)
            self._spawn(self._lead_dlq(name))

    async def _lead_dlq(self, name: str) -> None:
        link = self.link
        me = link.node.broker_id
        topic = DLQ_TOPIC_PREFIX + name
        try:
            while name in self.led:
                t = link.server.topics.topics.get(topic)
                rec = link.node.view.queues.get((topic, 0))
                if t is None or t.topic_id < CLUSTER_TOPIC_ID_BASE:
                    await create_internal_topic(link, topic, 1, "a delivery group")
                elif rec is not None and rec.leader == me:
                    return
                elif rec is not None and me in rec.isr:
                    try:
                        await elect_leader(link.node.store, link.node.keys, topic, 0, me)
                    except MetadataError as exc:
                        log.warning("%s: moving its leadership here failed: %s", topic, exc)
                await asyncio.sleep(DLQ_FOLLOW_S)
        finally:
            self._dlq_moves.discard(name)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- leadership of retry queues ------------------------------------------------------------

    def on_role(self, topic: str, queue: int, leads: bool, new_epoch: bool) -> None:
        """This broker now leads retry queue ``topic`` (``new_epoch``: it did not lead it at
        this epoch before: load the group from it) or not (forget the group); or a group's
        dead-letter queue changed leaders (the coordinator takes it over)."""
        if queue != 0:
            return
        if topic.startswith(DLQ_TOPIC_PREFIX):
            if not leads:
                self._follow_dlq(topic[len(DLQ_TOPIC_PREFIX):])
            return
        if not topic.startswith(RETRY_TOPIC_PREFIX):
            return
        name = topic[len(RETRY_TOPIC_PREFIX):]
        if leads and (new_epoch or name not in self.led):
            self._forget(name)
            self.led.add(name)
            self._follow_dlq(name)
            qs = self.link.server.topics.queue(topic, 0)
            state = read_state(qs)
            if state.deleted:  # deleted, and the cluster's delete of the topic not seen yet
                self._deleting[name] = qs.topic_id
                self._spawn(self._delete(topic))
            if not state.found:
                return  # a new group (created at its first heartbeat), or a deleted one
            self._replayed[name] = state
            mgr = self.manager
            g = mgr.recovery.load_group(name)
            if g.ephemeral:  # its members have their session to come back, as after a restart
                mgr.lifecycle.idle_ephemeral[name] = (mgr.ctx.now()
                                                      + mgr.ctx.config.max_session_timeout_ms)
            log.info("coordinating delivery group %s from %s: %d leases, %d queues", name,
                     topic, len(g.leases), len(g.sources))
        elif not leads and name in self.led:
            self.led.discard(name)
            self._forget(name)

    def close(self) -> None:
        """Stop the remote reads and close the connections to other brokers."""
        self.reads.close()
        self.peers.close()

    def on_topic_dropped(self, topic: str) -> None:
        """The cluster deleted ``topic``: if it was a retry queue led here, forget its group."""
        if topic.startswith(RETRY_TOPIC_PREFIX):
            name = topic[len(RETRY_TOPIC_PREFIX):]
            if name in self.led:
                self.led.discard(name)
                self._forget(name)

    def _forget(self, name: str) -> None:
        """Drop the group from memory (another broker coordinates it now; nothing written)."""
        ctx = self.manager.ctx
        self.reads.forget(name)
        self._replayed.pop(name, None)
        self._stores.pop(name, None)
        g = ctx.groups.pop(name, None)
        store = ctx.stores.pop(name, None)
        self.manager.lifecycle.idle_ephemeral.pop(name, None)
        if g is not None:
            g.wake()
            log.info("delivery group %s: no longer its coordinator", name)
        if store is not None:
            store.close()

    # --- the delivery manager's hooks ----------------------------------------------------------

    def _open_store(self, name: str) -> tuple[DeliveryStore, dict[str, Any] | None, list[Any]]:
        if name not in self.led:
            raise NotCoordinatorError(f"broker {self.link.node.broker_id} does not coordinate "
                                      f"delivery group {name!r}")
        srv = self.link.server
        qs = srv.topics.queue(RETRY_TOPIC_PREFIX + name, 0)
        state = self._replayed.pop(name, None)
        (self.manager.ctx.dir / name).mkdir(parents=True, exist_ok=True)  # deletes rename it
        store = LogGroupStore(name, qs, srv.flusher, srv.clock,
                              gen=state.gen if state else 0, size=state.size if state else 0)
        self._stores[name] = store
        if state is None:
            return store, None, []
        return store, state.snapshot, state.records

    def _remove_topics(self, name: str) -> None:
        """A deleted group: record the delete in its retry queue, delete the retry topic from
        the cluster, and the local dead-letter topic here."""
        topics = self.link.server.topics
        store = self._stores.pop(name, None)
        if store is not None:
            store.tombstone()
        dlq = topics.topics.get(DLQ_TOPIC_PREFIX + name)
        if dlq is not None:
            if dlq.topic_id < CLUSTER_TOPIC_ID_BASE:
                topics.delete(dlq.name)
            else:
                self._spawn(self._delete(dlq.name))
        retry = topics.topics.get(RETRY_TOPIC_PREFIX + name)
        if retry is not None:
            self._deleting[name] = retry.topic_id
            self._spawn(self._delete(retry.name))

    async def _delete(self, topic: str) -> None:
        try:
            await self.link.delete_topic(topic)
        except UnknownTopicError:
            pass
        except MetadataError as exc:  # its coordinator replays the delete and tries again
            log.warning("deleting %s from the cluster failed: %s", topic, exc)
