"""Connection limits, slow readers, slow-loris and produce quotas (RELIABILITY.md T13/T21)."""

from __future__ import annotations

import re
import secrets
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ferrymq
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import MECHANISM, NONCE_BYTES
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.frames import encode_frame, split_response
from tests.helpers import BrokerProcess
from tests.security_helpers import RawClient, make_user, write_users

pytestmark = pytest.mark.integration


def test_connections_per_ip_and_total(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with ferrymq.Broker(tmp_path / "d", max_connections_per_ip=3, max_connections=5) as b:
        held = [RawClient(b.address) for _ in range(3)]
        for c in held:
            assert c.call(m.PingRequest())[0] == 0
        with RawClient(b.address) as extra:
            assert extra.closed_within(2.0)
            (f,) = extra.frames
            code, msg = split_response(f.payload)
            assert code == ErrorCode.BUSY and b"max_connections_per_ip=3" in bytes(msg)
        with pytest.raises(ferrymq.errors.ConnectionClosedError, match="max_connections_per_ip"), \
                ferrymq.AdminClient(b.address, reconnect_timeout_s=0.5) as admin:
            admin.hello()
        held.pop().close()
        deadline = time.monotonic() + 5
        while len(b.server.connections) > 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with ferrymq.AdminClient(b.address) as admin:  # a slot is free again
            admin.hello()
        assert b.server.limits.per_ip.get("127.0.0.1", 0) <= 3
        for c in held:
            c.close()
    assert "refusing connection" in caplog.text


@pytest.fixture(params=[512 * 1024])
def small_broker(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ferrymq.Broker]:
    """Small buffers, so that a slow reader hits the caps with little data."""
    with ferrymq.Broker(tmp_path / "d", flush="async", max_frame_bytes=256 * 1024,
                        max_message_bytes=128 * 1024, max_fetch_bytes=128 * 1024,
                        max_write_buffer_bytes=64 * 1024, max_write_queue_bytes=request.param,
                        write_stall_timeout_ms=800) as b:
        with ferrymq.Producer(b.address) as p:
            p.send_batch([ferrymq.Message("big", b"x" * 100_000, ) for _ in range(4)])
        yield b


def _slow_socket(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    return s


def _fetch_frame(corr: int) -> bytes:
    req = m.FetchRequest(0, 1, 128 * 1024, [("big", 0, 0, 128 * 1024, "*")])
    return encode_frame(m.ApiKey.FETCH, 1, 0, corr, req.encode())


def test_slow_reader_is_cut_off_at_the_write_queue_cap(small_broker: ferrymq.Broker,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    with _slow_socket(small_broker.address) as s:
        s.sendall(b"".join(_fetch_frame(i + 1) for i in range(64)))  # ~6 MiB of answers
        deadline = time.monotonic() + 10
        while "slow reader" not in caplog.text:
            assert time.monotonic() < deadline, "no cut-off"
            time.sleep(0.05)
    assert "max_write_queue_bytes=524288" in caplog.text
    assert not small_broker.server.connections or all(
        c.transport is None or c.transport.get_write_buffer_size() <= 512 * 1024 + 200_000
        for c in small_broker.server.connections)
    with ferrymq.AdminClient(small_broker.address) as admin:  # the broker is fine
        admin.hello()


@pytest.mark.parametrize("small_broker", [32 * 1024 * 1024], indirect=True)
def test_stalled_reader_is_cut_off(small_broker: ferrymq.Broker,
                                   caplog: pytest.LogCaptureFixture) -> None:
    with _slow_socket(small_broker.address) as s:
        # ~16 MB of answers: more than the kernel buffers, less than the cap
        s.sendall(b"".join(_fetch_frame(i + 1) for i in range(40)))
        deadline = time.monotonic() + 10
        while "stalled reader" not in caplog.text:
            assert time.monotonic() < deadline, "no cut-off"
            time.sleep(0.05)
    assert "slow reader" not in caplog.text


def test_produce_quota_throttles(tmp_path: Path) -> None:
    users = write_users(tmp_path / "u.toml",
                        make_user("slow", "pw-slow", produce=("q",), produce_bytes_per_s=100_000),
                        make_user("fast", "pw-fast", produce=("q",)),
                        make_user("root", "pw-root", admin=True))
    with ferrymq.Broker(tmp_path / "d", users_file=str(users), flush="async") as b:
        with ferrymq.AdminClient(b.address, auth=("root", "pw-root")) as admin:
            admin.create_topic("q", queues=1)
        timings = {}
        for user, pw in (("fast", "pw-fast"), ("slow", "pw-slow")):
            with ferrymq.Producer(b.address, auth=(user, pw), linger_ms=0) as p:
                t0 = time.monotonic()
                for _ in range(10):  # 10 x 30 KB = 300 KB; the bucket holds 100 KB
                    p.send(ferrymq.Message("q", b"y" * 30_000))
                timings[user] = time.monotonic() - t0
    assert timings["fast"] < 1.5, timings
    assert timings["slow"] >= 1.5, timings  # (300 - 100 - 30) KB at 100 KB/s, at least


def test_slow_loris_is_closed_and_others_are_served(tmp_path: Path) -> None:
    users = write_users(tmp_path / "u.toml", make_user("app", "app-pw", produce=("t",),
                                                       consume=("t",), groups=("g",)))
    with ferrymq.Broker(tmp_path / "d", users_file=str(users), auth_timeout_ms=1000,
                        flush="async", max_connections_per_ip=1000) as b:
        host, port = b.address.rsplit(":", 1)
        loris = []
        for i in range(200):
            s = socket.create_connection((host, int(port)))
            s.sendall(encode_frame(m.ApiKey.HELLO, 1, 0, i, b"\x92\xa1a\xa1b")[: 3 + i % 9])
            loris.append(s)
        with ferrymq.Producer(b.address, auth=("app", "app-pw"), linger_ms=0) as p:
            latencies = _send_latencies(p)
            deadline = time.monotonic() + 5
            while len(b.server.connections) > 1:
                assert time.monotonic() < deadline, f"{len(b.server.connections)} still open"
                time.sleep(0.05)
        for s in loris:  # each got the AUTHENTICATION_REQUIRED frame, then EOF
            s.settimeout(2)
            data = s.recv(65536)
            assert split_response(data[12:])[0] == ErrorCode.AUTHENTICATION_REQUIRED
            assert s.recv(65536) == b""
            s.close()
    assert statistics.median(latencies) < 0.05, latencies


def _pipeline_long_polls(b: ferrymq.Broker, c: RawClient, *, one_packet: bool) -> list[int]:
    """Send 10 long-poll fetches on an empty queue and a ping; their correlation ids."""
    with ferrymq.AdminClient(b.address) as admin:
        admin.create_topic("idle", 1)
    fetch = m.FetchRequest(5000, 1, 1 << 20, [("idle", 0, 0, 1 << 20, "")])
    if one_packet:
        return c.send(*[fetch] * 10, m.PingRequest())
    corrs = []
    for req in [*[fetch] * 10, m.PingRequest()]:
        corrs += c.send(req)
        time.sleep(0.05)  # one read each on the broker
    return corrs


def _check_capped(b: ferrymq.Broker, c: RawClient, corrs: list[int]) -> None:
    deadline = time.monotonic() + 5
    conn = None
    while conn is None or conn.in_flight < 4:
        assert time.monotonic() < deadline
        time.sleep(0.02)
        conn = next((x for x in b.server.connections if x.in_flight), None)
    time.sleep(0.3)
    assert conn.in_flight == 4  # the other 6 and the ping wait unread (TCP back-pressure)
    assert not c.closed_within(0.3) and not c.frames  # the ping is not answered yet
    with ferrymq.Producer(b.address) as p:  # data wakes the polls: the rest is read
        p.send(ferrymq.Message("idle", b"x"))
    seen = {f.correlation_id for f in c.frames}
    while len(seen) < len(corrs):
        f = c.read(timeout=10)
        assert f is not None
        seen.add(f.correlation_id)
    assert seen == set(corrs)


def test_in_flight_requests_per_connection_are_capped(tmp_path: Path) -> None:
    """Long polls beyond max_in_flight_per_connection are not read until answers go out."""
    with ferrymq.Broker(tmp_path / "d", max_in_flight_per_connection=4) as b, \
            RawClient(b.address) as c:
        _check_capped(b, c, _pipeline_long_polls(b, c, one_packet=False))


def test_in_flight_cap_holds_for_requests_pipelined_in_one_packet(tmp_path: Path) -> None:
    with ferrymq.Broker(tmp_path / "d", max_in_flight_per_connection=4) as b, \
            RawClient(b.address) as c:
        _check_capped(b, c, _pipeline_long_polls(b, c, one_packet=True))


def test_half_authenticated_connections_are_closed_at_the_auth_timeout(tmp_path: Path) -> None:
    """Clients that start the handshake (AUTH_START answered) and stall, some with half an
    AUTH_FINISH frame sent: closed after auth_timeout_ms; a fresh client keeps its latency."""
    users = write_users(tmp_path / "u.toml", make_user("app", "app-pw", produce=("t",)))
    with ferrymq.Broker(tmp_path / "d", users_file=str(users), auth_timeout_ms=1500,
                        flush="async", max_connections_per_ip=1000) as b:
        stalled = []
        t_open = time.monotonic()
        for i in range(150):
            c = RawClient(b.address)
            code, _ = c.call(m.AuthStartRequest(MECHANISM, "app" if i % 2 else "nobody",
                                                secrets.token_bytes(NONCE_BYTES)))
            assert code == 0  # a (decoy) challenge, even for an unknown user
            if i % 3 == 0:  # half an AUTH_FINISH frame, then silence
                c.sock.sendall(c.frame(m.AuthFinishRequest(b"\0" * 32))[:7])
            stalled.append(c)
        with ferrymq.Producer(b.address, auth=("app", "app-pw"), linger_ms=0) as p:
            latencies = _send_latencies(p)
            for c in stalled:
                assert c.closed_within(max(0.1, t_open + 6 - time.monotonic())), "not closed"
                code, msg = split_response(c.frames[-1].payload)
                assert code == ErrorCode.AUTHENTICATION_REQUIRED
                assert b"auth_timeout_ms=1500" in bytes(msg)
                c.close()
            assert time.monotonic() - t_open >= 1.4  # not before the timeout
            assert len(b.server.connections) == 1  # the producer's
    assert statistics.median(latencies) < 0.05, latencies


@pytest.mark.slow
def test_many_idle_connections(tmp_path: Path) -> None:
    """5,000 idle, unauthenticated connections: RSS per connection is recorded, a fresh
    client is served normally, and every idle one is closed after the auth timeout."""
    n = 5000
    users = write_users(tmp_path / "u.toml", make_user("app", "app-pw", produce=("t",)))
    with BrokerProcess(tmp_path / "data", flush="async", extra=[
            "--users-file", str(users)], env={
            "FERRYMQ_AUTH_TIMEOUT_MS": "4000", "FERRYMQ_MAX_CONNECTIONS_PER_IP": str(2 * n),
            "FERRYMQ_AUTH_FAILURE_DELAY_MS": "100"}) as bp:
        assert bp.proc is not None

        def rss_kib() -> int:
            text = Path(f"/proc/{bp.proc.pid}/status").read_text()  # type: ignore[union-attr]
            match = re.search(r"VmRSS:\s+(\d+) kB", text)
            assert match
            return int(match.group(1))

        with ferrymq.Producer(bp.address, auth=("app", "app-pw")) as p:
            p.send(ferrymq.Message("t", b"warm-up"))
        before = rss_kib()
        socks = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", bp.port))
            socks.append(s)
        time.sleep(1.0)
        after = rss_kib()
        per_conn = (after - before) * 1024 / n
        lat = []
        with ferrymq.Producer(bp.address, auth=("app", "app-pw"), linger_ms=0) as p:
            for i in range(50):
                t0 = time.perf_counter()
                p.send(ferrymq.Message("t", b"%d" % i))
                lat.append(time.perf_counter() - t0)
        t0 = time.monotonic()
        closed = 0
        for s in socks:
            s.settimeout(max(0.1, 10 - (time.monotonic() - t0)))
            try:
                data = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                data = b""
            if data[12:14] == ErrorCode.AUTHENTICATION_REQUIRED.to_bytes(2, "little"):
                closed += 1
            s.close()
        print(f"\n{n} idle connections: RSS {before} -> {after} KiB "
              f"({per_conn / 1024:.1f} KiB/connection); fresh producer p50 "
              f"{statistics.median(lat) * 1000:.1f} ms, max {max(lat) * 1000:.1f} ms; "
              f"{closed} closed by the auth timeout")
        assert per_conn < 20 * 1024, per_conn
        assert statistics.median(lat) < 0.05
        assert closed == n


def _send_latencies(p: ferrymq.Producer, n: int = 50) -> list[float]:
    """Seconds each of ``n`` one-message sends took (a fresh client's normal latency)."""
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        p.send(ferrymq.Message("t", b"%d" % i))
        out.append(time.perf_counter() - t0)
    return out
