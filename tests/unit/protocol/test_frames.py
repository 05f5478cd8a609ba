"""Frame header encoding and the incremental FrameDecoder (sans-IO, no sockets)."""

from __future__ import annotations

import random
import struct

import pytest

from ferrymq.errors import ProtocolError, RemoteProtocolError
from ferrymq.protocol.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    FLAG_ONEWAY,
    FLAG_RESPONSE,
    HEADER_SIZE,
    Frame,
    FrameDecoder,
    encode_frame,
    encode_response,
    split_response,
)

FRAMES = [
    Frame(2, 1, 0, 1, b"\x90"),
    Frame(8, 1, FLAG_ONEWAY, 0xFFFFFFFF, b"x" * 1000),
    Frame(9, 255, FLAG_RESPONSE, 0, b""),
    Frame(0xFFFF, 0, FLAG_RESPONSE | FLAG_ONEWAY, 42, bytes(range(256))),
]


def _stream(frames: list[Frame]) -> bytes:
    return b"".join(
        encode_frame(f.api_key, f.api_version, f.flags, f.correlation_id, f.payload)
        for f in frames
    )


def _feed_chunks(data: bytes, sizes: list[int], decoder: FrameDecoder | None = None) -> list[Frame]:
    dec = decoder or FrameDecoder()
    out: list[Frame] = []
    pos = 0
    for n in sizes:
        out += dec.feed(data[pos : pos + n])
        pos += n
    out += dec.feed(data[pos:])
    return out


def test_header_layout() -> None:
    raw = encode_frame(0x0102, 3, FLAG_RESPONSE, 0x0A0B0C0D, b"abc")
    assert len(raw) == HEADER_SIZE + 3
    assert struct.unpack_from("<IHBBI", raw) == (8 + 3, 0x0102, 3, 1, 0x0A0B0C0D)
    assert raw[HEADER_SIZE:] == b"abc"


@pytest.mark.parametrize("frame", FRAMES)
def test_round_trip_one_frame(frame: Frame) -> None:
    dec = FrameDecoder()
    assert dec.feed(_stream([frame])) == [frame]
    assert dec.buffered == 0


def test_frame_flag_properties() -> None:
    assert Frame(1, 1, FLAG_RESPONSE, 1, b"").is_response
    assert not Frame(1, 1, FLAG_RESPONSE, 1, b"").oneway
    assert Frame(1, 1, FLAG_ONEWAY, 1, b"").oneway
    assert not Frame(1, 1, FLAG_ONEWAY, 1, b"").is_response


def test_whole_stream_at_once() -> None:
    assert FrameDecoder().feed(_stream(FRAMES)) == FRAMES


def test_one_byte_at_a_time() -> None:
    data = _stream(FRAMES)
    dec = FrameDecoder()
    out: list[Frame] = []
    for i in range(len(data)):
        out += dec.feed(data[i : i + 1])
    assert out == FRAMES
    assert dec.buffered == 0


@pytest.mark.parametrize("seed", range(20))
def test_random_chunkings(seed: int) -> None:
    rng = random.Random(seed)
    data = _stream(FRAMES * 3)
    sizes = [rng.randint(0, 40) for _ in range(rng.randint(1, 200))]
    assert _feed_chunks(data, sizes) == FRAMES * 3


def test_accepts_bytearray_and_memoryview() -> None:
    data = _stream(FRAMES)
    assert FrameDecoder().feed(bytearray(data)) == FRAMES
    assert FrameDecoder().feed(memoryview(data)) == FRAMES


def test_partial_frame_is_buffered_until_complete() -> None:
    data = _stream([FRAMES[1]])
    dec = FrameDecoder()
    assert dec.feed(data[:-1]) == []
    assert dec.buffered == len(data) - 1
    assert dec.feed(data[-1:]) == [FRAMES[1]]
    assert dec.buffered == 0


def test_empty_feed() -> None:
    dec = FrameDecoder()
    assert dec.feed(b"") == []
    assert dec.buffered == 0


def test_frame_exactly_at_max_is_accepted() -> None:
    max_bytes = 1024
    payload = b"p" * (max_bytes - HEADER_SIZE)
    raw = encode_frame(1, 1, 0, 1, payload)
    assert len(raw) == max_bytes
    assert FrameDecoder(max_bytes).feed(raw) == [Frame(1, 1, 0, 1, payload)]


