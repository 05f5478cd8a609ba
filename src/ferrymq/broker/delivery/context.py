"""What the parts of the delivery manager share: the groups, their stores, the broker parts
they use, the lease-id sequence and the conversions between monotonic and wall-clock time.

:class:`~ferrymq.broker.delivery.manager.DeliveryManager` builds one context and hands it to
each of its collaborators (:mod:`.receiving`, :mod:`.settling`, :mod:`.moves`, ...): what they
share is named here, and nothing else is shared. Everything runs on the event-loop thread.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferrymq._time import Clock
from ferrymq.broker.delivery.store import DeliveryStore, GroupStore
from ferrymq.broker.topics import CLUSTER_TOPIC_ID_BASE
from ferrymq.protocol.letters import DLQ_TOPIC_PREFIX, RETRY_TOPIC_PREFIX

if TYPE_CHECKING:
    from ferrymq.broker.config import BrokerConfig
    from ferrymq.broker.delivery.group import DeliveryGroup
    from ferrymq.broker.delivery.sources import SourceQueue
    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.scheduler import Scheduler
    from ferrymq.broker.topics import QueueState, Topic, TopicRegistry


RemoteSource = Callable[["DeliveryGroup", "QueueState"], "SourceQueue | None"]
"""What a group reads in place of source queue ``qs``: ``qs`` itself when this broker holds
it, else the queue read from its leader (None: not readable yet)."""
StoreOpener = Callable[[str], tuple[DeliveryStore, "dict[str, Any] | None", list[Any]]]
"""Opens group ``name``'s store: the store, its snapshot (None: none yet) and the journal
records after it."""


class DeliveryContext:
    """The broker's delivery groups and what serving them needs (see the module docstring).

    ``groups`` and ``stores`` are keyed by group name and change together (a group is in both
    or in neither). ``next_lease`` is the next lease id: taken by a new lease only once the
    lease is journaled, and never reused (recovery moves it past every id it reads)."""

    def __init__(
        self, config: BrokerConfig, topics: TopicRegistry, flusher: Flusher, clock: Clock,
        data_dir: Path, scheduler: Scheduler,
    ) -> None:
        self.config = config
        self.topics = topics
        self.flusher = flusher
        self.clock = clock
        self.scheduler = scheduler  # runs the retry ladder (see the manager's docstring)
        self.sync = config.flush == "sync"
        self.dir = data_dir / "delivery"
        self.handles = topics.handles  # the journals' descriptors share the segments' cache
        self.groups: dict[str, DeliveryGroup] = {}
        self.stores: dict[str, DeliveryStore] = {}
        self.next_lease = 1
        self.open_store: StoreOpener = self._open_files
        """How a group's store is opened: its files here; in a cluster, its replicated retry
        queue (set by :class:`~ferrymq.broker.cluster_delivery.ClusterDelivery`)."""
        self.remove_topics: Callable[[str], None] = self._remove_local_topics
        """How a deleted group's retry and dead-letter topics are removed (cluster: see
        ``open_store``)."""
        self.create_internal: Callable[[str], Topic] = self._create_local
        """Creates a group's internal topic of one queue (retry, dead letters) on first use:
        here; in a cluster through the metadata store (BUSY until it exists)."""
        self.remote_source: RemoteSource | None = None
        """Cluster: how a group reads a source queue this broker holds no replica of (set by
        :class:`~ferrymq.broker.cluster_reads.RemoteReads`); None: every queue is read here."""
        self.holds: Callable[[QueueState], bool] = lambda qs: True
        """Whether this broker holds queue ``qs`` (a cluster's broker: a replica of it), so
        that its log here says what is stored."""
        self.replicated = False
        """Whether the stores are replicated logs: answers then wait for replication whatever
        the flush mode (a cluster)."""
        self.load_local = not config.metadata
        """Whether groups are loaded from ``<data_dir>/delivery`` at start (a single broker;
        a cluster broker loads a group when it becomes its coordinator)."""

    @property
    def answers_wait(self) -> bool:
        """Whether an answer reporting a change waits until the change is durable: in sync
        flush mode (fsynced), and in a cluster (replicated, whatever the flush mode)."""
        return self.sync or self.replicated

    def _open_files(self, name: str) -> tuple[DeliveryStore, dict[str, Any] | None, list[Any]]:
        return GroupStore.load(self.dir / name, self.handles)

    def _create_local(self, name: str) -> Topic:
        return self.topics.create(name, 1, {}, self.clock.wall_ms(), internal_ok=True)

    def _remove_local_topics(self, name: str) -> None:
        for topic in (RETRY_TOPIC_PREFIX + name, DLQ_TOPIC_PREFIX + name):
            t = self.topics.topics.get(topic)
            if t is not None and t.topic_id < CLUSTER_TOPIC_ID_BASE:  # (a cluster's are its)
                self.topics.delete(topic)

    def now(self) -> int:
        """Monotonic milliseconds (leases, sessions and backoffs are measured in them)."""
        return int(self.clock.monotonic() * 1000)

    def to_wall(self, mono_ms: int) -> int:
        """The wall-clock time of monotonic ``mono_ms`` (what is journaled and shown)."""
        return self.clock.wall_ms() + (mono_ms - self.now())

    def to_mono(self, wall_ms: int) -> int:
        """The monotonic time of wall-clock ``wall_ms`` read back from disk (never before now)."""
        return self.now() + max(0, wall_ms - self.clock.wall_ms())
