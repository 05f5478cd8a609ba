"""SCRAM-SHA-256 and SCRAM-SHA-512 in RFC 5802's messages (what Kafka clients send) against
FerryMQ's stored credentials: a client written from the RFC here, and the malformed messages
refused."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from ferrymq.errors import AuthenticationFailedError
from ferrymq.protocol.auth import SHA512_MECHANISM, ScramCredential
from ferrymq.protocol.kafka.scram import KafkaScramServer, parse_client_first

SALT = b"0123456789abcdef"
CRED = ScramCredential.derive("pencil", SALT, 4096)


def _client_final(password: str, client_first_bare: str, server_first: str,
                  hash_name: str = "sha256") -> bytes:
    attrs = dict(p.split("=", 1) for p in server_first.split(","))
    salted = hashlib.pbkdf2_hmac(hash_name, password.encode(), base64.b64decode(attrs["s"]),
                                 int(attrs["i"]))
    client_key = hmac.new(salted, b"Client Key", hash_name).digest()
    without_proof = f"c=biws,r={attrs['r']}"
    auth_message = f"{client_first_bare},{server_first},{without_proof}".encode()
    signature = hmac.new(hashlib.new(hash_name, client_key).digest(), auth_message,
                         hash_name).digest()
    proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
    return f"{without_proof},p={base64.b64encode(proof).decode()}".encode()


def _server(message: bytes = b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO", known: bool = True,
            cred: ScramCredential = CRED) -> KafkaScramServer:
    user, nonce, bare = parse_client_first(message)
    return KafkaScramServer(user, cred, known, nonce, bare, b"server-nonce-bytes")


def test_scram_sha_512_with_the_users_sha_512_credential() -> None:
    cred = ScramCredential.derive("pencil", SALT, 4096, SHA512_MECHANISM)
    assert (len(cred.stored_key), len(cred.server_key)) == (64, 64)
    s = _server(cred=cred)
    final = s.finish(_client_final("pencil", "n=user,r=rOprNGfwEbeRWgbNEkqO", s.server_first,
                                   "sha512"))
    salted = hashlib.pbkdf2_hmac("sha512", b"pencil", SALT, 4096)
    server_key = hmac.new(salted, b"Server Key", "sha512").digest()
    auth_message = (f"n=user,r=rOprNGfwEbeRWgbNEkqO,{s.server_first},c=biws,r={s.nonce}"
                    .encode())
    assert final == b"v=" + base64.b64encode(hmac.new(server_key, auth_message,
                                                      "sha512").digest())
    s = _server(cred=cred)  # a SHA-256 proof against the SHA-512 credential
    with pytest.raises(AuthenticationFailedError, match="unknown user or wrong secret"):
        s.finish(_client_final("pencil", "n=user,r=rOprNGfwEbeRWgbNEkqO", s.server_first))
    s = _server()  # and the reverse
    with pytest.raises(AuthenticationFailedError, match="unknown user or wrong secret"):
        s.finish(_client_final("pencil", "n=user,r=rOprNGfwEbeRWgbNEkqO", s.server_first,
                               "sha512"))


def test_an_rfc_client_with_the_right_password_is_accepted_and_verifies_the_server() -> None:
    s = _server()
    assert s.server_first.startswith("r=rOprNGfwEbeRWgbNEkqO")
    final = s.finish(_client_final("pencil", "n=user,r=rOprNGfwEbeRWgbNEkqO", s.server_first))
    salted = hashlib.pbkdf2_hmac("sha256", b"pencil", SALT, 4096)
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()
    auth_message = (f"n=user,r=rOprNGfwEbeRWgbNEkqO,{s.server_first},c=biws,r={s.nonce}"
                    .encode())
    assert final == b"v=" + base64.b64encode(hmac.new(server_key, auth_message,
                                                      hashlib.sha256).digest())


def test_wrong_password_unknown_user_and_replayed_nonce_fail_alike() -> None:
    s = _server()
    with pytest.raises(AuthenticationFailedError, match="unknown user or wrong secret"):
        s.finish(_client_final("wrong", "n=user,r=rOprNGfwEbeRWgbNEkqO", s.server_first))
    s = _server(known=False)
    with pytest.raises(AuthenticationFailedError, match="unknown user or wrong secret"):
        s.finish(_client_final("pencil", "n=user,r=rOprNGfwEbeRWgbNEkqO", s.server_first))
    s = _server()
    with pytest.raises(AuthenticationFailedError, match="nonce"):
        s.finish(b"c=biws,r=another-nonce-entirely,p=AAAA")


@pytest.mark.parametrize("message", [
    b"p=tls-server-end-point,,n=user,r=rOprNGfwEbeRWgbNEkqO",  # channel binding
    b"n,a=admin,n=user,r=rOprNGfwEbeRWgbNEkqO",  # an authorization identity
    b"n,,n=user,r=short",
    b"n,,r=rOprNGfwEbeRWgbNEkqO",
    b"n,,n=\xff,r=rOprNGfwEbeRWgbNEkqO",
    b"n,,n=user,r=" + b"x" * 2000,
])
def test_malformed_client_first_messages_are_refused(message: bytes) -> None:
    with pytest.raises(AuthenticationFailedError):
        parse_client_first(message)


def test_sasl_names_are_unescaped() -> None:
    assert parse_client_first(b"n,,n=a=2Cb=3Dc,r=rOprNGfwEbeRWgbNEkqO")[0] == "a,b=c"
