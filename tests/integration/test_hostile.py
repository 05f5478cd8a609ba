"""Hostile input against a real in-process broker over raw sockets (RELIABILITY.md T22).

After every case a normal client must still work (a control message is produced, then every
control message so far is read back intact) and the process's memory must not have ballooned
(the broker runs in this process, so our RSS is its RSS).
"""

from __future__ import annotations

import contextlib
import random
import resource
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

import ferrymq
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.frames import (
    FLAG_ONEWAY,
    FLAG_RESPONSE,
    Frame,
    FrameDecoder,
    encode_frame,
    split_response,
)
from ferrymq.protocol.records import RecordInput, encode_batch

pytestmark = pytest.mark.integration

CONTROL = "control"
HOSTILE_TOPIC = "hostile-crc"
CLOSE_WITHIN_S = 1.0  # T22 wants 100 ms; leave room for a loaded 2-core CI machine
MAX_RSS_GROWTH = 50 * 1024 * 1024
PING = encode_frame(m.ApiKey.PING, 1, 0, 7, m.PingRequest().encode())
assert PING[12:] == b"\x90"


# --- fixtures -------------------------------------------------------------------------------


class Control:
    """The control client's data: what it sent, checked after every hostile case."""

    def __init__(self, broker: ferrymq.Broker) -> None:
        self.broker = broker
        self.sent: list[bytes] = []

    def check(self, label: str) -> None:
        body = f"control-{len(self.sent)}-{label}".encode()
        with ferrymq.Producer(self.broker.address) as p:
            res = p.send(ferrymq.Message(CONTROL, body, tags="ctl"))
        assert res.offset == len(self.sent)
        self.sent.append(body)
        got: list[bytes] = []
        with ferrymq.PullConsumer(self.broker.address, group="control-reader",
                                  auto_commit=False, auto_offset_reset="earliest") as c:
            c.assign([(CONTROL, 0)])
            c.seek(CONTROL, 0, 0)
            deadline = time.monotonic() + 10
            while len(got) < len(self.sent) and time.monotonic() < deadline:
                got += [msg.body for msg in c.poll(timeout=0.5)]
        assert got == self.sent


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ferrymq.Broker]:
    data = tmp_path_factory.mktemp("hostile") / "data"
    with ferrymq.Broker(data, port=0, flush="async", flush_interval_ms=50) as b:
        with ferrymq.AdminClient(b.address) as admin:
            admin.create_topic(CONTROL, queues=1)
            admin.create_topic(HOSTILE_TOPIC, queues=1)
        yield b


@pytest.fixture(scope="module")
def control(broker: ferrymq.Broker) -> Control:
    return Control(broker)


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.fixture(autouse=True)
def after_each_case(
    request: pytest.FixtureRequest, broker: ferrymq.Broker, control: Control
) -> Iterator[None]:
    rss0, peak0 = _rss(), _peak_rss()
    yield
    control.check(request.node.name)
    assert _rss() - rss0 < MAX_RSS_GROWTH
    assert _peak_rss() - peak0 < MAX_RSS_GROWTH  # catches a transient huge allocation too
    assert not broker.server.shutting_down


# --- raw socket helpers ---------------------------------------------------------------------


@contextlib.contextmanager
def raw(broker: ferrymq.Broker) -> Iterator[socket.socket]:
    host, port = broker.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        yield sock
    finally:
        sock.close()


def read_until_closed(sock: socket.socket, timeout: float = 5.0) -> tuple[list[Frame], float]:
    """Read every frame until the broker closes; return them and how long the close took."""
    dec = FrameDecoder()
    frames: list[Frame] = []
    t0 = time.monotonic()
    sock.settimeout(timeout)
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        except TimeoutError:
            pytest.fail(f"broker did not close the connection within {timeout} s")
        if not data:
            break
        frames += dec.feed(data)
    return frames, time.monotonic() - t0


def read_frame(sock: socket.socket, timeout: float = 5.0) -> Frame:
    """Read exactly one response frame."""
    dec = FrameDecoder()
    sock.settimeout(timeout)
    while True:
        data = sock.recv(65536)
        assert data, "broker closed the connection"
        frames = dec.feed(data)
        if frames:
            assert len(frames) == 1
            return frames[0]


