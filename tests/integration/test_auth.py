"""Authentication against a real broker: the bypass matrix (RELIABILITY.md T24/T25).

Every attempt to get around authentication must be refused with *no side effect*: the broker's
visible state (topics, their end offsets, groups) is snapshotted by an admin before and after.
Failed attempts must be delayed, closed, and logged without the secret.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ferrymq
from ferrymq.broker.auth import read_users_file
from ferrymq.broker.config import load
from ferrymq.errors import (
    AccessDeniedError,
    AuthenticationFailedError,
    AuthenticationRequiredError,
    ConfigError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import MECHANISM, SHA512_MECHANISM, ScramCredential
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.frames import encode_frame, split_response
from ferrymq.protocol.records import RecordInput, encode_batch
from tests.security_helpers import RawClient, make_user, write_users

pytestmark = pytest.mark.integration

ALICE = ("alice", "alice-secret-7f3a")
BOB = ("bob", "bob-secret-91c2")
ROOT = ("root", "root-secret-55d0")
SECRETS = [ALICE[1], BOB[1], ROOT[1]]
FAIL_DELAY_MS = 150
AUTH_TIMEOUT_MS = 800


@pytest.fixture
def users_file(tmp_path: Path) -> Path:
    return write_users(
        tmp_path / "users.toml",
        make_user(*ALICE, produce=("orders*",), consume=("orders*",), groups=("alice-*",)),
        make_user(*BOB, produce=("bob.*",), consume=("bob.*", "orders"), groups=("bob-*",)),
        make_user(*ROOT, admin=True),
    )


@pytest.fixture
def broker(tmp_path: Path, users_file: Path,
           caplog: pytest.LogCaptureFixture) -> Iterator[ferrymq.Broker]:
    caplog.set_level(logging.DEBUG)
    with ferrymq.Broker(tmp_path / "data", users_file=str(users_file),
                        auth_failure_delay_ms=FAIL_DELAY_MS,
                        auth_timeout_ms=AUTH_TIMEOUT_MS) as b:
        with ferrymq.AdminClient(b.address, auth=ROOT) as admin:
            admin.create_topic("orders", queues=1)
            admin.create_topic("bob.events", queues=1)
        with ferrymq.Producer(b.address, auth=ROOT) as p:
            p.send(ferrymq.Message("orders", b"first"))
        yield b
    text = caplog.text
    for secret in SECRETS:
        assert secret not in text, "a secret reached the log"


def snapshot(address: str) -> tuple[object, ...]:
    """What an admin sees: topics with their queue end offsets, and groups."""
    with ferrymq.AdminClient(address, auth=ROOT) as admin:
        topics = sorted(admin.list_topics())
        ends = {t[0]: [q[2] for q in admin.describe_topic(t[0]).queues] for t in topics}
        groups = sorted(admin.list_groups())
    return tuple(topics), tuple(sorted(ends.items())), tuple(groups)


def batch(body: bytes) -> bytes:
    return bytes(encode_batch([RecordInput(body, int(time.time() * 1000))]))


# --- the happy path -----------------------------------------------------------------------------


def test_authenticated_round_trip(broker: ferrymq.Broker) -> None:
    with ferrymq.Producer(broker.address, auth=ALICE) as p:
        res = p.send(ferrymq.Message("orders", b"hello"))
    assert res.offset == 1
    with ferrymq.PullConsumer(broker.address, group="alice-1", auth=ALICE,
                              auto_offset_reset="earliest") as c:
        c.subscribe("orders")
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += [msg.body for msg in c.poll(timeout=0.5)]
    assert got == [b"first", b"hello"]
    with ferrymq.AdminClient(broker.address, auth=ALICE) as admin:
        who = admin.whoami()
    assert (who.user, who.admin, who.produce) == ("alice", False, ["orders*"])


def test_auth_off_by_default(tmp_path: Path) -> None:
    with ferrymq.Broker(tmp_path / "d") as b, ferrymq.AdminClient(b.address) as admin:
        assert admin.whoami().user == ""
        with pytest.raises(AuthenticationFailedError, match="authentication is off"), \
                ferrymq.AdminClient(b.address, auth=ALICE) as a2:
            a2.hello()


# --- the bypass matrix --------------------------------------------------------------------------


def test_no_credentials(broker: ferrymq.Broker) -> None:
    before = snapshot(broker.address)
    with pytest.raises(AuthenticationRequiredError), ferrymq.Producer(broker.address) as p:
        p.send(ferrymq.Message("orders", b"anonymous"))
    with RawClient(broker.address) as raw:  # straight to PRODUCE, no handshake at all
        code, _ = raw.call(m.ProduceRequest(1000, [("orders", 0, batch(b"raw"))]))
        assert code == ErrorCode.AUTHENTICATION_REQUIRED
        assert raw.closed_within(1.0)
    assert snapshot(broker.address) == before


@pytest.mark.parametrize("creds", [
    ("alice", "wrong"),            # wrong secret
    ("alice", BOB[1]),             # a valid key with another key's secret
    ("bob", ALICE[1]),
    ("mallory", "whatever"),       # unknown user
    ("Alice", ALICE[1]),           # case variant
    ("\uff41lice", ALICE[1]),      # fullwidth look-alike
    ("a" * 200, ALICE[1]),         # overlong
    ("", ALICE[1]),                # empty
])
def test_bad_credentials(broker: ferrymq.Broker, creds: tuple[str, str],
                         caplog: pytest.LogCaptureFixture) -> None:
    before = snapshot(broker.address)
    user, secret = creds
    with RawClient(broker.address) as raw:
        scram_ok = True
        t0 = time.monotonic()
        try:
            code, _ = raw.authenticate(user, secret)
        except (AssertionError, ValueError):  # refused at AUTH_START (bad name)
            scram_ok = False
        took = time.monotonic() - t0
        if scram_ok:
            assert code == ErrorCode.AUTHENTICATION_FAILED
        assert took >= FAIL_DELAY_MS / 1000 * 0.9, f"failure answered after {took:.3f} s"
        assert raw.closed_within(1.0), "a failed handshake must close the connection"
    assert snapshot(broker.address) == before
    assert "authentication failed from" in caplog.text
    if len(user) <= 20 and user.isascii() and user:
        with pytest.raises(AuthenticationFailedError), \
                ferrymq.AdminClient(broker.address, auth=(user, secret)) as a:
            a.hello()


def test_unknown_user_is_indistinguishable(broker: ferrymq.Broker) -> None:
    """An unknown name gets a stable challenge shaped like a real one."""
    challenges = []
    for _ in range(2):
        with RawClient(broker.address) as raw:
            code, body = raw.call(m.AuthStartRequest(MECHANISM, "mallory", b"n" * 24))
            assert code == 0
            challenges.append(m.AuthStartResponse.decode(body))
    with RawClient(broker.address) as raw:
        real = m.AuthStartResponse.decode(raw.call(
            m.AuthStartRequest(MECHANISM, "alice", b"n" * 24))[1])
    assert challenges[0].salt == challenges[1].salt
    assert challenges[0].server_nonce != challenges[1].server_nonce
    assert len(challenges[0].salt) == len(real.salt)
    assert challenges[0].iterations == real.iterations


def test_requests_pipelined_before_the_handshake(broker: ferrymq.Broker) -> None:
    before = snapshot(broker.address)
    with RawClient(broker.address) as raw:
        raw.send(
            m.HelloRequest("evil", "0"),
            m.AuthStartRequest(MECHANISM, "alice", b"n" * 24),
            m.ProduceRequest(1000, [("orders", 0, batch(b"sneaky"))]),
            m.CreateTopicRequest("sneaky", 1, {}),
            m.AuthFinishRequest(b"\x00" * 32),
        )
        assert raw.closed_within(2.0)
        codes = [split_response(f.payload)[0] for f in raw.frames]
        assert codes == [0, 0, ErrorCode.AUTHENTICATION_REQUIRED], codes
    assert snapshot(broker.address) == before


def test_replayed_handshake(broker: ferrymq.Broker) -> None:
    """A proof captured from a good exchange is useless on a new connection (fresh nonce)."""
    with RawClient(broker.address) as raw:
        nonce = b"c" * 24
        code, body = raw.call(m.AuthStartRequest(MECHANISM, "alice", nonce))
        ch = m.AuthStartResponse.decode(body)
        from ferrymq.protocol.auth import ScramClient
        proof = ScramClient("alice", ALICE[1], nonce).proof(ch.salt, ch.iterations,
                                                            ch.server_nonce)
        assert raw.call(m.AuthFinishRequest(proof))[0] == 0
    before = snapshot(broker.address)
    with RawClient(broker.address) as raw:  # the attacker replays both messages verbatim
        assert raw.call(m.AuthStartRequest(MECHANISM, "alice", nonce))[0] == 0
        code, _ = raw.call(m.AuthFinishRequest(proof))
        assert code == ErrorCode.AUTHENTICATION_FAILED
        assert raw.closed_within(1.0)
    with RawClient(broker.address) as raw:  # or skips AUTH_START
        code, _ = raw.call(m.AuthFinishRequest(proof))
        assert code == ErrorCode.AUTHENTICATION_FAILED
    assert snapshot(broker.address) == before


def test_second_auth_start_is_refused(broker: ferrymq.Broker) -> None:
    with RawClient(broker.address) as raw:
        assert raw.call(m.AuthStartRequest(MECHANISM, "alice", b"n" * 24))[0] == 0
        code, _ = raw.call(m.AuthStartRequest(MECHANISM, "root", b"n" * 24))
        assert code == ErrorCode.AUTHENTICATION_FAILED
        assert raw.closed_within(1.0)


@pytest.mark.parametrize("op", ["create", "delete", "reset", "dlq_purge", "skip"])
def test_admin_operations_as_non_admin(broker: ferrymq.Broker, op: str) -> None:
    with ferrymq.PullConsumer(broker.address, group="alice-g", auth=ALICE,
                              auto_offset_reset="earliest") as c:
        c.subscribe("orders")
        c.poll(timeout=1.0)
        c.commit()
    before = snapshot(broker.address)
    calls = {
        "create": lambda a: a.create_topic("orders.new", queues=1),
        "delete": lambda a: a.delete_topic("orders"),
        "reset": lambda a: a.reset_offsets("alice-g", "orders", to="earliest"),
        "dlq_purge": lambda a: a.dlq_purge("alice-g"),
        "skip": lambda a: a.skip_message("alice-g", "0000000100000000000000000000"),
    }
    with ferrymq.AdminClient(broker.address, auth=ALICE) as admin:
        with pytest.raises(AccessDeniedError, match="needs admin"):
            calls[op](admin)
        admin.hello()  # the connection survives a denial
    assert snapshot(broker.address) == before


def test_listings_hold_only_what_the_user_may_see(broker: ferrymq.Broker) -> None:
    """Listing every topic or group needs no admin right: a user gets the topics it may
    describe and the groups it may use (Kafka's Metadata and ListGroups); an admin, all."""
    for user, group in ((ALICE, "alice-g"), (BOB, "bob-g")):
        with ferrymq.PullConsumer(broker.address, group=group, auth=user,
                                  auto_offset_reset="earliest") as c:
            c.subscribe("orders")
            c.poll(timeout=1.0)
            c.commit()
    with ferrymq.AdminClient(broker.address, auth=ALICE) as admin:
        assert [t[0] for t in admin.list_topics()] == ["orders"]
        assert [g[0] for g in admin.list_groups()] == ["alice-g"]
        assert [t.topic for t in admin.cluster_describe().queues] == ["orders"]
    with ferrymq.AdminClient(broker.address, auth=BOB) as admin:
        assert [t[0] for t in admin.list_topics()] == ["bob.events", "orders"]
        assert [g[0] for g in admin.list_groups()] == ["bob-g"]
    with ferrymq.AdminClient(broker.address, auth=ROOT) as admin:
        assert {"orders", "bob.events"} <= {t[0] for t in admin.list_topics()}
        assert [g[0] for g in admin.list_groups()] == ["alice-g", "bob-g"]


def test_consuming_another_users_group(broker: ferrymq.Broker) -> None:
    with ferrymq.PullConsumer(broker.address, group="bob-g", auth=BOB,
                              auto_offset_reset="earliest") as c:
        c.subscribe("orders")
        deadline = time.monotonic() + 10
        while not c.poll(timeout=0.5) and time.monotonic() < deadline:
            pass
        c.commit()
    before = snapshot(broker.address)

    def pull() -> None:
        with ferrymq.PullConsumer(broker.address, group="bob-g", auth=ALICE,
                                  auto_offset_reset="earliest") as c:
            c.subscribe("orders")
            c.poll(timeout=1.0)

    def simple() -> None:
        with ferrymq.SimpleConsumer(broker.address, "bob-delivery", auth=ALICE) as sc:
            sc.subscribe("orders")
            sc.receive(max_messages=1, wait=0.1)

    with pytest.raises(AccessDeniedError):
        pull()
    with pytest.raises(AccessDeniedError):
        simple()
    with pytest.raises(AccessDeniedError), \
            ferrymq.AdminClient(broker.address, auth=ALICE) as admin:
        admin.describe_group("bob-g")
    assert snapshot(broker.address) == before


def test_topic_outside_the_users_patterns(broker: ferrymq.Broker) -> None:
    before = snapshot(broker.address)
    with pytest.raises(AccessDeniedError), \
            ferrymq.Producer(broker.address, auth=ALICE) as p:
        p.send(ferrymq.Message("bob.events", b"not yours"))
    with pytest.raises(AccessDeniedError), \
            ferrymq.Producer(broker.address, auth=ALICE) as p:
        p.send(ferrymq.Message("../etc/passwd", b"traversal"))
    assert snapshot(broker.address) == before


# --- pre-authentication limits ------------------------------------------------------------------


def test_pre_auth_frame_limit(broker: ferrymq.Broker) -> None:
    with RawClient(broker.address) as raw:
        big = m.AuthStartRequest(MECHANISM, "alice", b"n" * 5000)
        raw.sock.sendall(raw.frame(big)[:12])  # only the header: refused before the payload
        assert raw.closed_within(1.0)
        (f,) = raw.frames
        assert split_response(f.payload)[0] == ErrorCode.FRAME_TOO_LARGE


def test_unauthenticated_connection_times_out(broker: ferrymq.Broker) -> None:
    with RawClient(broker.address) as idle, RawClient(broker.address) as loris:
        t0 = time.monotonic()
        assert idle.call(m.HelloRequest("idle", "0"))[0] == 0
        loris.sock.sendall(encode_frame(m.ApiKey.HELLO, 1, 0, 1, b"\x92")[:7])  # half a header
        assert idle.closed_within(AUTH_TIMEOUT_MS / 1000 + 2)
        assert loris.closed_within(1.0)
        took = time.monotonic() - t0
    assert AUTH_TIMEOUT_MS / 1000 * 0.9 <= took <= AUTH_TIMEOUT_MS / 1000 + 2
    (f,) = idle.frames
    assert split_response(f.payload)[0] == ErrorCode.AUTHENTICATION_REQUIRED


def test_authenticated_connection_is_not_timed_out(broker: ferrymq.Broker) -> None:
    with RawClient(broker.address) as raw:
        assert raw.authenticate(*ALICE)[0] == 0
        assert not raw.closed_within(AUTH_TIMEOUT_MS / 1000 + 0.5)
        assert raw.call(m.PingRequest())[0] == 0


# --- users file changes -------------------------------------------------------------------------


def test_users_file_reload(broker: ferrymq.Broker, users_file: Path) -> None:
    carol = ("carol", "carol-secret-0b1e")
    with pytest.raises(AuthenticationFailedError), \
            ferrymq.AdminClient(broker.address, auth=carol) as a:
        a.hello()
    write_users(users_file, make_user(*carol, produce=("orders",)))
    deadline = time.monotonic() + 5
    while True:
        try:
            with ferrymq.Producer(broker.address, auth=carol) as p:
                p.send(ferrymq.Message("orders", b"carol"))
            break
        except AuthenticationFailedError:
            assert time.monotonic() < deadline, "users file not reloaded"
            time.sleep(0.2)
    # rights are looked up per request: revoking them affects open connections at once
    with ferrymq.Producer(broker.address, auth=carol) as p:
        write_users(users_file, make_user(*carol))
        deadline = time.monotonic() + 5

        def send_until_denied() -> None:
            while time.monotonic() < deadline:
                p.send(ferrymq.Message("orders", b"carol"))
                time.sleep(0.2)

        with pytest.raises(AccessDeniedError):
            send_until_denied()


def test_broken_users_file_keeps_the_old_users(broker: ferrymq.Broker, users_file: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    good = users_file.read_text()
    users_file.write_text(good + "\n[users.x]\nscram = 'nonsense'\n")
    deadline = time.monotonic() + 5
    while "users file not reloaded" not in caplog.text:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with ferrymq.AdminClient(broker.address, auth=ALICE) as a:
        assert a.whoami().user == "alice"


# --- configuration and the CLI ------------------------------------------------------------------


def test_non_loopback_without_auth_is_refused(tmp_path: Path, users_file: Path) -> None:
    for host in ("0.0.0.0", "::", "192.168.1.10", "example.com"):
        with pytest.raises(ConfigError, match="without authentication"):
            load(overrides={"host": host, "data_dir": str(tmp_path)})
        load(overrides={"host": host, "insecure": True})
        load(overrides={"host": host, "users_file": str(users_file)})
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        load(overrides={"host": host})
    proc = subprocess.run([sys.executable, "-m", "ferrymq.broker", "--host", "0.0.0.0",
                           "--port", "0", "--data-dir", str(tmp_path / "d")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "without authentication" in proc.stderr and "--insecure" in proc.stderr


def test_missing_users_file_stops_the_broker(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        ferrymq.Broker(tmp_path / "d", users_file=str(tmp_path / "nope.toml")).start()


def _cli(*args: str, env: dict[str, str] | None = None, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ferrymq.admin.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_cli_user_add_and_login(broker: ferrymq.Broker, users_file: Path) -> None:
    r = _cli("user", "add", "dave", "--users-file", str(users_file), "--password-stdin",
             "--produce", "orders", "--consume", "orders", "--group", "dave-*",
             stdin="dave-secret-44\n")
    assert r.returncode == 0, r.stderr
    assert "dave-secret-44" not in users_file.read_text()
    sha512 = read_users_file(users_file)["dave"].scram_sha_512  # for Kafka's SCRAM-SHA-512
    assert sha512 is not None
    assert sha512 == ScramCredential.derive("dave-secret-44", sha512.salt, sha512.iterations,
                                            SHA512_MECHANISM)
    r = _cli("user", "add", "dave", "--users-file", str(users_file), "--generate")
    assert r.returncode == 1 and "exists" in r.stderr
    listing = _cli("--json", "user", "list", "--users-file", str(users_file))
    assert '"user": "dave"' in listing.stdout and "scram" not in listing.stdout.lower()
    env = {"FERRYMQ_SERVER": broker.address, "FERRYMQ_USER": "dave"}
    deadline = time.monotonic() + 5
    while True:
        r = _cli("produce", "orders", "from-cli", env={**env, "FERRYMQ_PASSWORD": "dave-secret-44"})
        if r.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.returncode == 0, r.stderr
    r = _cli("whoami", env={**env, "FERRYMQ_PASSWORD": "dave-secret-44"})
    assert "user:    dave" in r.stdout
    r = _cli("topic", "create", "x", "--queues", "1",
             env={**env, "FERRYMQ_PASSWORD": "dave-secret-44"})
    assert r.returncode == 1 and "needs admin" in r.stderr
    r = _cli("--user", "dave", "--password", "wrong", "--server", broker.address, "topic", "list")
    assert r.returncode == 1 and "authentication failed" in r.stderr
    r = _cli("--user", ROOT[0], "--server", broker.address, "--json", "topic", "list",
             env={"FERRYMQ_PASSWORD": ROOT[1]})
    assert r.returncode == 0 and "orders" in r.stdout
    assert _cli("user", "remove", "dave", "--users-file", str(users_file)).returncode == 0
