"""The SCRAM-SHA-256 style handshake, without sockets: vectors, round trips, every refusal."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from ferrymq.errors import RemoteProtocolError
from ferrymq.protocol.auth import (
    DEFAULT_ITERATIONS,
    ScramClient,
    ScramCredential,
    ScramServer,
    check_nonce,
    check_user_name,
    decoy_credential,
    salted_password,
)

SALT = b"s" * 16
CRED = ScramCredential.derive("pencil", SALT)
DECOY = decoy_credential("x", b"k" * 32)


def _exchange(secret: str, credential: ScramCredential | None = CRED, *,
              server_nonce: bytes = b"S" * 24) -> tuple[ScramClient, ScramServer, bytes | None]:
    client = ScramClient("user", secret, b"C" * 24)
    server = ScramServer("user", credential, client.client_nonce, server_nonce, DECOY)
    proof = client.proof(*server.challenge())
    return client, server, server.verify(proof)


def test_rfc7677_key_derivation() -> None:
    """Our keys reproduce the RFC 7677 example (its AuthMessage text is GS2, ours msgpack)."""
    salt = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
    salted = salted_password("pencil", salt, 4096)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    auth_message = (b"n=user,r=rOprNGfwEbeRWgbNEkqO,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)"
                    b"hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096,c=biws,r=rOprNGfwEbeRWgbNEkqO%hvY"
                    b"DpWUa2RaTCAfuxFIlj)hNlF$k0")
    sig = hmac.new(stored_key, auth_message, hashlib.sha256).digest()
    proof = bytes(a ^ b for a, b in zip(client_key, sig, strict=True))
    assert base64.b64encode(proof) == b"dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()
    server_sig = hmac.new(server_key, auth_message, hashlib.sha256).digest()
    assert base64.b64encode(server_sig) == b"6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
    cred = ScramCredential.derive("pencil", salt)
    assert (cred.stored_key, cred.server_key) == (stored_key, server_key)


def test_round_trip_and_mutual_authentication() -> None:
    client, _, signature = _exchange("pencil")
    assert signature is not None
    assert client.server_signature_ok(signature)
    assert not client.server_signature_ok(b"\x00" * 32)
    assert not ScramClient("user", "pencil", b"C" * 24).server_signature_ok(signature)


def test_wrong_secret_and_unknown_user() -> None:
    assert _exchange("pencil2")[2] is None
    assert _exchange("pencil", None)[2] is None  # the decoy never verifies


def test_a_proof_is_bound_to_its_server_nonce() -> None:
    client = ScramClient("user", "pencil", b"C" * 24)
    first = ScramServer("user", CRED, client.client_nonce, b"1" * 24, DECOY)
    proof = client.proof(*first.challenge())
    second = ScramServer("user", CRED, client.client_nonce, b"2" * 24, DECOY)
    assert second.verify(proof) is None
    assert first.verify(proof) is not None


@pytest.mark.parametrize("proof", [b"", b"\x00" * 31, b"\x00" * 33, b"\xff" * 32])
def test_malformed_proofs(proof: bytes) -> None:
    server = ScramServer("user", CRED, b"C" * 24, b"S" * 24, DECOY)
    assert server.verify(proof) is None


def test_hostile_challenges_are_refused() -> None:
    client = ScramClient("user", "pencil", b"C" * 24)
    for salt, iterations, nonce in [(SALT, 10**9, b"S" * 24), (SALT, 1, b"S" * 24),
                                    (b"", 4096, b"S" * 24), (SALT, 4096, b""),
                                    (SALT, 4096, b"S" * 65)]:
        with pytest.raises(RemoteProtocolError):
            client.proof(salt, iterations, nonce)


def test_decoy_is_stable_per_name() -> None:
    a, b = decoy_credential("mallory", b"k" * 32), decoy_credential("mallory", b"k" * 32)
    assert a == b and a.salt != decoy_credential("eve", b"k" * 32).salt
    assert a.iterations == DEFAULT_ITERATIONS and len(a.salt) == len(CRED.salt)


def test_credential_encoding() -> None:
    text = CRED.encode()
    assert "pencil" not in text
    assert ScramCredential.decode(text) == CRED
    for bad in ["", "SCRAM-SHA-256:4096", "MD5:1:a:b:c", text.replace(":4096:", ":12:"),
                text[:-8], text.replace("SCRAM-SHA-256:4096:", "SCRAM-SHA-256:x:")]:
        with pytest.raises(ValueError):
            ScramCredential.decode(bad)
    with pytest.raises(ValueError):
        ScramCredential.derive("", SALT)
    with pytest.raises(ValueError):
        ScramCredential.derive("x", b"short")


@pytest.mark.parametrize("name", ["alice", "svc.orders-1", "a@b", "A" * 128])
def test_valid_user_names(name: str) -> None:
    assert check_user_name(name) == name


@pytest.mark.parametrize("name", ["", "A" * 129, "al ice", "\uff41lice", "a\nb", "a/b", "é"])
def test_invalid_user_names(name: str) -> None:
    with pytest.raises(ValueError):
        check_user_name(name)


def test_nonce_lengths() -> None:
    assert check_nonce(b"n" * 16, "n") and check_nonce(b"n" * 64, "n")
    for n in (b"", b"n" * 15, b"n" * 65):
        with pytest.raises(RemoteProtocolError):
            check_nonce(n, "nonce")
