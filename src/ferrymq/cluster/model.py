"""What a cluster keeps in its metadata store: the key layout and the records (JSON values).

Keys, under ``/ferrymq/<cluster>/``::

    id                      ClusterIdentity   created once by the first broker
    brokers/<id>            BrokerRecord      put with the broker's lease: present = alive
    controller              ControllerRecord  created only if absent, with the controller's lease
    topics/<name>           TopicRecord       created with its queues in one commit, by any broker
    queues/<topic>/<queue>  QueueRecord       leader, epoch, replicas, ISR: every write a CAS
    producer_ids            ProducerIdBlock   the next free producer id (blocks taken by CAS)
    counters/controller_epoch  Counter        the last controller epoch (bumped by each new controller)
    counters/topic_id          Counter        the next free topic id (taken by a topic's create)
    users/<name>            users-file entry  a user of the cluster (TOML, as in a users file)
    counters/users_version     Counter        bumped by every change of users/ (their CAS)

A record's ``version`` is the key's mod revision when it was read (not stored): a writer passes
it back as the check of its compare-and-swap, so a writer with a stale view (a deposed leader or
controller) fails instead of overwriting.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

from ferrymq.cluster.metadata.store import KeyValue

NO_LEADER = -1
"""``QueueRecord.leader`` of a queue without a live leader (offline)."""

T = TypeVar("T", bound="_Record")


class _Record:
    """JSON (de)serialisation of the records (unknown fields are ignored: newer brokers may add
    some)."""

    def encode(self) -> bytes:
        d = asdict(self)  # type: ignore[call-overload]
        d.pop("version", None)
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls: type[T], kv: KeyValue) -> T:
        raw: dict[str, Any] = json.loads(kv.value)
        names = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
        known = {k: v for k, v in raw.items() if k in names}
        if "version" in names:
            known["version"] = kv.mod_revision
        return cls(**known)


@dataclass(frozen=True, slots=True)
class ClusterIdentity(_Record):
    """The cluster's name and the id minted when it was first formed (a broker's data directory
    remembers it and refuses to join another cluster)."""

    name: str
    cluster_id: str


@dataclass(frozen=True, slots=True)
class BrokerRecord(_Record):
    """A live broker: its id, the address clients and replicas reach it at, and its incarnation
    (bumped at every start, so a restarted broker is told apart from its former self).
    ``kafka_host`` and ``kafka_port``: where Kafka clients reach its Kafka port (``""`` and 0:
    it has none; records of brokers from before the Kafka port decode so)."""

    broker_id: int
    host: str
    port: int
    incarnation: int
    kafka_host: str = ""
    kafka_port: int = 0

    @property
    def kafka_address(self) -> tuple[str, int] | None:
        """Where Kafka clients reach this broker (None: it has no Kafka port)."""
        return (self.kafka_host, self.kafka_port) if self.kafka_port else None


@dataclass(frozen=True, slots=True)
class ControllerRecord(_Record):
    """The controller's seat: which broker holds it and its controller epoch."""

    broker_id: int
    epoch: int


@dataclass(frozen=True, slots=True)
class TopicRecord(_Record):
    """A topic of the cluster."""

    name: str
    topic_id: int
    queues: int
    replicas: int
    min_insync: int
    config: dict[str, str] = field(default_factory=dict)
    created_ms: int = 0


@dataclass(frozen=True, slots=True)
class QueueRecord(_Record):
    """A queue's replication state: the replicas (the first is the preferred leader), the
    leader (``NO_LEADER`` when offline), the leader epoch (bumped at every leader change) and the
    in-sync replicas (the leader always among them while it leads). ``target``: while a
    reassignment runs, the replicas asked for (``replicas`` holds the old and the new ones until
    every new one is in sync; the controller then finishes it). ``version``: the key's mod
    revision when read."""

    replicas: list[int]
    leader: int
    leader_epoch: int
    isr: list[int]
    version: int = 0
    target: list[int] | None = None

    def with_leader(self, leader: int, isr: list[int] | None = None) -> QueueRecord:
        """The record after a leader change (the epoch bumped)."""
        return replace(self, leader=leader, leader_epoch=self.leader_epoch + 1,
                       isr=list(self.isr if isr is None else isr))


@dataclass(frozen=True, slots=True)
class Counter(_Record):
    """A number that only grows, taken by compare-and-swap (the controller epoch, the next
    topic id)."""

    value: int


@dataclass(frozen=True, slots=True)
class ProducerIdBlock(_Record):
    """The first producer id no broker has taken yet."""

    next_id: int


class Keys:
    """The key layout of one cluster (see the module docstring)."""

    def __init__(self, cluster: str) -> None:
        self.root = f"/ferrymq/{cluster}/"
        self.identity = self.root + "id"
        self.brokers = self.root + "brokers/"
        self.controller = self.root + "controller"
        self.topics = self.root + "topics/"
        self.queues = self.root + "queues/"
        self.producer_ids = self.root + "producer_ids"
        self.users = self.root + "users/"
        """One key per user of the cluster (a users-file entry); written only with a check of
        :attr:`users_version`, which every change bumps."""
        # not under "controller": a watch of the controller key is a watch of its prefix
        self.controller_epoch = self.root + "counters/controller_epoch"
        self.topic_ids = self.root + "counters/topic_id"
        self.users_version = self.root + "counters/users_version"

    def broker(self, broker_id: int) -> str:
        """The key of broker ``broker_id``."""
        return f"{self.brokers}{broker_id}"

    def user(self, name: str) -> str:
        """The key of user ``name``."""
        return self.users + name

    def topic(self, name: str) -> str:
        """The key of topic ``name``."""
        return self.topics + name

    def queue_prefix(self, topic: str) -> str:
        """The prefix of every queue key of ``topic``."""
        return f"{self.queues}{topic}/"

    def queue(self, topic: str, queue: int) -> str:
        """The key of queue ``queue`` of ``topic``."""
        return f"{self.queues}{topic}/{queue}"

    def parse_queue(self, key: str) -> tuple[str, int]:
        """(topic, queue) of a queue key."""
        topic, _, q = key[len(self.queues):].rpartition("/")
        return topic, int(q)
