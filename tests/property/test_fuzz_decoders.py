"""Hypothesis fuzzing of every decoder (RELIABILITY.md T23): only the declared errors escape.

Each decoder of ``ferrymq.protocol`` (and the broker's users-file parser) is fed arbitrary bytes
and mutations of valid inputs, whole and one byte at a time where it is incremental. An
exception outside the decoder's declared set is a bug (a crash a peer could trigger). The last
test does the same over the network: hostile frame sequences against a live broker with
authentication on, after each of which a control client must still be served and its data be
intact.

``fuzz/fuzz_decoders.py`` runs the same targets under atheris for longer runs.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.security_helpers import make_user, write_users

import ferrymq
from ferrymq.broker.auth import parse_users, render_users
from ferrymq.errors import (
    BrokerError,
    ConfigError,
    CorruptRecordError,
    InvalidRequestError,
    ProtocolError,
    RemoteProtocolError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol import records as r
from ferrymq.protocol.auth import (
    MECHANISM,
    ScramClient,
    ScramCredential,
    ScramServer,
    check_user_name,
    decoy_credential,
)
from ferrymq.protocol.dedup import read_dedup_keys
from ferrymq.protocol.frames import FrameDecoder, encode_frame, split_response
from ferrymq.protocol.letters import parse_letter
from ferrymq.protocol.markers import marker_of
from ferrymq.protocol.schedule import parse_due, read_due_times
from ferrymq.protocol.tags import parse_tag_expression
from ferrymq.storage import Log, LogConfig, write_checkpoint
from ferrymq.storage.schedule import WATERMARKS_FILE, ScheduleStore

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
NET = settings(max_examples=40, deadline=None, database=None,
               suppress_health_check=list(HealthCheck))

REQUEST_TYPES = list(m.REQUESTS.values())
BODY_TYPES = sorted({*REQUEST_TYPES, *(c.RESPONSE for c in REQUEST_TYPES)},
                    key=lambda c: c.__name__)
_BATCH = bytes(r.encode_batch([
    r.RecordInput(b"body", 1, tag=b"t", keys=b"k", properties=r.encode_properties({"a": "b"})),
    r.RecordInput(b"", 2),
]))
SEEDS = [
    encode_frame(m.ApiKey.PING, 1, 0, 1, b"\x90"),
    encode_frame(m.ApiKey.PRODUCE, 1, 0, 2, m.ProduceRequest(1000, [("t", 0, _BATCH)]).encode()),
    encode_frame(m.ApiKey.AUTH_START, 1, 0, 3,
                 m.AuthStartRequest(MECHANISM, "alice", b"n" * 24).encode()),
    m.AuthFinishRequest(b"p" * 32).encode(),
    m.FetchRequest(1, 1, 1, [("t", 0, 0, 100, "*")]).encode(),
    _BATCH,
]


def mutated(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    """Arbitrary bytes, or a seed with a run of bytes overwritten, cut or extended."""
    splice = st.builds(lambda s, at, junk: s[:at] + junk + s[at + len(junk):],
                       st.sampled_from(seeds), st.integers(0, 400), st.binary(max_size=16))
    cut = st.builds(lambda s, at: s[:at], st.sampled_from(seeds), st.integers(0, 400))
    return st.binary(max_size=600) | splice | cut


def only(allowed: tuple[type[BaseException], ...], fn: Callable[[], Any]) -> None:
    """Run ``fn``; an exception outside ``allowed`` propagates (the test fails)."""
    with contextlib.suppress(*allowed):
        fn()


# --- frames and bodies --------------------------------------------------------------------------


@FUZZ
@given(data=mutated(SEEDS), max_frame=st.sampled_from([64, 4096, 1 << 20]))
def test_frame_decoder(data: bytes, max_frame: int) -> None:
    whole: list[Any] | None
    try:
        whole = [(f.api_key, f.correlation_id, bytes(f.payload))
                 for f in FrameDecoder(max_frame).feed(data)]
    except ProtocolError:
        whole = None
    dec = FrameDecoder(max_frame)
    split: list[Any] = []
    with contextlib.suppress(ProtocolError):
        for i in range(len(data)):
            split += [(f.api_key, f.correlation_id, bytes(f.payload))
                      for f in dec.feed(data[i:i + 1])]
            assert dec.buffered <= max_frame + 12
        if whole is not None:
            assert split == whole
    only((ProtocolError,), lambda: split_response(data))


@FUZZ
@given(data=mutated(SEEDS) | st.builds(msgpack.packb, st.lists(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=8)
    | st.text(max_size=8) | st.lists(st.integers(0, 2**32), max_size=3), max_size=12)))
def test_every_body_decoder(data: bytes) -> None:
    for cls in BODY_TYPES:
        only((ProtocolError,), lambda cls=cls: cls.decode(data))  # type: ignore[misc]
        only((ProtocolError,), lambda cls=cls: cls.decode(memoryview(data)))  # type: ignore[misc]


# --- record batches and what is stored in them -----------------------------------------------


def _fix_crcs(data: bytes) -> bytes:
    buf = bytearray(data)
    if len(buf) >= r.HEADER_SIZE:
        struct.pack_into("<I", buf, 24, r.crc32c(memoryview(buf)[28:]))
        r.seal_header_crc(buf, 0)
    return bytes(buf)


@FUZZ
@given(data=mutated([_BATCH]))
def test_record_decoders(data: bytes) -> None:
    corrupt = (ProtocolError, CorruptRecordError)
    for buf in (data, _fix_crcs(data)):
        only(corrupt, lambda buf=buf: r.decode_header(buf))  # type: ignore[misc]
        only(corrupt, lambda buf=buf: r.check_stored_batch(buf))  # type: ignore[misc]
        only(corrupt, lambda buf=buf: r.decode_records(buf))  # type: ignore[misc]
        only(corrupt, lambda buf=buf: r.decode_properties(buf))  # type: ignore[misc]
        only((*corrupt, BrokerError), lambda buf=buf: r.validate_batch(  # type: ignore[misc]
            buf, max_message_bytes=256, max_records=1000, check_header_crc=True))

        def walk(buf: bytes = buf) -> None:
            for pos, h in r.iter_batches(buf):
                for rec in r.iter_raw_records(buf, pos, h):
                    r.record_fields(buf, rec[2] - r.RECORD_PREFIX_SIZE)
                    r.decode_properties(buf[rec[5]:rec[6]])
                with contextlib.suppress(CorruptRecordError):
                    marker_of(buf, pos, h)
                with contextlib.suppress(InvalidRequestError, *corrupt):
                    read_dedup_keys(buf, pos, h)
                with contextlib.suppress(InvalidRequestError, *corrupt):
                    read_due_times(buf, pos, h, max_delay_ms=1000, now_ms=0)

        only(corrupt, walk)


props = st.dictionaries(st.sampled_from(["%ORIGIN_TOPIC", "%ORIGIN_QUEUE", "%ORIGIN_OFFSET",
                                         "%ORIGIN_MSG_ID", "%RECONSUME", "%DELAY_MS",
                                         "%DELIVER_AT", "%DEDUP", "a"]) | st.text(max_size=8),
                        st.text(max_size=12) | st.integers(-5, 10**15).map(str), max_size=6)


@FUZZ
@given(p=props, text=st.text(max_size=64))
def test_property_and_text_decoders(p: dict[str, str], text: str) -> None:
    only((CorruptRecordError,), lambda: parse_letter(p))
    only((InvalidRequestError,), lambda: parse_due(p))
    only((InvalidRequestError,), lambda: parse_tag_expression(text))
    only((ValueError,), lambda: r.decode_msg_id(text))
    only((ValueError,), lambda: check_user_name(text))


# --- authentication -----------------------------------------------------------------------------

CRED = ScramCredential.derive("secret", b"s" * 16)


@FUZZ
@given(text=st.text(max_size=120) | st.just(CRED.encode()).map(lambda t: t[:-3] + "!!="))
def test_credential_decoder(text: str) -> None:
    only((ValueError,), lambda: ScramCredential.decode(text))


@FUZZ
@given(salt=st.binary(max_size=80), iterations=st.integers(-(2**63), 2**63),
       nonce=st.binary(max_size=80), proof=st.binary(max_size=80))
def test_scram_messages(salt: bytes, iterations: int, nonce: bytes, proof: bytes) -> None:
    if not 4096 <= iterations <= 20_000:  # keep PBKDF2 affordable; larger ones are refused
        iterations = iterations if iterations > 1_000_000 else iterations % 4096
    client = ScramClient("alice", "secret", b"c" * 24)
    only((RemoteProtocolError,), lambda: client.proof(salt, iterations, nonce))
    server = ScramServer("alice", CRED, b"c" * 24, b"s" * 24, decoy_credential("a", b"k" * 32))
    assert server.verify(proof) is None
    assert client.server_signature_ok(proof) is False or len(proof) == 32


@FUZZ
@given(text=st.text(max_size=300) | st.builds(
    lambda t, at, junk: t[:at] + junk + t[at:], st.just(render_users([
        make_user("a", "pw", produce=("x*",))])), st.integers(0, 400), st.text(max_size=12)))
def test_users_file_parser(text: str) -> None:
    only((ConfigError,), lambda: parse_users(text))


# --- on-disk decoders (fuzz/fuzz_decoders.py runs them under atheris) ------------------------------


def _log_with_trusted_junk(d: Path, batch_length: int) -> None:
    """A segment whose first header (offset 0, no records) has ``batch_length``, then a valid
    batch at offset 5 that the offset index names: a clean start checks only from that entry
    on and trusts what comes before it (atheris, target ``log``)."""
    d.mkdir()
    junk = bytearray(r.HEADER_SIZE)
    struct.pack_into("<qi", junk, 0, 0, batch_length)
    good = r.encode_batch([r.RecordInput(b"x", 0)])
    struct.pack_into("<q", good, 0, 5)
    r.seal_header_crc(good, 0)
    name = "0" * 20
    (d / f"{name}.log").write_bytes(bytes(junk) + bytes(good))
    (d / f"{name}.index").write_bytes(struct.pack("<II", 5, r.HEADER_SIZE))
    (d / f"{name}.timeindex").write_bytes(b"")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("batch_length", [-100, -12])
def test_clean_start_refuses_a_header_length_that_walks_backwards(tmp_path: Path,
                                                                   batch_length: int) -> None:
    """Found by atheris: the producer-state replay walked headers by their length field, so a
    negative one made ``os.pread`` fail with EINVAL (-100) or looped forever (-12)."""
    _log_with_trusted_junk(tmp_path / "q", batch_length)
    with pytest.raises(CorruptRecordError, match="has length"):
        Log.open(tmp_path / "q", LogConfig(), clean_shutdown=True, now_ms=0)


@pytest.mark.parametrize("doc", [{"version": 1, "watermarks": [[float("inf"), 0, 5]]},
                                 {"version": 1, "watermarks": [], "clock": [0, float("-inf"), 0, 0]}])
def test_scheduler_checkpoint_with_an_infinite_number_is_ignored(tmp_path: Path,
                                                                 doc: dict[str, Any]) -> None:
    """A CRC-valid watermark checkpoint holding a float infinity: int() raised OverflowError,
    which the reader did not catch (it escaped into the scheduler's start-up); now it is ignored like any
    other unreadable checkpoint."""
    store = ScheduleStore(tmp_path / "schedule")
    write_checkpoint(store.directory / WATERMARKS_FILE, msgpack.packb(doc))
    assert store.read_watermarks() in (None, {})
    assert store.read_clock() is None


# --- over the network ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ferrymq.Broker]:
    d = tmp_path_factory.mktemp("netfuzz")
    users = write_users(d / "users.toml", make_user("ctl", "ctl-pw", produce=("control",),
                                                    consume=("control",), groups=("ctl",)),
                        make_user("fz", "fz-pw", produce=("f*",), consume=("f*",),
                                  groups=("f*",)))
    with ferrymq.Broker(d / "data", users_file=str(users), flush="async",
                        auth_failure_delay_ms=100, auth_timeout_ms=2000) as b:
        yield b


_api = st.sampled_from([int(k) for k in m.ApiKey]) | st.integers(0, 0xFFFF)
_frame = st.builds(
    lambda key, ver, flags, corr, body: encode_frame(key, ver, flags, corr, body),
    _api, st.integers(0, 3), st.sampled_from([0, 0, 2, 1, 0x80]), st.integers(0, 2**32 - 1),
    mutated([s[12:] for s in SEEDS[:3]] + SEEDS[3:5]),
)


@pytest.mark.integration
@NET
@given(frames=st.lists(_frame | mutated(SEEDS), min_size=1, max_size=6),
       authenticate=st.booleans())
def test_hostile_sessions_against_a_live_broker(live: ferrymq.Broker, frames: list[bytes],
                                                authenticate: bool) -> None:
    host, port = live.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        if authenticate:
            from tests.security_helpers import RawClient
            raw = RawClient(live.address)
            try:
                assert raw.authenticate("fz", "fz-pw")[0] == 0
                with contextlib.suppress(OSError):
                    raw.sock.sendall(b"".join(frames))
                    raw.closed_within(0.05)
            finally:
                raw.close()
        else:
            with contextlib.suppress(OSError):
                s.sendall(b"".join(frames))
                s.settimeout(0.05)
                with contextlib.suppress(TimeoutError):
                    s.recv(65536)
    _control_check(live)


_sent: list[bytes] = []


def _control_check(b: ferrymq.Broker) -> None:
    body = f"control-{len(_sent)}".encode()
    with ferrymq.Producer(b.address, auth=("ctl", "ctl-pw"), linger_ms=0,
                         queue_selector=lambda _msg, _queues: 0) as p:
        assert p.send(ferrymq.Message("control", body)).offset == len(_sent)
    _sent.append(body)
    if len(_sent) % 10:
        return
    with ferrymq.PullConsumer(b.address, group="ctl", auth=("ctl", "ctl-pw"),
                              auto_commit=False, auto_offset_reset="earliest") as c:
        c.assign([("control", 0)])
        c.seek("control", 0, 0)
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(got) < len(_sent) and time.monotonic() < deadline:
            got += [msg.body for msg in c.poll(timeout=0.3)]
    assert got == _sent


def test_fuzz_covers_every_api() -> None:
    """New request types are fuzzed automatically: the strategies enumerate the registry."""
    assert {c.API_KEY for c in REQUEST_TYPES} == set(m.ApiKey)
    assert Path(__file__).exists()