def test_frame_one_over_max_is_rejected() -> None:
    max_bytes = 1024
    raw = encode_frame(1, 1, 0, 1, b"p" * (max_bytes - HEADER_SIZE + 1))
    with pytest.raises(RemoteProtocolError, match="exceeds max_frame_bytes"):
        FrameDecoder(max_bytes).feed(raw)


@pytest.mark.parametrize("declared", [2**31 - 1, 2**32 - 1, DEFAULT_MAX_FRAME_BYTES - 3])
def test_oversized_declared_length_raises_before_payload(declared: int) -> None:
    header = struct.pack("<IHBBI", declared, 2, 1, 0, 9)
    dec = FrameDecoder()
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        dec.feed(header)
    # nothing beyond the 12 header bytes was needed or buffered
    assert dec.buffered <= HEADER_SIZE


def test_oversized_declared_length_one_byte_at_a_time() -> None:
    header = struct.pack("<IHBBI", 2**31 - 1, 2, 1, 0, 9)
    dec = FrameDecoder()
    for b in header[:-1]:
        assert dec.feed(bytes([b])) == []
    with pytest.raises(RemoteProtocolError):
        dec.feed(header[-1:])
    assert dec.buffered <= HEADER_SIZE


def test_oversized_second_frame_rejected_after_good_first() -> None:
    good = encode_frame(2, 1, 0, 1, b"\x90")
    bad = struct.pack("<IHBBI", 2**31 - 1, 2, 1, 0, 2)
    dec = FrameDecoder()
    frames = dec.feed(good + bad)  # the good frame is delivered, the error kept
    assert [f.correlation_id for f in frames] == [1]
    assert isinstance(dec.error, RemoteProtocolError)
    with pytest.raises(RemoteProtocolError):
        dec.feed(b"")


@pytest.mark.parametrize("length", [0, 1, 7])
def test_too_short_length(length: int) -> None:
    header = struct.pack("<IHBBI", length, 2, 1, 0, 1)
    with pytest.raises(RemoteProtocolError, match="shorter than its header"):
        FrameDecoder().feed(header)


def test_length_eight_is_an_empty_payload() -> None:
    header = struct.pack("<IHBBI", 8, 2, 1, 0, 1)
    assert FrameDecoder().feed(header) == [Frame(2, 1, 0, 1, b"")]


@pytest.mark.parametrize("flags", [0x04, 0x08, 0x80, 0xFF, 0x07])
def test_unknown_flags(flags: int) -> None:
    with pytest.raises(RemoteProtocolError, match="unknown frame flags"):
        FrameDecoder().feed(encode_frame(2, 1, flags, 1, b"\x90"))


def test_errors_are_protocol_errors() -> None:
    assert issubclass(RemoteProtocolError, ProtocolError)


# --- responses ------------------------------------------------------------------------------


def test_encode_response_and_split() -> None:
    raw = encode_response(9, 1, 1234, 0, b"body")
    (frame,) = FrameDecoder().feed(raw)
    assert frame.is_response
    assert (frame.api_key, frame.api_version, frame.correlation_id) == (9, 1, 1234)
    assert split_response(frame.payload) == (0, b"body")


def test_split_response_error_code_and_message() -> None:
    raw = encode_response(0, 0, 0, 31, "too big \u2603".encode())
    (frame,) = FrameDecoder().feed(raw)
    code, body = split_response(frame.payload)
    assert code == 31
    assert bytes(body).decode() == "too big \u2603"


def test_split_response_code_only() -> None:
    assert split_response(b"\x06\x00") == (6, b"")
    assert split_response(b"\xff\xff") == (0xFFFF, b"")


@pytest.mark.parametrize("payload", [b"", b"\x00"])
def test_split_response_too_short(payload: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        split_response(payload)


def test_frames_before_a_bad_header_do_not_depend_on_chunking() -> None:
    good = encode_frame(2, 1, 0, 1, b"\x90")
    bad = struct.pack("<IHBBI", 2**31 - 1, 2, 1, 0, 2)

    def decode(chunks: list[bytes]) -> list[Frame]:
        dec = FrameDecoder()
        out: list[Frame] = []
        try:
            for c in chunks:
                out += dec.feed(c)
        except RemoteProtocolError:
            pass
        return out

    assert decode([good, bad]) == [Frame(2, 1, 0, 1, b"\x90")]
    assert decode([good + bad]) == decode([good, bad])
