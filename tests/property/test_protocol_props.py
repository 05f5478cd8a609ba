"""Property tests for the protocol layer: round trips, chunking, decoders on arbitrary bytes."""

from __future__ import annotations

import inspect
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ferrymq.errors import CorruptRecordError, FerryMQError, ProtocolError
from ferrymq.protocol import messages as m
from ferrymq.protocol import records as r
from ferrymq.protocol.frames import (
    FLAG_ONEWAY,
    FLAG_RESPONSE,
    SCRATCH_BYTES,
    Frame,
    FrameDecoder,
    encode_frame,
)
from ferrymq.protocol.messages import schema

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MEDIUM = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ALLOWED = (ProtocolError, CorruptRecordError)
assert all(issubclass(e, FerryMQError) for e in ALLOWED)

BODY_TYPES = sorted(
    {cls for _, cls in inspect.getmembers(m, inspect.isclass)
     if issubclass(cls, m.Body) and cls not in (m.Body, m.Request)},
    key=lambda c: c.__name__,
)

text = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)


# --- strategies -----------------------------------------------------------------------------


def from_spec(spec: Any) -> st.SearchStrategy[Any]:
    """A strategy for values that satisfy one schema node (messages/schema.py)."""
    if isinstance(spec, schema.Scalar):
        t = spec.types[0]
        if t is int:
            return st.integers(-(2**63), 2**64 - 1)
        if t is str:
            return text
        if t is bytes:
            return st.binary(max_size=32)
        if t is bool:
            return st.booleans()
        if t is float:
            return st.floats(allow_nan=False)
    if isinstance(spec, schema.Opt):
        return st.none() | from_spec(spec.inner)
    if isinstance(spec, schema.ListOf):
        return st.lists(from_spec(spec.inner), max_size=4)
    if isinstance(spec, schema.Tup):
        return st.tuples(*(from_spec(s) for s in spec.items))
    if isinstance(spec, schema.StrMap):
        return st.dictionaries(text, text, max_size=4)
    raise AssertionError(f"no strategy for {spec!r}")


def bodies(cls: type[m.Body]) -> st.SearchStrategy[m.Body]:
    return st.builds(cls, *(from_spec(s) for s in cls.SCHEMA))


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | text | st.binary(max_size=16),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(text | st.binary(max_size=4) | st.integers(-100, 100), children,
                      max_size=4),
    max_leaves=20,
)

tag_bytes = st.text(st.characters(exclude_categories=("Cs",)), max_size=8).map(str.encode)
key_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"),
                   min_size=1, max_size=6)

records = st.builds(
    lambda body, ts, tag, sk, keys, props: (body, ts, tag, sk, keys, props),
    st.binary(max_size=64),
    st.integers(1_700_000_000_000, 1_700_000_000_000 + 2**30),
    st.none() | st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=20)
    .filter(lambda s: len(s.encode()) <= 255),
    st.none() | st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=20),
    st.lists(key_text, max_size=3),
    st.dictionaries(text, text, max_size=3),
)


# --- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", BODY_TYPES, ids=lambda c: c.__name__)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_body_round_trip(cls: type[m.Body], data: st.DataObject) -> None:
    body = data.draw(bodies(cls))
    assert cls.decode(body.encode()) == body


@FAST
@given(
    recs=st.lists(records, min_size=1, max_size=8),
    base=st.integers(0, 2**62),
    append_time=st.integers(0, 2**62),
    pid=st.integers(-1, 2**62),
    seq=st.integers(-1, 2**30),
)
def test_record_batch_round_trip(
    recs: list[tuple[Any, ...]], base: int, append_time: int, pid: int, seq: int
) -> None:
    inputs = [
        r.RecordInput(
            body, ts,
            tag.encode() if tag else b"",
            sk.encode() if sk else b"",
            "\x00".join(keys).encode(),
            r.encode_properties(props),
        )
        for body, ts, tag, sk, keys, props in recs
    ]
    buf = r.encode_batch(inputs, producer_id=pid, producer_epoch=0 if pid >= 0 else -1,
                         base_sequence=seq)
    h = r.validate_batch(buf, max_message_bytes=1 << 20, max_records=100,
                         check_header_crc=True)
    assert h.record_count == len(recs)
    r.stamp_batch(buf, 0, base, append_time)
    h = r.check_stored_batch(buf)
    assert (h.base_offset, h.append_time_ms, h.producer_id) == (base, append_time, pid)
    decoded = r.decode_records(buf)
    assert [
        (d.offset, d.timestamp, d.tag, d.sharding_key, d.keys, d.properties, d.body)
        for d in decoded
    ] == [
        (base + i, ts, tag, sk, tuple(keys), props, body)
        for i, (body, ts, tag, sk, keys, props) in enumerate(recs)
    ]
    # filtering any subset keeps offsets and bodies
    (pos, h), = r.iter_batches(buf)
    raw = list(r.iter_raw_records(buf, pos, h))
    keep = raw[::2]
    out = r.filter_batch(buf, pos, h, keep)
    assert r.check_stored_batch(out).attributes & r.ATTR_FILTERED
    assert [d.offset for d in r.decode_records(out)] == [k[0] for k in keep]


