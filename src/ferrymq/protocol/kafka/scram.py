"""SCRAM-SHA-256 and SCRAM-SHA-512 as Kafka clients speak them (RFC 5802 / RFC 7677 messages
inside SaslAuthenticate), checked against FerryMQ's stored credentials. Sans-IO.

FerryMQ's users file stores the RFC's ``StoredKey`` and ``ServerKey`` (derived as RFC 5802
derives them: PBKDF2-HMAC-SHA256, "Client Key", "Server Key"), so a Kafka client that knows a
user's secret proves it exactly as a FerryMQ client does; only the messages differ. A user's
optional second credential is the same derivation with SHA-512, for SCRAM-SHA-512::

    client-first  n,,n=<user>,r=<client nonce>
    server-first  r=<client nonce + server nonce>,s=<base64 salt>,i=<iterations>
    client-final  c=biws,r=<nonce>,p=<base64 proof>
    server-final  v=<base64 server signature>

``AuthMessage`` = client-first-bare "," server-first "," client-final-without-proof. An unknown
user is answered with a decoy challenge and fails at the proof like a wrong secret. Channel
binding and authorization identities are refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

from ferrymq.errors import AuthenticationFailedError
from ferrymq.protocol.auth import CREDENTIAL_PREFIX, SHA512_MECHANISM, ScramCredential

MECHANISMS = (CREDENTIAL_PREFIX, SHA512_MECHANISM)
"""The SASL mechanisms served, in the order SaslHandshake lists them."""
MAX_MESSAGE_BYTES = 1024
"""A SCRAM message longer than this is refused (the real ones are about 100 bytes)."""


def _text(message: bytes, what: str) -> str:
    if len(message) > MAX_MESSAGE_BYTES:
        raise AuthenticationFailedError(f"SCRAM {what} message too long")
    try:
        return message.decode()
    except UnicodeDecodeError:
        raise AuthenticationFailedError(f"SCRAM {what} message is not UTF-8") from None


def _attributes(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in text.split(","):
        if len(part) < 2 or part[1] != "=":
            raise AuthenticationFailedError(f"malformed SCRAM attribute {part[:20]!r}")
        out.setdefault(part[0], part[2:])
    return out


def parse_client_first(message: bytes) -> tuple[str, str, str]:
    """``(user, client nonce, client-first-bare)`` of a client-first message.

    Raises:
        AuthenticationFailedError: not UTF-8, too long, channel binding or an authorization
            identity asked for, no user or nonce.
    """
    text = _text(message, "client-first")
    if not text.startswith("n,,"):
        raise AuthenticationFailedError("SCRAM: channel binding and authorization identities "
                                        "are not supported (the message must start with 'n,,')")
    bare = text[3:]
    attrs = _attributes(bare)
    user = attrs.get("n", "").replace("=2C", ",").replace("=3D", "=")
    nonce = attrs.get("r", "")
    if not user or not 16 <= len(nonce) <= 128:
        raise AuthenticationFailedError("SCRAM client-first message without a user or with a "
                                        "nonce outside 16..128 characters")
    return user, nonce, bare


class KafkaScramServer:
    """One SCRAM exchange; ``credential`` is the user's for the mechanism agreed on (its hash is
    the mechanism's), or a decoy for an unknown user (``known`` False: the proof never
    succeeds)."""

    def __init__(self, user: str, credential: ScramCredential, known: bool,
                 client_nonce: str, client_first_bare: str, server_nonce: bytes) -> None:
        self.user = user
        self._credential = credential
        self._known = known
        self.nonce = client_nonce + base64.b64encode(server_nonce).decode().rstrip("=")
        self.server_first = (f"r={self.nonce},s={base64.b64encode(credential.salt).decode()},"
                             f"i={credential.iterations}")
        self._client_first_bare = client_first_bare

    def finish(self, message: bytes) -> bytes:
        """Check the client-final message; the server-final message.

        Raises:
            AuthenticationFailedError: malformed, another nonce, or a wrong proof (wrong
                secret or unknown user: the same answer).
        """
        text = _text(message, "client-final")
        without_proof, sep, proof_part = text.rpartition(",p=")
        attrs = _attributes(without_proof) if sep else {}
        if not sep or attrs.get("c") != "biws" or attrs.get("r") != self.nonce:
            raise AuthenticationFailedError("SCRAM client-final message: bad channel binding "
                                            "or nonce")
        try:
            proof = base64.b64decode(proof_part, validate=True)
        except (binascii.Error, ValueError):
            raise AuthenticationFailedError("SCRAM proof is not base64") from None
        auth_message = f"{self._client_first_bare},{self.server_first},{without_proof}".encode()
        c = self._credential
        name = c.hash_name
        signature = hmac.new(c.stored_key, auth_message, name).digest()
        ok = len(proof) == len(signature) and hmac.compare_digest(
            hashlib.new(name, bytes(a ^ b for a, b in zip(proof, signature, strict=True)))
            .digest(), c.stored_key)
        if not (ok and self._known):
            raise AuthenticationFailedError("authentication failed: unknown user or wrong secret")
        return b"v=" + base64.b64encode(hmac.new(c.server_key, auth_message, name).digest())
