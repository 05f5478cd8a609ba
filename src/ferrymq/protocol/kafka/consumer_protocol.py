"""The consumer protocol's assignment (Kafka's ``ConsumerProtocolAssignment``): the opaque bytes
a Kafka group's leader hands each member of a ``consumer`` group, read only to show which
partitions a member holds (``ferrymq group describe``). Sans-IO.

The bytes are a version (int16) and the schema of that version (kio's generated classes: v0 to
v3 share one layout; a newer version is read with the newest known, as Kafka reads them).
"""

from __future__ import annotations

import struct

from kio.schema.consumer_protocol_assignment.v3.data import ConsumerProtocolAssignment

from ferrymq.errors import RemoteProtocolError
from ferrymq.protocol.kafka.apis import decode_request

MAX_ASSIGNED_PARTITIONS = 100_000
"""An assignment naming more partitions than this is not shown (it is not a real one)."""


def assigned_partitions(data: bytes) -> list[tuple[str, int]]:
    """The ``(topic, partition)`` pairs of an assignment, sorted; ``[]`` for bytes that are not
    one (an empty assignment, another protocol type's bytes, garbage)."""
    if len(data) < 2 or struct.unpack_from(">h", data)[0] < 0:
        return []
    try:
        value = decode_request(ConsumerProtocolAssignment, data, 2)
    except RemoteProtocolError:
        return []
    pairs = [(str(t.topic), int(p)) for t in value.assigned_partitions for p in t.partitions]
    return sorted(pairs) if len(pairs) <= MAX_ASSIGNED_PARTITIONS else []