@FAST
@given(
    bodies=st.lists(st.sampled_from([0, 1, 100, r.LARGE_BODY_BYTES - 1, r.LARGE_BODY_BYTES,
                                     3 * r.LARGE_BODY_BYTES]), min_size=1, max_size=8),
    tags=st.lists(st.binary(max_size=4), min_size=8, max_size=8),
    seqs=st.tuples(st.integers(0, 2**62), st.integers(0, 2**15 - 1), st.integers(0, 2**30)),
)
def test_batch_buffers_are_the_same_bytes(bodies: list[int], tags: list[bytes],
                                          seqs: tuple[int, int, int]) -> None:
    """encode_batch_buffers sends what encode_batch writes, byte for byte, also after both are
    given a new producer id, epoch and sequence (the producer's new-epoch path)."""
    inputs = [r.RecordInput(bytes([i]) * n, 1_700_000_000_000 + i, tags[i])
              for i, n in enumerate(bodies)]
    joined = r.encode_batch(inputs, producer_id=7, producer_epoch=0, base_sequence=3)
    parts = r.encode_batch_buffers(inputs, producer_id=7, producer_epoch=0, base_sequence=3)
    assert bytes(parts) == joined and len(parts) == len(joined)
    large = sum(1 for n in bodies if n >= r.LARGE_BODY_BYTES)
    assert len(parts.parts) >= large  # each large body is a buffer of its own, not copied
    assert {id(p) for p in parts.parts} >= {id(i.body) for i in inputs
                                             if len(i.body) >= r.LARGE_BODY_BYTES}
    r.restamp_producer(joined, *seqs)
    r.restamp_producer(parts, *seqs)
    assert bytes(parts) == joined
    h = r.validate_batch(joined, max_message_bytes=1 << 20, max_records=100,
                         check_header_crc=True)
    assert (h.producer_id, h.producer_epoch, h.base_sequence) == seqs


# --- chunking -------------------------------------------------------------------------------

frames = st.builds(
    Frame,
    st.integers(0, 0xFFFF),
    st.integers(0, 0xFF),
    st.sampled_from([0, FLAG_RESPONSE, FLAG_ONEWAY, FLAG_RESPONSE | FLAG_ONEWAY]),
    st.integers(0, 0xFFFFFFFF),
    st.binary(max_size=100),
)


@MEDIUM
@given(fs=st.lists(frames, max_size=8), cuts=st.lists(st.integers(0, 2000), max_size=30))
def test_frame_decoder_any_chunking(fs: list[Frame], cuts: list[int]) -> None:
    data = b"".join(
        encode_frame(f.api_key, f.api_version, f.flags, f.correlation_id, f.payload) for f in fs
    )
    one_shot = FrameDecoder().feed(data)
    assert one_shot == fs
    points = sorted({c % (len(data) + 1) for c in cuts})
    dec = FrameDecoder()
    out: list[Frame] = []
    prev = 0
    for p in [*points, len(data)]:
        out += dec.feed(data[prev:p])
        prev = p
    assert out == one_shot
    assert dec.buffered == 0


_PATTERN = bytes(range(256)) * 512  # 128 KiB to cut payloads from


@FAST
@given(
    sizes=st.lists(st.integers(0, 100_000) | st.integers(0, 40), min_size=1, max_size=6),
    reads=st.lists(st.integers(1, 200_000), min_size=1, max_size=40),
    scratch=st.sampled_from([13, 100, 4096, SCRATCH_BYTES]),
    preallocate=st.booleans(),
)
def test_frame_decoder_buffered_protocol(sizes: list[int], reads: list[int], scratch: int,
                                         preallocate: bool) -> None:
    """Reads landing in get_buffer() (asyncio.BufferedProtocol), of any size the kernel may
    choose, give the same frames as the bytes that were sent, small and large, with and
    without preallocated frame buffers."""
    fs = [Frame(i % 7, 1, 0, i, _PATTERN[i : i + n]) for i, n in enumerate(sizes)]
    data = b"".join(
        encode_frame(f.api_key, f.api_version, f.flags, f.correlation_id, bytes(f.payload))
        for f in fs
    )
    dec = FrameDecoder(1 << 20, memoryview(bytearray(scratch)), preallocate=preallocate)
    out: list[Frame] = []
    pos = i = 0
    while pos < len(data):
        buf = dec.get_buffer(-1)
        assert len(buf) > 0
        k = min(len(buf), reads[i % len(reads)], len(data) - pos)
        i += 1
        buf[:k] = data[pos : pos + k]
        pos += k
        got = dec.buffer_updated(k)
        out += got
    assert out == fs
    assert dec.buffered == 0


