"""Managing users over the wire (UPSERT_USER, DELETE_USER, LIST_USERS) against real brokers
with authentication on.

What must hold: a user added by an admin can log in and work within its rights at once (no
reload wait); a non-admin is denied with no side effect (the users file's bytes unchanged); a
removed user's handshakes fail and its open connections are closed; the last admin cannot be
removed or demoted; listings and logs never carry key material or secrets; the CLI does all of
it through a subprocess with the secrets on stdin or in the environment.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ferrymq
from ferrymq.broker.auth import (
    MAX_PATTERN_CHARS,
    MAX_PATTERNS,
    read_users_file,
    update_users_file,
)
from ferrymq.errors import (
    AccessDeniedError,
    AuthenticationDisabledError,
    AuthenticationFailedError,
    ConnectionClosedError,
    InvalidRequestError,
    UnknownUserError,
    UserAlreadyExistsError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import SHA512_MECHANISM, ScramCredential
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.frames import split_response
from tests.helpers import BrokerProcess
from tests.security_helpers import RawClient, make_user, write_users

pytestmark = pytest.mark.integration

ROOT = ("root", "root-secret-8d1c")
ALICE = ("alice", "alice-secret-2b7e")
CAROL = ("carol", "carol-secret-c4a9")
OPS = ("ops", "ops-secret-71f0")
SECRETS = [ROOT[1], ALICE[1], CAROL[1], OPS[1]]


def key_material(users_file: Path) -> list[str]:
    """Every salt and key of the file, as base64 (the users file form) and as hex."""
    out: list[str] = []
    for u in read_users_file(users_file).values():
        c = u.credential
        for raw in (c.salt, c.stored_key, c.server_key):
            out += [base64.b64encode(raw).decode(), raw.hex()]
    return out


@pytest.fixture
def users_file(tmp_path: Path) -> Path:
    return write_users(
        tmp_path / "users.toml",
        make_user(*ROOT, admin=True),
        make_user(*ALICE, produce=("orders*",), consume=("orders*",), groups=("alice-*",)),
    )


@pytest.fixture
def broker(tmp_path: Path, users_file: Path,
           caplog: pytest.LogCaptureFixture) -> Iterator[ferrymq.Broker]:
    caplog.set_level(logging.DEBUG)
    with ferrymq.Broker(tmp_path / "data", users_file=str(users_file), flush="async",
                        auth_failure_delay_ms=100) as b:
        with ferrymq.AdminClient(b.address, auth=ROOT) as admin:
            admin.create_topic("orders", queues=1)
            admin.create_topic("payroll", queues=1)
        yield b
    text = caplog.text
    for secret in SECRETS:
        assert secret not in text, "a secret reached the log"
    for material in key_material(users_file):
        assert material not in text, "key material reached the log"


def admin_client(broker: ferrymq.Broker, auth: tuple[str, str] = ROOT) -> ferrymq.AdminClient:
    return ferrymq.AdminClient(broker.address, auth=auth, reconnect_timeout_s=2.0)


def consume_all(address: str, auth: tuple[str, str], group: str, topic: str,
                expect: int) -> list[bytes]:
    got: list[bytes] = []
    with ferrymq.PullConsumer(address, group=group, auth=auth,
                              auto_offset_reset="earliest") as c:
        c.subscribe(topic)
        deadline = time.monotonic() + 10
        while len(got) < expect and time.monotonic() < deadline:
            got += [msg.body for msg in c.poll(timeout=0.3)]
    return got


# --- adding -------------------------------------------------------------------------------------


def test_added_user_works_at_once_within_its_rights(broker: ferrymq.Broker,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    with admin_client(broker) as admin:
        created = admin.add_user(CAROL[0], CAROL[1], produce=("orders*",), consume=("orders",),
                                 groups=("carol-*",))
    assert created is True
    # no wait for the housekeeping reload: the broker reloaded its users with the write
    with ferrymq.Producer(broker.address, auth=CAROL) as p:
        assert p.send(ferrymq.Message("orders", b"by carol")).offset == 0
        with pytest.raises(AccessDeniedError, match="on 'payroll'"):
            p.send(ferrymq.Message("payroll", b"not carol's"))
    assert consume_all(broker.address, CAROL, "carol-1", "orders", 1) == [b"by carol"]
    with pytest.raises(AccessDeniedError, match="group on 'alice-1'"):
        consume_all(broker.address, CAROL, "alice-1", "orders", 1)
    with admin_client(broker, CAROL) as a:
        who = a.whoami()
        assert (who.user, who.admin, who.produce, who.consume, who.groups) == (
            "carol", False, ["orders*"], ["orders"], ["carol-*"])
        with pytest.raises(AccessDeniedError, match="needs admin"):
            a.create_topic("carols", queues=1)
    assert "user 'carol' created by 'root' from 127.0.0.1:" in caplog.text


def test_replace_changes_secret_and_rights(broker: ferrymq.Broker, users_file: Path) -> None:
    with admin_client(broker) as admin:
        admin.add_user(*CAROL, produce=("orders",))
        before = users_file.read_bytes()
        with pytest.raises(UserAlreadyExistsError, match="carol"):
            admin.add_user(CAROL[0], "another-secret", admin=True)
        assert users_file.read_bytes() == before
        # an open connection of carol's keeps its session; rights are looked up per request
        with ferrymq.Producer(broker.address, auth=CAROL) as p, admin_client(broker, CAROL) as c:
            p.send(ferrymq.Message("orders", b"before"))
            assert c.whoami().produce == ["orders"]
            assert admin.add_user(CAROL[0], "carol-new-secret", consume=("orders",),
                                  replace=True) is False
            with pytest.raises(AccessDeniedError, match="produce on 'orders'"):
                p.send(ferrymq.Message("orders", b"after"))  # the very next request
            assert c.whoami().consume == ["orders"]  # same connection, still authenticated
    with pytest.raises(AuthenticationFailedError), admin_client(broker, CAROL) as a:
        a.hello()  # the old secret no longer logs in
    with admin_client(broker, (CAROL[0], "carol-new-secret")) as a:
        assert a.whoami().user == "carol"


def test_upsert_with_a_derived_credential(broker: ferrymq.Broker) -> None:
    cred = ScramCredential.derive(CAROL[1], b"0123456789abcdef", 5000)
    with admin_client(broker) as admin:
        assert admin.upsert_user("carol", cred, produce=("orders",)) is True
        assert admin.upsert_user("carol", cred, produce=("orders",)) is False  # idempotent
    with ferrymq.Producer(broker.address, auth=CAROL) as p:
        p.send(ferrymq.Message("orders", b"x"))


# --- denials and validation ---------------------------------------------------------------------


@pytest.mark.parametrize("op", ["add", "replace", "remove", "list"])
def test_non_admin_is_denied_without_side_effect(broker: ferrymq.Broker, users_file: Path,
                                                 op: str) -> None:
    before = users_file.read_bytes()
    with admin_client(broker) as admin:
        users_before = admin.list_users()
    calls = {
        "add": lambda a: a.add_user("mallory", "mallory-secret", admin=True),
        "replace": lambda a: a.add_user("alice", ALICE[1], admin=True, replace=True),
        "remove": lambda a: a.remove_user("root"),
        "list": lambda a: a.list_users(),
    }
    with admin_client(broker, ALICE) as a:
        with pytest.raises(AccessDeniedError, match="needs admin"):
            calls[op](a)
        assert a.whoami().user == "alice"  # the connection survives a denial
    assert users_file.read_bytes() == before
    with admin_client(broker) as admin:
        assert admin.list_users() == users_before


@pytest.mark.parametrize(("what", "name", "cred", "fields"), [
    ("name", "bad name", None, {}),
    ("name", "a" * 129, None, {}),
    ("name", "", None, {}),
    ("salt", "carol", ScramCredential(b"s" * 15, 4096, b"k" * 32, b"v" * 32), {}),
    ("salt", "carol", ScramCredential(b"s" * 65, 4096, b"k" * 32, b"v" * 32), {}),
    ("iterations", "carol", ScramCredential(b"s" * 16, 1, b"k" * 32, b"v" * 32), {}),
    ("iterations", "carol", ScramCredential(b"s" * 16, 10**7, b"k" * 32, b"v" * 32), {}),
    ("32 bytes", "carol", ScramCredential(b"s" * 16, 4096, b"k" * 31, b"v" * 32), {}),
    ("32 bytes", "carol", ScramCredential(b"s" * 16, 4096, b"k" * 32, b""), {}),
    ("patterns", "carol", None, {"produce": ["o"] * (MAX_PATTERNS + 1)}),
    ("characters", "carol", None, {"consume": ["x" * (MAX_PATTERN_CHARS + 1)]}),
    ("characters", "carol", None, {"groups": [""]}),
    ("control", "carol", None, {"produce": ["orders\n[users.x]"]}),
    ("produce_bytes_per_s", "carol", None, {"produce_bytes_per_s": -1}),
    ("produce_bytes_per_s", "carol", None, {"produce_bytes_per_s": 2**63}),
])
def test_invalid_upserts_are_refused(broker: ferrymq.Broker, users_file: Path, what: str,
                                     name: str, cred: ScramCredential | None,
                                     fields: dict[str, object]) -> None:
    before = users_file.read_bytes()
    good = ScramCredential.derive("x", b"s" * 16)
    with admin_client(broker) as admin:
        with pytest.raises(InvalidRequestError, match=what):
            admin.upsert_user(name, cred or good, **fields)  # type: ignore[arg-type]
        assert [u[0] for u in admin.list_users()] == ["alice", "root"]
    assert users_file.read_bytes() == before


def test_unknown_user(broker: ferrymq.Broker, users_file: Path) -> None:
    before = users_file.read_bytes()
    with admin_client(broker) as admin, pytest.raises(UnknownUserError, match="nobody"):
        admin.remove_user("nobody")
    assert users_file.read_bytes() == before


# --- removing -----------------------------------------------------------------------------------


def test_removed_user_is_cut_off(broker: ferrymq.Broker, users_file: Path,
                                 caplog: pytest.LogCaptureFixture) -> None:
    with admin_client(broker) as admin:
        admin.add_user(*CAROL, produce=("orders",))
    with RawClient(broker.address) as raw, ferrymq.Producer(broker.address, auth=CAROL) as p:
        assert raw.authenticate(*CAROL)[0] == 0
        p.send(ferrymq.Message("orders", b"while carol exists"))
        with admin_client(broker) as admin:
            assert admin.remove_user("carol") == 2  # the raw socket and the producer's
        # the open connection is closed, with the reason in a connection-level error frame
        assert raw.closed_within(2.0)
        reasons = [split_response(f.payload) for f in raw.frames if f.correlation_id == 0]
        assert [(code, bytes(text)) for code, text in reasons] == [
            (ErrorCode.AUTHENTICATION_FAILED,
             b"user 'carol' was deleted by 'root': connection closed")]
        # the producer's next send reconnects and its handshake fails
        with pytest.raises(AuthenticationFailedError):
            p.send(ferrymq.Message("orders", b"after removal"))
    with RawClient(broker.address) as raw:  # new handshakes fail
        assert raw.authenticate(*CAROL)[0] == ErrorCode.AUTHENTICATION_FAILED
    with pytest.raises(AuthenticationFailedError), admin_client(broker, CAROL) as a:
        a.hello()
    assert "carol" not in read_users_file(users_file)
    assert "user 'carol' deleted by 'root' from 127.0.0.1:" in caplog.text
    assert "2 open connections of it closed" in caplog.text


def test_user_removed_offline_is_cut_off(broker: ferrymq.Broker, users_file: Path) -> None:
    """``ferrymq user remove --users-file`` on the broker's host: the broker's reload closes
    the removed user's open connections too, and leaves everybody else's alone."""
    with admin_client(broker) as admin:
        admin.add_user(*CAROL, produce=("orders",))
    with RawClient(broker.address) as carol, RawClient(broker.address) as alice:
        assert carol.authenticate(*CAROL)[0] == 0
        assert alice.authenticate(*ALICE)[0] == 0
        update_users_file(users_file, {"carol": None})
        assert carol.closed_within(3.0)
        reasons = [split_response(f.payload) for f in carol.frames if f.correlation_id == 0]
        assert [(code, bytes(text)) for code, text in reasons] == [
            (ErrorCode.AUTHENTICATION_FAILED,
             b"user 'carol' was removed from the users file: connection closed")]
        assert not alice.closed_within(0.5)


def test_deleting_oneself_answers_then_closes(broker: ferrymq.Broker) -> None:
    with admin_client(broker) as admin:
        admin.add_user(*OPS, admin=True)
    with RawClient(broker.address) as raw:
        assert raw.authenticate(*OPS)[0] == 0
        code, body = raw.call(m.DeleteUserRequest("ops"))
        assert code == 0
        assert m.DeleteUserResponse.decode(body).connections_closed == 1
        assert raw.closed_within(2.0)
        assert any(f.correlation_id == 0 for f in raw.frames)


def test_the_last_admin_stays(broker: ferrymq.Broker, users_file: Path) -> None:
    before = users_file.read_bytes()
    with admin_client(broker) as admin:
        with pytest.raises(InvalidRequestError, match="last admin"):
            admin.remove_user("root")
        with pytest.raises(InvalidRequestError, match="last admin"):
            admin.add_user(*ROOT, produce=("orders",), replace=True)  # demoting it
        assert users_file.read_bytes() == before
        # with a second admin, either may go, and a non-admin may always go
        admin.add_user(*OPS, admin=True)
        admin.remove_user("alice")
        with admin_client(broker, OPS) as ops:
            assert ops.remove_user("root") == 1  # the connection of `admin`
            with pytest.raises(InvalidRequestError, match="last admin"):
                ops.remove_user("ops")
            assert [u[0] for u in ops.list_users()] == ["ops"]
        with pytest.raises(AuthenticationFailedError):
            admin.list_users()


def test_two_admins_removing_each_other_leave_one(broker: ferrymq.Broker) -> None:
    with admin_client(broker) as admin:
        admin.add_user(*OPS, admin=True)
    clients = {name: admin_client(broker, auth) for name, auth in (("root", ROOT), ("ops", OPS))}
    for c in clients.values():
        c.hello()
    errors: list[BaseException] = []

    def remove(by: str, victim: str) -> None:
        try:
            clients[by].remove_user(victim)
        except (InvalidRequestError, ConnectionClosedError, AuthenticationFailedError) as exc:
            errors.append(exc)

    threads = [threading.Thread(target=remove, args=("root", "ops")),
               threading.Thread(target=remove, args=("ops", "root"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c in clients.values():
        c.close()
    assert len(errors) == 1, errors
    survivors = [u for u in read_users_file(broker.config.users_file).values() if u.admin]
    assert len(survivors) == 1


# --- listing ------------------------------------------------------------------------------------


def test_list_shows_rights_and_no_key_material(broker: ferrymq.Broker, users_file: Path) -> None:
    with admin_client(broker) as admin:
        admin.add_user(*CAROL, produce=("orders", "orders.*"), groups=("c-?",),
                       produce_bytes_per_s=1000)
        assert admin.list_users() == [
            ("alice", False, ["orders*"], ["orders*"], ["alice-*"], 0),
            ("carol", False, ["orders", "orders.*"], [], ["c-?"], 1000),
            ("root", True, [], [], [], 0),
        ]
    with RawClient(broker.address) as raw:
        assert raw.authenticate(*ROOT)[0] == 0
        code, body = raw.call(m.ListUsersRequest())
    assert code == 0
    for u in read_users_file(users_file).values():
        for raw_key in (u.credential.salt, u.credential.stored_key, u.credential.server_key):
            assert raw_key not in body
    assert b"SCRAM" not in body


# --- authentication off -------------------------------------------------------------------------


def test_authentication_off(tmp_path: Path) -> None:
    with ferrymq.Broker(tmp_path / "d") as b, ferrymq.AdminClient(b.address) as admin:
        for call in (lambda: admin.list_users(), lambda: admin.add_user(*CAROL),
                     lambda: admin.remove_user("carol")):
            with pytest.raises(AuthenticationDisabledError, match="authentication is off"):
                call()
        res = cli("--server", b.address, "user", "list")
        assert res.returncode == 1, res
        assert res.stderr.strip().splitlines() == [
            "error: authentication is off on this broker (no users_file): there are no users "
            "to manage; start it with --users-file FILE to turn authentication on"]


# --- the command line, against a broker subprocess ---------------------------------------------


def cli(*args: str, env: dict[str, str] | None = None,
        stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("FERRYMQ_USER", "FERRYMQ_PASSWORD", "FERRYMQ_USERS_FILE")}
    return subprocess.run([sys.executable, "-m", "ferrymq.admin.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=60,
                          stdin=None if stdin is not None else subprocess.DEVNULL,
                          env={**base, **(env or {})})


def test_cli_round_trip(tmp_path: Path, users_file: Path) -> None:
    with BrokerProcess(tmp_path / "data", flush="async",
                       extra=["--users-file", str(users_file)]) as bp:
        root_env = {"FERRYMQ_SERVER": bp.address, "FERRYMQ_USER": ROOT[0],
                    "FERRYMQ_PASSWORD": ROOT[1]}
        assert cli("topic", "create", "orders", "--queues", "1", env=root_env).returncode == 0
        res = cli("user", "add", "dave", "--password-stdin", "--produce", "orders",
                  "--consume", "orders", "--group", "dave-*", env=root_env,
                  stdin="dave-secret-5e0a\n")
        assert res.returncode == 0, res.stderr
        assert res.stdout == f"user dave added on {bp.address}\n"
        assert "dave-secret-5e0a" not in users_file.read_text()
        assert read_users_file(users_file)["dave"].produce == ("orders",)
        sha512 = read_users_file(users_file)["dave"].scram_sha_512  # derived by the client
        assert sha512 is not None
        assert sha512 == ScramCredential.derive("dave-secret-5e0a", sha512.salt,
                                                sha512.iterations, SHA512_MECHANISM)

        # dave works at once
        dave_env = {"FERRYMQ_SERVER": bp.address, "FERRYMQ_USER": "dave",
                    "FERRYMQ_PASSWORD": "dave-secret-5e0a"}
        res = cli("produce", "orders", "from-dave", env=dave_env)
        assert res.returncode == 0, res.stderr

        # listing, as JSON, without key material
        res = cli("--json", "user", "list", env=root_env)
        assert res.returncode == 0, res.stderr
        listing = {u["user"]: u for u in json.loads(res.stdout)}
        assert listing["dave"] == {"user": "dave", "admin": False, "produce": ["orders"],
                                   "consume": ["orders"], "groups": ["dave-*"],
                                   "produce_bytes_per_s": 0}
        assert listing["root"]["admin"] is True
        for material in key_material(users_file):
            assert material not in res.stdout

        # a non-admin is refused, and the users file does not change
        before = users_file.read_bytes()
        for args in (["user", "list"], ["user", "remove", "root"],
                     ["user", "add", "eve", "--generate", "--admin"]):
            res = cli(*args, env=dave_env)
            assert res.returncode == 1 and "needs admin" in res.stderr, (args, res)
        assert users_file.read_bytes() == before

        res = cli("user", "add", "dave", "--generate", env=root_env)
        assert res.returncode == 1 and "exists" in res.stderr and "--replace" in res.stderr

        # a generated secret, replacing dave's: shown once, and it works
        res = cli("--json", "user", "add", "dave", "--generate", "--replace", "--consume",
                  "orders", env=root_env)
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert (out["user"], out["created"], out["server"]) == ("dave", False, bp.address)
        new_env = {**dave_env, "FERRYMQ_PASSWORD": out["secret"]}
        res = cli("--json", "whoami", env=new_env)
        assert json.loads(res.stdout)["consume"] == ["orders"]
        assert cli("whoami", env=dave_env).returncode == 1  # the old secret is gone

        res = cli("user", "remove", "root", env=root_env)
        assert res.returncode == 1 and "last admin" in res.stderr
        res = cli("--json", "user", "remove", "dave", env=root_env)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout) == {"user": "dave", "removed": True,
                                          "server": bp.address, "connections_closed": 0}
        assert "dave" not in read_users_file(users_file)

        # --user without a password and no terminal to ask on: a usage error
        res = cli("--user", "root", "--server", bp.address, "user", "list")
        assert res.returncode == 2 and "needs a password" in res.stderr

        # --users-file still edits the file offline (and the broker reloads it)
        res = cli("user", "add", "erin", "--users-file", str(users_file), "--password-stdin",
                  stdin="erin-secret-1\n")
        assert res.returncode == 0, res.stderr
        assert res.stdout == f"user erin written to {users_file}\n"
        res = cli("--json", "user", "remove", "erin", "--users-file", str(users_file))
        assert json.loads(res.stdout) == {"user": "erin", "removed": True,
                                          "users_file": str(users_file)}
    log = bp.log_text()
    assert "user 'dave' created by 'root' from 127.0.0.1:" in log
    assert "user 'dave' replaced by 'root'" in log
    assert "user 'dave' deleted by 'root'" in log
    for secret in (*SECRETS, "dave-secret-5e0a", out["secret"], "erin-secret-1"):
        assert secret not in log
