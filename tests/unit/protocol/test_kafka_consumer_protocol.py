"""The consumer protocol's assignment bytes read for ``ferrymq group describe``: every version
Kafka's clients write, and bytes that are not an assignment."""

from __future__ import annotations

import struct

import pytest
from kio.schema.consumer_protocol_assignment.v0.data import (
    ConsumerProtocolAssignment,
    TopicPartition,
)
from kio.static.primitive import i32

from ferrymq.protocol.kafka import apis
from ferrymq.protocol.kafka.consumer_protocol import assigned_partitions

_BODY = apis.encode(ConsumerProtocolAssignment(assigned_partitions=(
    TopicPartition(topic="orders", partitions=(i32(3), i32(1))),
    TopicPartition(topic="audit", partitions=(i32(0),))), user_data=b"sticky"))


@pytest.mark.parametrize("version", [0, 1, 2, 3, 9])
def test_every_version_names_its_partitions(version: int) -> None:
    data = struct.pack(">h", version) + _BODY
    assert assigned_partitions(data) == [("audit", 0), ("orders", 1), ("orders", 3)]


@pytest.mark.parametrize("data", [b"", b"\x00", struct.pack(">h", -1) + _BODY,
                                  struct.pack(">h", 0) + _BODY[:5], b"\x00\x00\xff\xff\xff\xff"])
def test_bytes_that_are_not_an_assignment_name_nothing(data: bytes) -> None:
    assert assigned_partitions(data) == []