# --- decoders on arbitrary input raise only protocol errors ---------------------------------


def _chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in [*points, len(data)]:
        out.append(data[prev:p])
        prev = p
    return out


@MEDIUM
@given(
    data=st.binary(max_size=300) | st.builds(lambda f, tail: encode_frame(*f) + tail,
                                             st.tuples(st.integers(0, 0xFFFF),
                                                       st.integers(0, 255), st.integers(0, 255),
                                                       st.integers(0, 2**32 - 1),
                                                       st.binary(max_size=40)),
                                             st.binary(max_size=40)),
    cuts=st.lists(st.integers(0, 400), max_size=10),
    max_frame=st.sampled_from([12, 64, 1 << 20]),
)
def test_frame_decoder_arbitrary_bytes(data: bytes, cuts: list[int], max_frame: int) -> None:
    dec = FrameDecoder(max_frame)
    try:
        for chunk in _chunked(data, cuts):
            for f in dec.feed(chunk):
                assert len(f.payload) + 12 <= max_frame
    except ALLOWED:
        pass
    assert dec.buffered <= max(len(data), 12)


@MEDIUM
@given(data=st.binary(max_size=200) | msgpack_values.map(msgpack.packb))
def test_every_body_decoder_arbitrary_bytes(data: bytes) -> None:
    for cls in BODY_TYPES:
        try:
            cls.decode(data)
        except ALLOWED:
            pass


@pytest.mark.parametrize("cls", [c for c in BODY_TYPES if c.SCHEMA], ids=lambda c: c.__name__)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_body_decoder_mutated_fields(cls: type[m.Body], data: st.DataObject) -> None:
    fields = list(m.astuple_shallow(data.draw(bodies(cls))))
    i = data.draw(st.integers(0, len(fields) - 1))
    fields[i] = data.draw(msgpack_values)
    if data.draw(st.booleans()):
        fields = fields[: data.draw(st.integers(0, len(fields)))]
    raw = msgpack.packb(fields, use_bin_type=True)
    try:
        out = cls.decode(raw)
    except ALLOWED:
        return
    assert type(out) is cls


def _walk_records(buf: bytes) -> None:
    for pos, h in r.iter_batches(buf):
        try:
            r.check_stored_batch(buf, pos)
        except ALLOWED:
            pass
        try:
            r.validate_batch(buf, pos, max_message_bytes=64, max_records=1000,
                             check_header_crc=True)
        except (*ALLOWED, FerryMQError):
            pass
        for rec in r.iter_raw_records(buf, pos, h):
            assert pos + r.HEADER_SIZE <= rec[2] <= rec[3] <= rec[4] <= rec[5] <= rec[6]
            assert rec[6] <= rec[7] <= pos + h.size
            r.record_fields(buf, rec[2] - r.RECORD_PREFIX_SIZE)
            try:
                r.decode_properties(buf[rec[5] : rec[6]])
            except ALLOWED:
                pass


def _fix_crcs(buf: bytearray) -> bytes:
    if len(buf) >= r.HEADER_SIZE:
        struct.pack_into("<I", buf, 24, r.crc32c(memoryview(buf)[28:]))
        r.seal_header_crc(buf, 0)
    return bytes(buf)


@MEDIUM
@given(data=st.binary(max_size=400))
def test_record_decoders_arbitrary_bytes(data: bytes) -> None:
    try:
        _walk_records(data)
    except ALLOWED:
        pass
    try:
        r.check_stored_batch(data)
    except ALLOWED:
        pass


@MEDIUM
@given(
    recs=st.lists(st.tuples(st.binary(max_size=20), tag_bytes), min_size=1, max_size=4),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1,
                   max_size=6),
    fix=st.booleans(),
)
def test_record_decoders_mutated_batches(
    recs: list[tuple[bytes, bytes]], edits: list[tuple[int, int]], fix: bool
) -> None:
    """Valid batches with bytes overwritten (and, half the time, CRCs fixed up to get past
    them): walking them raises only CorruptRecordError/ProtocolError."""
    buf = r.encode_batch([r.RecordInput(b, 5, tag=t) for b, t in recs])
    for at, value in edits:
        buf[at % len(buf)] = value
    data = _fix_crcs(buf) if fix else bytes(buf)
    assume(data != bytes(r.encode_batch([r.RecordInput(b, 5, tag=t) for b, t in recs])))
    try:
        _walk_records(data)
    except ALLOWED:
        pass
    if not fix:
        with pytest.raises(ALLOWED):
            r.check_stored_batch(data)