def assert_closed_with(sock: socket.socket, code: ErrorCode) -> str:
    """The broker answers with one error frame (correlation id 0) and closes, quickly."""
    frames, took = read_until_closed(sock)
    assert took < CLOSE_WITHIN_S
    assert len(frames) == 1, frames
    f = frames[0]
    assert f.correlation_id == 0
    assert f.is_response
    got, message = split_response(f.payload)
    assert got == code, (ErrorCode(got), message)
    return bytes(message).decode()


def request(sock: socket.socket, api_key: int, payload: bytes, *, version: int = 1,
            corr: int = 99) -> tuple[int, bytes]:
    sock.sendall(encode_frame(api_key, version, 0, corr, payload))
    f = read_frame(sock)
    assert f.is_response
    assert (f.correlation_id, f.api_key, f.api_version) == (corr, api_key, version)
    code, body = split_response(f.payload)
    return code, bytes(body)


def assert_ping_works(sock: socket.socket) -> None:
    sock.sendall(PING)
    f = read_frame(sock)
    assert (f.correlation_id, f.api_key, f.is_response) == (7, m.ApiKey.PING, True)
    assert split_response(f.payload) == (0, b"\x90")


def wait_connections(broker: ferrymq.Broker, at_most: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while len(broker.server.connections) > at_most:
        assert time.monotonic() < deadline, "broker kept a dead connection"
        time.sleep(0.01)


# --- framing attacks: the connection is closed ----------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_random_bytes(broker: ferrymq.Broker, seed: int) -> None:
    rng = random.Random(seed)
    junk = rng.randbytes(rng.choice([1, 11, 12, 100, 4096, 65536]))
    with raw(broker) as sock:
        with contextlib.suppress(ConnectionError):
            sock.sendall(junk)
            sock.shutdown(socket.SHUT_WR)
        frames, _ = read_until_closed(sock)
    for f in frames:  # whatever came back is a well-formed response
        assert f.is_response
        split_response(f.payload)


def test_http_get(broker: ferrymq.Broker) -> None:
    with raw(broker) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: ferrymq\r\nUser-Agent: curl/8\r\n\r\n")
        # "GET " read as a little-endian u32 is ~542 MB: refused before any buffering
        assert "exceeds max_frame_bytes" in assert_closed_with(sock, ErrorCode.FRAME_TOO_LARGE)


def test_tls_client_hello_on_plaintext_port(broker: ferrymq.Broker) -> None:
    hello = bytes.fromhex("16030100c4010000c00303") + bytes(32) + b"\x00\x00\x02\x13\x01\x01\x00"
    with raw(broker) as sock:
        sock.sendall(hello)
        sock.shutdown(socket.SHUT_WR)
        frames, took = read_until_closed(sock)
    assert took < CLOSE_WITHIN_S
    assert all(f.correlation_id == 0 for f in frames)


@pytest.mark.parametrize(
    ("length", "code"),
    [
        (2**31 - 1, ErrorCode.FRAME_TOO_LARGE),
        (2**32 - 1, ErrorCode.FRAME_TOO_LARGE),
        (0, ErrorCode.INVALID_REQUEST),
        (7, ErrorCode.INVALID_REQUEST),
        ("max+1", ErrorCode.FRAME_TOO_LARGE),
    ],
)
def test_bad_declared_length(broker: ferrymq.Broker, length: int | str, code: ErrorCode) -> None:
    if length == "max+1":
        length = broker.config.max_frame_bytes - 4 + 1
    assert isinstance(length, int)
    header = struct.pack("<IHBBI", length, m.ApiKey.PING, 1, 0, 5)
    with raw(broker) as sock:
        sock.sendall(header)  # no payload follows: the broker must not wait for it
        assert_closed_with(sock, code)


def test_frame_at_max_is_read_then_answered(broker: ferrymq.Broker) -> None:
    # the largest legal frame (a PING padded with trailing ignored bytes is not msgpack, so it
    # is answered INVALID_REQUEST) and the connection stays usable
    payload = b"\x90" + b"\x00" * (broker.config.max_frame_bytes - 12 - 1)
    with raw(broker) as sock:
        code, _ = request(sock, m.ApiKey.PING, payload)
        assert code == ErrorCode.INVALID_REQUEST
        assert_ping_works(sock)


@pytest.mark.parametrize("flags", [0x04, 0x80, 0xFF])
def test_unknown_flags_close(broker: ferrymq.Broker, flags: int) -> None:
    with raw(broker) as sock:
        sock.sendall(encode_frame(m.ApiKey.PING, 1, flags, 5, b"\x90"))
        assert_closed_with(sock, ErrorCode.INVALID_REQUEST)


def test_response_frame_from_client_closes(broker: ferrymq.Broker) -> None:
    with raw(broker) as sock:
        sock.sendall(encode_frame(m.ApiKey.PING, 1, FLAG_RESPONSE, 5, b"\x00\x00\x90"))
        assert_closed_with(sock, ErrorCode.INVALID_REQUEST)


def test_good_frame_then_bad_frame(broker: ferrymq.Broker) -> None:
    bad = struct.pack("<IHBBI", 2**31 - 1, m.ApiKey.PING, 1, 0, 5)
    with raw(broker) as sock:
        sock.sendall(PING + bad)
        frames, took = read_until_closed(sock)
    assert took < CLOSE_WITHIN_S
    # the ping completed before the bad header is answered, whatever the TCP chunking; then
    # the connection ends with the error frame
    assert [f.correlation_id for f in frames] == [7, 0]
    assert split_response(frames[-1].payload)[0] == ErrorCode.FRAME_TOO_LARGE


def test_truncated_frame_stall_then_close(broker: ferrymq.Broker) -> None:
    before = len(broker.server.connections)
    with raw(broker) as sock:
        sock.sendall(struct.pack("<IHBBI", 8 + 1000, m.ApiKey.PING, 1, 0, 5) + b"\x90" * 10)
        time.sleep(0.3)
        sock.settimeout(0.2)
        with pytest.raises(TimeoutError):  # the broker waits for the rest: nothing to say yet
            sock.recv(1)
        conns = [c for c in broker.server.connections if c.decoder.buffered]
        assert conns and all(c.decoder.buffered <= 12 + 10 for c in conns)
    wait_connections(broker, before)


def test_large_declared_frame_stall_is_not_preallocated(broker: ferrymq.Broker) -> None:
    before = len(broker.server.connections)
    rss0 = _rss()
    socks = []
    try:
        for _ in range(20):  # 20 x 8 MiB claimed: 160 MiB if lengths were trusted
            s = socket.create_connection(tuple(broker.server.address), timeout=5)
            s.sendall(struct.pack("<IHBBI", broker.config.max_frame_bytes - 4, 8, 1, 0, 1))
            socks.append(s)
        time.sleep(0.3)
        assert _rss() - rss0 < 20 * 1024 * 1024
    finally:
        for s in socks:
            s.close()
    wait_connections(broker, before)


def test_one_byte_at_a_time(broker: ferrymq.Broker) -> None:
    with raw(broker) as sock:
        for b in PING:
            sock.sendall(bytes([b]))
            time.sleep(0.002)
        f = read_frame(sock)
        assert split_response(f.payload) == (0, b"\x90")


def test_many_pipelined_requests(broker: ferrymq.Broker) -> None:
    frames = b"".join(encode_frame(m.ApiKey.PING, 1, 0, i, b"\x90") for i in range(1, 501))
    with raw(broker) as sock:
        sock.sendall(frames)
        dec = FrameDecoder()
        got: list[Frame] = []
        sock.settimeout(5)
        while len(got) < 500:
            data = sock.recv(65536)
            assert data
            got += dec.feed(data)
    assert sorted(f.correlation_id for f in got) == list(range(1, 501))


# --- request-level attacks: an error response, the connection lives on ----------------------


@pytest.mark.parametrize("api_key", [0, max(m.ApiKey) + 1, 999, 0xFFFF])
def test_unknown_api_key(broker: ferrymq.Broker, api_key: int) -> None:
    with raw(broker) as sock:
        code, msg = request(sock, api_key, b"\x90")
        assert code == ErrorCode.UNKNOWN_API
        assert str(api_key) in msg.decode()
        assert_ping_works(sock)


def test_unknown_api_key_oneway_gets_no_answer(broker: ferrymq.Broker) -> None:
    with raw(broker) as sock:
        sock.sendall(encode_frame(999, 1, FLAG_ONEWAY, 3, b"\x90"))
        assert_ping_works(sock)  # the first answer is the ping's


@pytest.mark.parametrize("version", [0, 2, 255])
def test_unsupported_version(broker: ferrymq.Broker, version: int) -> None:
    with raw(broker) as sock:
        code, _ = request(sock, m.ApiKey.PING, b"\x90", version=version)
        assert code == ErrorCode.UNSUPPORTED_VERSION
        code, _ = request(sock, m.ApiKey.METADATA, m.MetadataRequest(None, False).encode(),
                          version=version)
        assert code == ErrorCode.UNSUPPORTED_VERSION
        assert_ping_works(sock)


@pytest.mark.parametrize(
    "payload",
    [
        b"\x92\xdd\x80\x00\x00\x00",  # topics: a list claiming 2**31 items in a 6-byte body
        b"\x92\xdd\xff\xff\xff\xff\xc3",
        b"\x92\xdf\x80\x00\x00\x00\xc3",  # a map claiming 2**31 pairs
        b"\xdd\x80\x00\x00\x00",  # the body itself claims 2**31 fields
        b"\x92\xc6\xff\xff\xff\xff",  # bin claiming 4 GiB
        b"\x91" * 50_000,  # deep nesting
        b"",
        b"\xc1",
        msgpack.packb([["t"] * (m.MAX_LIST_ITEMS + 1), True]),
        msgpack.packb({"topics": None}),
    ],
)
def test_hostile_body(broker: ferrymq.Broker, payload: bytes) -> None:
    with raw(broker) as sock:
        code, _ = request(sock, m.ApiKey.METADATA, payload)
        assert code == ErrorCode.INVALID_REQUEST
        assert_ping_works(sock)


@pytest.mark.parametrize("api_key", list(m.ApiKey))
def test_garbage_body_for_every_api(broker: ferrymq.Broker, api_key: m.ApiKey) -> None:
    with raw(broker) as sock:
        code, _ = request(sock, api_key, msgpack.packb([1.5] * 10))
        if m.REQUESTS[api_key].SCHEMA:
            assert code == ErrorCode.INVALID_REQUEST
        assert_ping_works(sock)


def _batch(body: bytes) -> bytearray:
    return encode_batch([RecordInput(body, int(time.time() * 1000), tag=b"x")])


def test_produce_corrupt_batch(broker: ferrymq.Broker) -> None:
    bad_crc = _batch(b"corrupt me")
    bad_crc[-1] ^= 0x01  # body CRC now wrong
    good = _batch(b"good")
    with raw(broker) as sock:
        req = m.ProduceRequest(5000, [
            (HOSTILE_TOPIC, 0, bytes(bad_crc)),
            (HOSTILE_TOPIC, 0, bytes(good)),
            (HOSTILE_TOPIC, 0, b""),
            (HOSTILE_TOPIC, 0, b"\x00" * 64),
            (HOSTILE_TOPIC, 0, bytes(good[:-1])),
        ])
        code, body = request(sock, m.ApiKey.PRODUCE, req.encode())
        assert code == 0
        results = m.ProduceResponse.decode(body).results
        assert [r[2] for r in results] == [
            ErrorCode.CORRUPT_MESSAGE, 0, ErrorCode.CORRUPT_MESSAGE, ErrorCode.CORRUPT_MESSAGE,
            ErrorCode.CORRUPT_MESSAGE,
        ]
        assert results[0][4:7] == (-1, -1, -1)
        stored_at = results[1][4]
        assert_ping_works(sock)
    with ferrymq.PullConsumer(broker.address, group="hostile-reader", auto_commit=False) as c:
        c.assign([(HOSTILE_TOPIC, 0)])
        c.seek(HOSTILE_TOPIC, 0, stored_at)
        got = c.poll(timeout=5)
    assert [(msg.offset, msg.body) for msg in got] == [(stored_at, b"good")]


def test_produce_batch_with_bad_records_but_valid_crc(broker: ferrymq.Broker) -> None:
    # a hostile producer makes a batch whose record lengths lie, then fixes the CRC; the
    # broker stores it (no per-record walk), but a consumer must not crash on it
    buf = _batch(b"lying")
    struct.pack_into("<I", buf, 64, 0xFFFFFF)
    from ferrymq.protocol.records import crc32c, seal_header_crc

    struct.pack_into("<I", buf, 24, crc32c(memoryview(buf)[28:]))
    seal_header_crc(buf, 0)
    with raw(broker) as sock:
        req = m.ProduceRequest(5000, [(HOSTILE_TOPIC, 0, bytes(buf))])
        code, body = request(sock, m.ApiKey.PRODUCE, req.encode())
        assert code == 0
        (res,) = m.ProduceResponse.decode(body).results
        assert res[2] in (0, ErrorCode.CORRUPT_MESSAGE)
        assert_ping_works(sock)
        if res[2] == 0:  # fetch it back raw: the broker answers, whatever the records hold
            fetch = m.FetchRequest(0, 1, 1 << 20, [(HOSTILE_TOPIC, 0, res[4], 1 << 20, "*")])
            code, _ = request(sock, m.ApiKey.FETCH, fetch.encode(), corr=100)
            assert code == 0
            fetch = m.FetchRequest(0, 1, 1 << 20, [(HOSTILE_TOPIC, 0, res[4], 1 << 20, "x")])
            code, _ = request(sock, m.ApiKey.FETCH, fetch.encode(), corr=101)
            assert code in (0, ErrorCode.CORRUPT_MESSAGE)
            assert_ping_works(sock)


def test_produce_to_unknown_topic_and_queue(broker: ferrymq.Broker) -> None:
    with raw(broker) as sock:
        req = m.ProduceRequest(5000, [("no-such-topic", 0, bytes(_batch(b"x"))),
                                      (HOSTILE_TOPIC, 99, bytes(_batch(b"x"))),
                                      (HOSTILE_TOPIC, -1, bytes(_batch(b"x")))])
        code, body = request(sock, m.ApiKey.PRODUCE, req.encode())
        assert code == 0
        codes = [r[2] for r in m.ProduceResponse.decode(body).results]
        assert codes[0] == ErrorCode.UNKNOWN_TOPIC
        assert codes[1:] == [ErrorCode.UNKNOWN_QUEUE] * 2


# --- names ----------------------------------------------------------------------------------

BAD_NAMES = ["../evil", "..", ".", "a/b", "/abs", "", "x" * 250, "a\x00b", "%INTERNAL%x",
             "sp ace", "..\\evil", "caf\u00e9", "tab\t"]


def test_bad_topic_names_via_metadata_auto_create(broker: ferrymq.Broker) -> None:
    with raw(broker) as sock:
        code, body = request(sock, m.ApiKey.METADATA, m.MetadataRequest(BAD_NAMES, True).encode())
        assert code == 0
        topics = m.MetadataResponse.decode(body).topics
        assert [(t[0], t[1], t[3]) for t in topics] == [
            (n, -1, ErrorCode.INVALID_TOPIC_NAME) for n in BAD_NAMES
        ]
        assert_ping_works(sock)
    data = Path(broker.config.data_dir)
    assert not (data.parent / "evil").exists()
    assert not (data / "evil").exists()
    names = {t[0] for t in _all_topics(broker)}
    assert names.isdisjoint(BAD_NAMES)


def test_bad_topic_names_via_create_topic(broker: ferrymq.Broker) -> None:
    with raw(broker) as sock:
        for name in BAD_NAMES:
            code, _ = request(sock, m.ApiKey.CREATE_TOPIC,
                              m.CreateTopicRequest(name, 1, {}).encode())
            assert code == ErrorCode.INVALID_TOPIC_NAME, name
        assert_ping_works(sock)


def test_invalid_utf8_topic_name_is_refused(broker: ferrymq.Broker) -> None:
    # a str that is not UTF-8 cannot become a name at all: the whole body is INVALID_REQUEST
    payload = b"\x92\x91\xa5ab\xff\xfe/\xc3"
    with raw(broker) as sock:
        code, _ = request(sock, m.ApiKey.METADATA, payload)
        assert code == ErrorCode.INVALID_REQUEST
        code, _ = request(sock, m.ApiKey.CREATE_TOPIC, b"\x93\xa2\xc0\xaf\x01\x80")
        assert code == ErrorCode.INVALID_REQUEST
        assert_ping_works(sock)
    assert all("\ufffd" not in t[0] for t in _all_topics(broker))


@pytest.mark.parametrize("name", ["nl-topic\n", "..\n"])
def test_topic_name_with_trailing_newline_is_refused(broker: ferrymq.Broker, name: str) -> None:
    with raw(broker) as sock:
        code, body = request(sock, m.ApiKey.METADATA, m.MetadataRequest([name], True).encode())
        assert code == 0
        (t,) = m.MetadataResponse.decode(body).topics
        assert t[3] == ErrorCode.INVALID_TOPIC_NAME


def _all_topics(broker: ferrymq.Broker) -> list[m.TopicMeta]:
    with raw(broker) as sock:
        code, body = request(sock, m.ApiKey.METADATA, m.MetadataRequest(None, False).encode())
        assert code == 0
        return m.MetadataResponse.decode(body).topics


def test_many_connections_opened_and_dropped(broker: ferrymq.Broker) -> None:
    before = len(broker.server.connections)
    for i in range(50):
        with raw(broker) as sock:
            if i % 2:
                sock.sendall(PING[: i % 12])
    wait_connections(broker, before)


# --- poison batches: CRC-valid, structurally hostile ----------------------------------------


def _lying_batch() -> bytearray:
    """A batch whose first record length runs past the batch, with both CRCs fixed up."""
    from ferrymq.protocol.records import crc32c, seal_header_crc

    buf = _batch(b"lying")
    struct.pack_into("<I", buf, 64, 0xFFFFFF)
    struct.pack_into("<I", buf, 24, crc32c(memoryview(buf)[28:]))
    seal_header_crc(buf, 0)
    return buf


def _produce_raw(broker: ferrymq.Broker, topic: str, *batches: bytes) -> list[m.ProduceResult]:
    with raw(broker) as sock:
        req = m.ProduceRequest(5000, [(topic, 0, bytes(b)) for b in batches])
        code, body = request(sock, m.ApiKey.PRODUCE, req.encode())
        assert code == 0
        return m.ProduceResponse.decode(body).results


def test_poison_batch_does_not_block_the_queue(broker: ferrymq.Broker) -> None:
    """A CRC-valid batch whose record lengths lie (a faulty producer) is stored (the broker
    does no per-message work); the consumer raises a clear CorruptRecordError once, naming the
    offsets, and carries on with the next batch."""
    with ferrymq.AdminClient(broker.address) as admin:
        admin.create_topic("poison", queues=1)
    results = _produce_raw(broker, "poison", _lying_batch(), _batch(b"after"))
    assert [r[2] for r in results] == [0, 0]
    errors: list[str] = []
    with ferrymq.PullConsumer(broker.address, group="poison-reader", auto_commit=False) as c:
        c.assign([("poison", 0)])
        c.seek("poison", 0, 0)
        got: list[bytes] = []
        deadline = time.monotonic() + 5
        while b"after" not in got and time.monotonic() < deadline:
            try:
                got += [msg.body for msg in c.poll(timeout=0.5)]
            except ferrymq.errors.CorruptRecordError as exc:
                errors.append(str(exc))
    assert got == [b"after"]
    assert len(errors) == 1
    assert "malformed" in errors[0]
    assert "0..0" in errors[0]


def test_invalid_utf8_tag_does_not_crash_consumer(broker: ferrymq.Broker) -> None:
    bad = encode_batch([RecordInput(b"b", int(time.time() * 1000), tag=b"\xff\xfe")])
    (res,) = _produce_raw(broker, HOSTILE_TOPIC, bad)
    if res[2] != 0:  # refused at the door: that is a fix too
        assert res[2] == ErrorCode.CORRUPT_MESSAGE
        return
    with ferrymq.PullConsumer(broker.address, group="utf8-reader", auto_commit=False) as c:
        c.assign([(HOSTILE_TOPIC, 0)])
        c.seek(HOSTILE_TOPIC, 0, res[4])
        (msg,) = c.poll(timeout=5)
    assert isinstance(msg.tags, str)
