"""Which broker coordinates a consumer group in a cluster: the shared rule of brokers and
clients. Sans-IO.

A cluster keeps consumer groups' committed offsets in the internal replicated topic
:data:`OFFSETS_TOPIC`; the coordinator of a group is the leader of the queue
:func:`coordinator_queue` picks for it (Kafka's ``__consumer_offsets``, where the group's
partition is a hash of its name modulo the partition count). Clients compute it from a
CLUSTER_METADATA answer for this topic, so the hash is part of the protocol: it must never
change (CRC-32 of the UTF-8 name, as ``zlib.crc32``, is stable across processes and languages,
unlike Python's ``hash``).
"""

from __future__ import annotations

import zlib

OFFSETS_TOPIC = "%GROUPS%offsets"
"""The cluster's log of consumer groups' committed offsets (created on first use)."""
TXN_TOPIC = "%TXN%state"
"""The transaction coordinator's log (one queue; in a cluster, replicated, and the leader of
its queue :func:`coordinator_queue` picks for a transactional id is that id's coordinator)."""


def coordinator_queue(group: str, queues: int) -> int:
    """The queue of :data:`OFFSETS_TOPIC` (of ``queues`` queues) that holds ``group``."""
    return zlib.crc32(group.encode()) % queues
