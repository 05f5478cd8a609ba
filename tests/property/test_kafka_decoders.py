"""Hypothesis fuzzing of the Kafka port's decoders: arbitrary bytes and mutations of valid
inputs raise only the declared FerryMQ errors (anything else is a crash a peer could cause)."""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrymq.errors import (
    AuthenticationFailedError,
    BrokerError,
    CorruptRecordError,
    FrameSizeError,
    RemoteProtocolError,
)
from ferrymq.protocol.auth import ScramCredential
from ferrymq.protocol.kafka import apis
from ferrymq.protocol.kafka.frames import KafkaFrameDecoder, decode_request_header
from ferrymq.protocol.kafka.records import CRC_START, to_ferrymq, to_kafka
from ferrymq.protocol.kafka.scram import KafkaScramServer, parse_client_first
from ferrymq.protocol.records import RecordInput, crc32c, encode_batch, stamp_batch

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
REQUESTS = [c for key, (lo, hi) in sorted(apis.SUPPORTED.items()) for v in range(lo, hi + 1)
            if (c := apis.request_class(key, v)) is not None]


def _ferry_batch(n: int) -> bytes:
    buf = encode_batch([RecordInput(f"v{i}".encode(), 1000 + i, b"tag", b"key", b"k1\x00k2",
                                    b"") for i in range(n)])
    stamp_batch(buf, 0, 5, 1)
    return bytes(buf)


VALID_KAFKA = to_kafka(_ferry_batch(3))


@FUZZ
@given(st.binary(max_size=300), st.integers(1, 50))
def test_frame_decoder_refuses_only_by_size(data: bytes, cut: int) -> None:
    d = KafkaFrameDecoder(64)
    try:
        for i in range(0, len(data), cut):
            for f in d.feed(data[i:i + cut]):
                assert 0 < len(f) <= 64
    except FrameSizeError:
        pass


@FUZZ
@given(st.binary(max_size=200), st.booleans(), st.sampled_from(REQUESTS))
def test_request_headers_and_bodies_raise_only_protocol_errors(
        data: bytes, flexible: bool, cls: type) -> None:
    try:
        h = decode_request_header(data, flexible=flexible)
        apis.decode_request(cls, data, h.body)
    except RemoteProtocolError:
        pass


def _reseal(b: bytearray) -> bytes:
    struct.pack_into(">I", b, 17, crc32c(memoryview(b)[CRC_START:]) & 0xFFFFFFFF)
    return bytes(b)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(VALID_KAFKA) - 1), st.integers(0, 255)),
                min_size=1, max_size=6), st.booleans())
def test_mutated_kafka_batches_raise_only_broker_errors(
        edits: list[tuple[int, int]], reseal: bool) -> None:
    b = bytearray(VALID_KAFKA)
    for pos, value in edits:
        b[pos] = value
    try:
        to_ferrymq(_reseal(b) if reseal else bytes(b), max_batch_bytes=1 << 16)
    except BrokerError:
        pass


@FUZZ
@given(st.binary(max_size=400))
def test_random_kafka_batches_raise_only_broker_errors(data: bytes) -> None:
    try:
        to_ferrymq(data, max_batch_bytes=1 << 16)
    except BrokerError:
        pass


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=4))
def test_stored_batches_that_do_not_parse_raise_corrupt_record(
        edits: list[tuple[int, int]]) -> None:
    b = bytearray(_ferry_batch(3))
    for pos, value in edits:
        if pos < len(b):
            b[pos] = value
    try:
        to_kafka(bytes(b))
    except CorruptRecordError:
        pass


@FUZZ
@given(st.binary(max_size=200), st.binary(max_size=200))
def test_scram_messages_raise_only_authentication_failed(first: bytes, final: bytes) -> None:
    cred = ScramCredential.derive("secret", b"0123456789abcdef")
    try:
        user, nonce, bare = parse_client_first(first)
        KafkaScramServer(user, cred, True, nonce, bare, b"n" * 24).finish(final)
    except AuthenticationFailedError:
        pass
