"""What the parts of the delivery manager share: the groups, their stores, the broker parts
they use, the lease-id sequence and the conversions between monotonic and wall-clock time.

:class:`~ferrymq.broker.delivery.manager.DeliveryManager` builds one context and hands it to
each of its collaborators (:mod:`.receiving`, :mod:`.settling`, :mod:`.moves`, ...): what they
share is named here, and nothing else is shared. Everything runs on the event-loop thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ferrymq._time import Clock

if TYPE_CHECKING:
    from ferrymq.broker.config import BrokerConfig
    from ferrymq.broker.delivery.group import DeliveryGroup
    from ferrymq.broker.delivery.store import GroupStore
    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.scheduler import Scheduler
    from ferrymq.broker.topics import TopicRegistry


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
        self.stores: dict[str, GroupStore] = {}
        self.next_lease = 1

    def now(self) -> int:
        """Monotonic milliseconds (leases, sessions and backoffs are measured in them)."""
        return int(self.clock.monotonic() * 1000)

    def to_wall(self, mono_ms: int) -> int:
        """The wall-clock time of monotonic ``mono_ms`` (what is journaled and shown)."""
        return self.clock.wall_ms() + (mono_ms - self.now())

    def to_mono(self, wall_ms: int) -> int:
        """The monotonic time of wall-clock ``wall_ms`` read back from disk (never before now)."""
        return self.now() + max(0, wall_ms - self.clock.wall_ms())
