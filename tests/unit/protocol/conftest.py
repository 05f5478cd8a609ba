"""Fixtures for protocol unit tests: frame and batch factories (no I/O)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ferrymq.protocol.frames import encode_frame
from ferrymq.protocol.records import RecordInput, encode_batch, encode_properties

FrameFactory = Callable[..., bytes]
BatchFactory = Callable[..., bytearray]


def build_frame(
    api_key: int = 2, api_version: int = 1, flags: int = 0, correlation_id: int = 1,
    payload: bytes = b"\x90",
) -> bytes:
    """One encoded frame (defaults: a PING request with an empty msgpack array body)."""
    return encode_frame(api_key, api_version, flags, correlation_id, payload)


def build_rich_batch() -> bytearray:
    """A small batch exercising every record field: tags, keys, sharding keys, properties."""
    return encode_batch(
        [
            RecordInput(b"plain", 1_000),
            RecordInput(b"", 1_005, tag=b"created"),
            RecordInput(
                "h\u00e9llo w\u00f6rld \u2603".encode(), 999,
                tag="t\u00e4g".encode(), sharding_key="sk-\u00fc".encode(),
                keys="k1\x00k\u00f82".encode(),
                properties=encode_properties({"a": "1", "\u00fc": "\u2603"}),
            ),
        ],
        producer_id=7, producer_epoch=3, base_sequence=11,
    )


@pytest.fixture
def frame_factory() -> FrameFactory:
    return build_frame


@pytest.fixture
def rich_batch() -> bytearray:
    return build_rich_batch()
