"""Users files, ACL rules and limit policies, without a broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrymq.broker.acl import NEEDS, allows
from ferrymq.broker.auth import User, parse_users, read_users_file, render_users, update_users_file
from ferrymq.broker.limits import MAX_THROTTLE_S, ByteRateQuota, ConnectionLimits
from ferrymq.errors import ConfigError
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import SHA512_MECHANISM, ScramCredential

CRED = ScramCredential.derive("pw", b"s" * 16)
CRED512 = ScramCredential.derive("pw", b"t" * 16, mechanism=SHA512_MECHANISM)


def user(**kw: object) -> User:
    return User("u", CRED, **kw)  # type: ignore[arg-type]


def test_users_file_round_trip(tmp_path: Path) -> None:
    users = [User("a", CRED, True), User("b.c@d", CRED, False, ("o*", 'q"x'), ("z",), ("g-?",),
                                          1000, CRED512)]
    text = render_users(users)
    assert parse_users(text) == {u.name: u for u in users}
    assert text.count("scram_sha_512 = ") == 1  # only the user that has one
    assert parse_users(text)["b.c@d"].scram_sha_512 == CRED512
    f = tmp_path / "users.toml"
    update_users_file(f, {"a": users[0]})
    update_users_file(f, {"b.c@d": users[1]})
    assert f.stat().st_mode & 0o777 == 0o600
    assert read_users_file(f) == {u.name: u for u in users}
    f.chmod(0o640)  # an operator's choice survives rewrites
    update_users_file(f, {"a": None})
    assert list(read_users_file(f)) == ["b.c@d"]
    assert f.stat().st_mode & 0o777 == 0o640
    assert read_users_file(tmp_path / "missing.toml") == {}


@pytest.mark.parametrize("text", [
    "users = 3",
    "[users.x]\nscram = 'nope'",
    "[users.'bad name']\nscram = 'x'",
    f"[users.x]\nscram = '{CRED.encode()}'\nadmin = 'yes'",
    f"[users.x]\nscram = '{CRED.encode()}'\nproduce = 'orders'",
    f"[users.x]\nscram = '{CRED.encode()}'\nproduce = ['']",
    f"[users.x]\nscram = '{CRED.encode()}'\nproduce_bytes_per_s = -1",
    f"[users.x]\nscram = '{CRED.encode()}'\npassword = 'plain'",
    "not toml [",
    f"[users.x]\nscram = '{CRED512.encode()}'",  # the SHA-512 credential where SHA-256 goes
    f"[users.x]\nscram = '{CRED.encode()}'\nscram_sha_512 = '{CRED.encode()}'",
    f"[users.x]\nscram = '{CRED.encode()}'\nscram_sha_512 = "
    f"'{CRED512.encode().rsplit(':', 1)[0]}:AAAA'",  # a short server key
])
def test_bad_users_files(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_users(text)


def test_rights() -> None:
    u = user(produce=("orders*",), consume=("audit",), groups=("team-?",))
    assert allows(u, ("produce", "orders.eu")) and not allows(u, ("produce", "Orders"))
    assert allows(u, ("describe", "audit")) and not allows(u, ("consume", "orders"))
    assert allows(u, ("group", "team-a")) and not allows(u, ("group", "team-ab"))
    assert not allows(u, ("admin", ""))
    # a group's own retry and dead-letter topics follow the group right; other internals: admin
    assert allows(u, ("consume", "%RETRY%team-a")) and allows(u, ("consume", "%DLQ%team-b"))
    assert not allows(u, ("consume", "%DLQ%other")) and not allows(u, ("consume", "%HALF%"))
    assert not allows(user(produce=("*",)), ("produce", "%SCHEDULE%"))
    assert allows(user(admin=True), ("admin", "")) and allows(user(admin=True), ("produce", "%x"))
    assert not allows(user(), ("describe", "orders"))  # default deny


def test_every_api_has_an_acl_rule() -> None:
    assert set(NEEDS) == set(m.ApiKey), sorted(set(m.ApiKey) - set(NEEDS))


def test_connection_limits() -> None:
    lim = ConnectionLimits(max_total=3, max_per_ip=2)
    assert lim.admit("a") is None and lim.admit("a") is None
    assert "max_connections_per_ip=2" in (lim.admit("a") or "")
    assert lim.admit("b") is None
    assert "max_connections=3" in (lim.admit("c") or "")
    lim.release("a")
    assert lim.admit("c") is None
    assert lim.per_ip == {"a": 1, "b": 1, "c": 1} and lim.total == 3


def test_byte_rate_quota() -> None:
    now = [0.0]
    q = ByteRateQuota(lambda: now[0], burst_s=1.0)
    assert q.spend("u", 0, 10**9) == 0.0  # no quota
    assert q.spend("u", 1000, 600) == 0.0
    assert q.spend("u", 1000, 600) == pytest.approx(0.2)  # 200 bytes of debt at 1000 B/s
    now[0] = 0.2
    assert q.spend("u", 1000, 0) == 0.0
    now[0] = 10.0  # refills only up to the burst
    assert q.spend("u", 1000, 1500) == pytest.approx(0.5)
    assert q.spend("v", 1, 10**9) == MAX_THROTTLE_S
