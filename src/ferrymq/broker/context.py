"""What a request handler sees of the broker and of the connection a request came on.

Theory of operation
-------------------
Handlers (:mod:`ferrymq.broker.handlers`), authorisation (:mod:`ferrymq.broker.acl`) and the
broker side of the handshake (:mod:`ferrymq.broker.auth`) are typed against the two
:class:`~typing.Protocol` classes here, not against :class:`~ferrymq.broker.server.BrokerServer`
and :class:`~ferrymq.broker.connection.BrokerConnection`. That keeps the import graph a tree
(server -> connection -> handlers -> context; nothing below imports the server), and it lists in
one place what a handler may reach: the managers the server owns and a few flags, read-only.
The objects handed to handlers at run time are still the server and the connection, so a
handler pays nothing for the seam: ``conn.server.topics`` is two attribute reads, as before.

A cluster-aware broker, or a unit test of one handler, supplies any object with these members.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ferrymq.broker.auth import AuthConnection, Authenticator
from ferrymq.protocol.messages import Body

if TYPE_CHECKING:
    from ferrymq._time import Clock
    from ferrymq.broker.cluster_link import ClusterLink
    from ferrymq.broker.config import BrokerConfig
    from ferrymq.broker.consumer_groups import ConsumerGroupCoordinator
    from ferrymq.broker.dedup import Deduplicator
    from ferrymq.broker.delivery import DeliveryManager
    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.half_messages import HalfMessageManager
    from ferrymq.broker.keyindexer import KeyIndexer
    from ferrymq.broker.producer_ids import ProducerIdManager
    from ferrymq.broker.scheduler import Scheduler
    from ferrymq.broker.stats import RequestStats
    from ferrymq.broker.topics import TopicRegistry
    from ferrymq.broker.txn import TxnCoordinator
    from ferrymq.broker.watermarks import Watermarks
    from ferrymq.kafka.groups import KafkaGroupCoordinator
    from ferrymq.protocol.codes import ErrorCode


class ReplicaService(Protocol):
    """In a cluster, what the replicas' requests reach
    (:class:`~ferrymq.cluster.replication.ReplicaManager`)."""

    def replica_fetch(self, conn: ClientConnection, req: Any) -> Body | Awaitable[Body]:
        """REPLICA_FETCH: a follower's long-polled fetch."""
        ...

    def offset_for_epoch(self, req: Any) -> Body:
        """OFFSET_FOR_EPOCH: where an epoch ends on this leader."""
        ...


class BrokerContext(Protocol):
    """The broker as handlers see it: its configuration, clock, state flags and managers."""

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the broker listens on."""
        ...

    @property
    def cluster(self) -> ClusterLink | None:
        """This broker's part in a cluster (None: a single broker)."""

    @property
    def config(self) -> BrokerConfig:
        """The broker's configuration."""

    @property
    def clock(self) -> Clock:
        """The broker's clock (wall time for records, monotonic for timeouts)."""

    @property
    def sync_flush(self) -> bool:
        """True when acknowledgements wait for the fsync (``flush = "sync"``)."""

    @property
    def shutting_down(self) -> bool:
        """True once a graceful shutdown began (new writes are refused)."""

    @property
    def topics(self) -> TopicRegistry:
        """Every topic and queue."""

    @property
    def flusher(self) -> Flusher:
        """Group commit: fsync rounds, postponed flushes, write errors."""

    @property
    def watermarks(self) -> Watermarks:
        """Memory and free-disk watermarks."""

    @property
    def request_stats(self) -> Mapping[int, RequestStats]:
        """Per api key (PRODUCE and FETCH only) the requests' counts, bytes and latency."""

    @property
    def dedup(self) -> Deduplicator:
        """Dedup-key windows per topic."""

    @property
    def scheduler(self) -> Scheduler:
        """Delayed messages."""

    @property
    def half_messages(self) -> HalfMessageManager:
        """Half messages (prepare, end, check-back)."""

    @property
    def txn(self) -> TxnCoordinator:
        """Exactly-once transactions."""

    @property
    def consumer_groups(self) -> ConsumerGroupCoordinator:
        """Consumer groups (offset-based pull groups) and their committed offsets."""

    @property
    def kafka_groups(self) -> KafkaGroupCoordinator | None:
        """The Kafka port's group membership (None: no Kafka port)."""

    @property
    def delivery(self) -> DeliveryManager:
        """Delivery groups (push and simple consumers)."""

    @property
    def producer_ids(self) -> ProducerIdManager:
        """Producer id allocation."""

    @property
    def key_index(self) -> KeyIndexer:
        """Find-by-key."""

    @property
    def replicas(self) -> ReplicaService | None:
        """In a cluster, the replica manager (None: a single broker)."""

    @property
    def auth(self) -> Authenticator | None:
        """Authentication (None: off, every connection has every right)."""

    @property
    def connections(self) -> Collection[ClientConnection]:
        """The open client connections."""

    def now_monotonic_ms(self) -> int:
        """Monotonic milliseconds (sessions, timeouts)."""


class ClientConnection(AuthConnection, Protocol):
    """The connection a request came on, as handlers see it (and, through
    :class:`~ferrymq.broker.auth.AuthConnection`, its handshake state)."""

    client_id: str
    """What the client called itself in HELLO."""

    @property
    def server(self) -> BrokerContext:
        """The broker serving this connection."""

    @property
    def principal(self) -> str | None:
        """The authenticated user's name (None when authentication is off)."""

    @property
    def closed(self) -> bool:
        """True once the connection is closed (or closing)."""

    def stop_reading(self) -> None:
        """Read nothing more from this client (a failed handshake is being answered)."""

    def fail(self, code: ErrorCode, message: str) -> None:
        """Send a connection-level error and close."""


Handler = Callable[[ClientConnection, Any], Body | Awaitable[Body]]
"""A request handler: ``(connection, request)`` to a response body or an awaitable of one."""
