"""The hand-rolled bulk encodings (PRODUCE, FETCH) are byte-identical to msgpack's, and the
zero-copy PRODUCE and REPLICA_FETCH answer decoders agree with the generic one."""

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


@pytest.mark.parametrize("size", SIZES)
def test_replica_fetch_response_decodes_batches_as_views(size: int) -> None:
    resp = m.ReplicaFetchResponse(
        [("t", 1, 0, "", 10, 12, 0, b"z" * size), ("u", 2, 11, "fenced", -1, -1, -1, b""),
         ("v", 300, 0, "", 2**40, 2**40 + 5, 2**33, b"ab")],
        [("t", 1, [(3, 0), (4, 9)]), ("v", 300, [])])
    joined = b"".join(resp.encode_parts())
    fast = m.ReplicaFetchResponse.decode(joined)
    assert fast == resp == m.ReplicaFetchResponse.decode(resp.encode())
    assert isinstance(fast.results[0][7], memoryview)  # a view, not a copy
    assert fast.results[0][7].obj is joined or size == 0


def test_replica_fetch_response_unusual_encodings_take_the_checked_path() -> None:
    long_msg = "x" * 70_000  # a str32, which the fast reader does not take
    body = msgpack.packb([[["t", 0, 1, long_msg, 0, 0, 0, b""]], []], use_bin_type=True)
    assert m.ReplicaFetchResponse.decode(body).results == [("t", 0, 1, long_msg, 0, 0, 0, b"")]
    # an older peer without the epochs: the generic path fills the default
    body = msgpack.packb([[["t", 0, 0, "", 0, 0, 0, b"x"]]], use_bin_type=True)
    assert m.ReplicaFetchResponse.decode(body).epochs == []
    # data as a str, not bin: the fast path declines, the generic one refuses
    body = msgpack.packb([[["t", 0, 0, "", 0, 0, 0, "not-bytes"]], []], use_bin_type=True)
    with pytest.raises(RemoteProtocolError):
        m.ReplicaFetchResponse.decode(body)


def test_replica_fetch_request_fast_decode_agrees_with_the_generic_one() -> None:
    for entries in ([], [("orders", 0, 3, 120, 118)],
                    [(f"t{i}", i, 2**33, -1, 2**40 + i) for i in range(300)]):
        req = m.ReplicaFetchRequest(2, 2**35, 500, 4 << 20, entries)
        raw = req.encode()
        assert m.ReplicaFetchRequest.decode(raw) == req
        assert m.ReplicaFetchRequest.decode(memoryview(raw)) == req
    # a bool where an int goes: the fast path declines, the generic one refuses
    with pytest.raises(RemoteProtocolError):
        m.ReplicaFetchRequest.decode(msgpack.packb([2, 1, True, 0, []]))
    # an extra trailing field in an entry: the generic path accepts and ignores it
    raw = msgpack.packb([2, 1, 0, 0, [["t", 0, 1, 2, 3, "extra"]]])
    assert m.ReplicaFetchRequest.decode(raw).entries == [("t", 0, 1, 2, 3)]
