"""The hand-rolled bulk encodings (PRODUCE, FETCH) are byte-identical to msgpack's, and the
zero-copy PRODUCE decoder agrees with the generic one."""

from __future__ import annotations

import msgpack
import pytest

from ferrymq.errors import RemoteProtocolError
from ferrymq.protocol import messages as m

SIZES = [0, 1, 15, 16, 255, 256, 65535, 65536, 70000]


@pytest.mark.parametrize("size", SIZES)
def test_produce_parts_equal_msgpack(size: int) -> None:
    req = m.ProduceRequest(30000, [("t", 3, b"x" * size), ("other", 0, b"y")])
    joined = b"".join(req.encode_parts())
    assert joined == req.encode()
    fast = m.ProduceRequest.decode(joined)
    assert [(t, q, bytes(b)) for t, q, b in fast.entries] == req.entries
    assert isinstance(fast.entries[0][2], memoryview)  # a view, not a copy
    assert fast.timeout_ms == 30000


def test_produce_many_entries_and_negative_and_big_ints() -> None:
    entries = [(f"t{i}", i, bytes([i % 256])) for i in range(20)]
    for timeout in (-1, -33, 127, 128, 2**16, 2**32, -(2**40)):
        req = m.ProduceRequest(timeout, entries)
        joined = b"".join(req.encode_parts())
        assert joined == req.encode()
        assert m.ProduceRequest.decode(joined).timeout_ms == timeout


def test_produce_unusual_encoding_takes_the_checked_path() -> None:
    # str8-encoded batch instead of bin: the fast path declines, the generic one refuses
    body = msgpack.packb([1, [["t", 0, "not-bytes"]]], use_bin_type=True)
    with pytest.raises(RemoteProtocolError):
        m.ProduceRequest.decode(body)
    # an extra trailing field: the generic path accepts and ignores it
    body = msgpack.packb([1, [["t", 0, b"abc", "extra"]]], use_bin_type=True)
    assert m.ProduceRequest.decode(body).entries == [("t", 0, b"abc")]


@pytest.mark.parametrize("size", SIZES)
def test_fetch_response_parts_equal_msgpack(size: int) -> None:
    resp = m.FetchResponse([("t", 1, 0, "", 10, 0, 7, b"z" * size), ("u", 2, 11, "gone", -1,
                                                                      -1, -1, b"")])
    joined = b"".join(resp.encode_parts())
    assert joined == resp.encode()
    assert m.FetchResponse.decode(joined) == resp
