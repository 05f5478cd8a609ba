"""Rules behind user administration, without a broker: what a users file may hold, checks that run
under the file lock, reload detection, and that requests do not show key material."""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
import pytest

from ferrymq.broker.auth import (
    MAX_PATTERN_CHARS,
    MAX_PRODUCE_BYTES_PER_S,
    User,
    UserStore,
    check_user,
    parse_users,
    read_users_file,
    render_users,
    update_users_file,
)
from ferrymq.errors import ConfigError
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import SHA512_MECHANISM, ScramCredential
from ferrymq.protocol.messages.schema import astuple_shallow

CRED = ScramCredential.derive("pw", b"s" * 16)
CRED512 = ScramCredential.derive("pw", b"s" * 16, mechanism=SHA512_MECHANISM)


def test_check_user_accepts_what_a_users_file_accepts() -> None:
    u = User("a.b@c-d_e", CRED, True, ("o*",), ("x" * MAX_PATTERN_CHARS,), ("g?",),
             MAX_PRODUCE_BYTES_PER_S, CRED512)
    assert check_user(u) is u
    assert parse_users(render_users([u])) == {u.name: u}


@pytest.mark.parametrize("bad", [
    User("no spaces", CRED),
    User("u", ScramCredential(b"s" * 15, 4096, b"k" * 32, b"v" * 32)),
    User("u", ScramCredential(b"s" * 65, 4096, b"k" * 32, b"v" * 32)),
    User("u", ScramCredential(b"s" * 16, 4095, b"k" * 32, b"v" * 32)),
    User("u", ScramCredential(b"s" * 16, 4096, b"k" * 33, b"v" * 32)),
    User("u", CRED, produce=("",)),
    User("u", CRED, groups=("x" * (MAX_PATTERN_CHARS + 1),)),
    User("u", CRED, consume=("a\x1bb",)),
    User("u", CRED, produce_bytes_per_s=-1),
    User("u", CRED, produce_bytes_per_s=MAX_PRODUCE_BYTES_PER_S + 1),
    User("u", CRED512),  # the SHA-512 credential where the SHA-256 one goes
    User("u", CRED, scram_sha_512=CRED),
    User("u", CRED, scram_sha_512=ScramCredential(b"s" * 16, 4096, b"k" * 32, b"v" * 32,
                                                  SHA512_MECHANISM)),
    User("u", CRED, scram_sha_512=ScramCredential(b"s" * 8, 4096, b"k" * 64, b"v" * 64,
                                                  SHA512_MECHANISM)),
])
def test_check_user_refuses(bad: User) -> None:
    with pytest.raises(ValueError) as info:
        check_user(bad)
    for key in (bad.credential.stored_key, bad.credential.server_key):
        assert key.hex() not in str(info.value)


def test_users_file_refuses_long_patterns_and_huge_quotas() -> None:
    with pytest.raises(ConfigError, match="longer than"):
        parse_users(f"[users.x]\nscram = '{CRED.encode()}'\n"
                    f"produce = ['{'x' * (MAX_PATTERN_CHARS + 1)}']")
    with pytest.raises(ConfigError, match="produce_bytes_per_s"):
        parse_users(f"[users.x]\nscram = '{CRED.encode()}'\nproduce_bytes_per_s = {2**62}")


def test_a_refusing_check_writes_nothing(tmp_path: Path) -> None:
    f = tmp_path / "users.toml"
    update_users_file(f, {"root": User("root", CRED, True)})
    before = f.read_bytes()
    seen: list[list[str]] = []

    def refuse(users: dict[str, User]) -> None:
        seen.append(sorted(users))
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        update_users_file(f, {"root": None}, refuse)
    assert seen == [["root"]]
    assert f.read_bytes() == before
    assert not (tmp_path / "users.toml.tmp").exists()


def test_store_sees_a_same_size_rewrite_within_one_mtime_tick(tmp_path: Path) -> None:
    f = tmp_path / "users.toml"
    update_users_file(f, {"u": User("u", CRED, produce=("aa",))})
    store = UserStore.open(f)
    st = f.stat()
    update_users_file(f, {"u": User("u", CRED, produce=("bb",))})
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: a new inode
    assert f.stat().st_size == st.st_size
    assert store.reload_if_changed()
    assert store.users == read_users_file(f)
    assert store.users["u"].produce == ("bb",)


def test_upsert_request_carries_the_sha512_credential_and_an_older_one_decodes() -> None:
    req = m.UpsertUserRequest("u", CRED.salt, CRED.iterations, CRED.stored_key,
                              CRED.server_key, False, [], [], [], 0, False, CRED512.salt,
                              CRED512.iterations, CRED512.stored_key, CRED512.server_key)
    assert m.UpsertUserRequest.decode(req.encode()) == req
    text = repr(req)
    assert repr(CRED512.stored_key) not in text and repr(CRED512.server_key) not in text
    older = msgpack.packb(list(astuple_shallow(req))[:11], use_bin_type=True)  # 11 fields
    old = m.UpsertUserRequest.decode(older)
    assert (old.name, old.stored_key, old.sha512_stored_key, old.sha512_iterations) == (
        "u", CRED.stored_key, b"", 0)


def test_upsert_request_repr_hides_the_keys() -> None:
    req = m.UpsertUserRequest("u", CRED.salt, CRED.iterations, CRED.stored_key,
                              CRED.server_key, False, [], [], [], 0, False)
    text = repr(req)
    assert "stored_key" not in text and "server_key" not in text
    assert repr(CRED.stored_key) not in text and repr(CRED.server_key) not in text
