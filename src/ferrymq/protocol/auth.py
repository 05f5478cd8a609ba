"""SCRAM-SHA-256 style challenge-response authentication (sans-IO).

Theory of operation
-------------------
The broker stores, per user, a salt, an iteration count and two keys derived from the secret
(RFC 5802 / RFC 7677 vocabulary)::

    SaltedPassword = PBKDF2-HMAC-SHA256(secret, salt, iterations)
    ClientKey      = HMAC(SaltedPassword, "Client Key")
    StoredKey      = SHA256(ClientKey)
    ServerKey      = HMAC(SaltedPassword, "Server Key")

Only ``StoredKey`` and ``ServerKey`` are stored: a stolen users file does not let anyone log in
(they would still have to invert SHA-256), and the secret never crosses the wire.

The exchange takes two round trips after HELLO::

    client -> AUTH_START   mechanism, user, client_nonce (>= 16 random bytes)
    broker <- salt, iterations, server_nonce (24 fresh random bytes per connection)
    client -> AUTH_FINISH  client_proof = ClientKey XOR HMAC(StoredKey, AuthMessage)
    broker <- server_signature = HMAC(ServerKey, AuthMessage), user, admin flag

``AuthMessage`` binds everything the two sides exchanged (user, both nonces, salt,
iterations). Because the broker picks a fresh server nonce for every connection, a proof
captured on one connection is worthless on another (no replay). The broker recomputes
``ClientKey`` from the proof and compares ``SHA256(ClientKey)`` with ``StoredKey`` using
:func:`hmac.compare_digest`; the client checks the server signature the same way, so a broker
that does not know the user's keys is detected too (mutual authentication).

An unknown user gets a challenge that looks like a real one (a salt derived from the user name
and a per-process secret) and fails at AUTH_FINISH like a wrong secret: the exchange does not
reveal which user names exist.

This module only computes; randomness (nonces, salts) is passed in by the caller, so it stays
free of I/O and is deterministic under test.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from dataclasses import dataclass

import msgpack

from ferrymq.errors import RemoteProtocolError

MECHANISM = "SCRAM-SHA-256"
NONCE_BYTES = 24
"""Bytes of randomness each side contributes to a handshake."""
MIN_NONCE_BYTES = 16
MAX_NONCE_BYTES = 64
"""A client nonce outside 16..64 bytes is refused (too weak, or a way to make us hash junk)."""
SALT_BYTES = 16
DEFAULT_ITERATIONS = 4096
"""PBKDF2 rounds for new credentials (RFC 7677's minimum). Only the client pays them: the broker
stores derived keys and never runs PBKDF2 while serving."""
MIN_ITERATIONS = 4096
MAX_ITERATIONS = 1_000_000
"""A client refuses challenges asking for more rounds (a hostile broker could burn its CPU)."""
MAX_USER_CHARS = 128
USER_NAME_RE = re.compile(r"[A-Za-z0-9._@-]{1,128}\Z", re.ASCII)
"""User names: 1..128 ASCII letters, digits, ``. _ @ -``. Compared exactly (no case folding, no
Unicode normalisation), so a look-alike or case variant is simply another, unknown, name."""
CREDENTIAL_PREFIX = "SCRAM-SHA-256"
SHA512_MECHANISM = "SCRAM-SHA-512"
"""The Kafka port also serves SCRAM-SHA-512 (RFC 5802 with SHA-512): a user needs a second
credential for it, derived from the same secret (the users file's ``scram_sha_512``)."""
SCRAM_HASHES = {CREDENTIAL_PREFIX: "sha256", SHA512_MECHANISM: "sha512"}
"""The hash of each SCRAM mechanism a credential can be derived for."""


def check_user_name(name: str) -> str:
    """Return ``name`` if it is a valid user name.

    Raises:
        ValueError: empty, too long, or characters outside ``[A-Za-z0-9._@-]``.
    """
    if not USER_NAME_RE.match(name):
        raise ValueError(f"invalid user name {name!r}: 1..{MAX_USER_CHARS} characters of "
                         "A-Z a-z 0-9 . _ @ -")
    return name


def _hmac(key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hashlib.sha256).digest()


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def salted_password(secret: str, salt: bytes, iterations: int) -> bytes:
    """PBKDF2-HMAC-SHA256 of the secret (UTF-8)."""
    return hashlib.pbkdf2_hmac("sha256", secret.encode("utf-8"), salt, iterations)


@dataclass(frozen=True, slots=True)
class ScramCredential:
    """What the broker stores for a user: salt, rounds and the two derived keys."""

    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes
    mechanism: str = CREDENTIAL_PREFIX
    """``SCRAM-SHA-256`` (every user's, the native handshake's) or ``SCRAM-SHA-512`` (an
    optional second credential, for Kafka clients that ask for it)."""

    @property
    def hash_name(self) -> str:
        """The :mod:`hashlib` name of the mechanism's hash."""
        return SCRAM_HASHES[self.mechanism]

    @classmethod
    def derive(cls, secret: str, salt: bytes, iterations: int = DEFAULT_ITERATIONS,
               mechanism: str = CREDENTIAL_PREFIX) -> ScramCredential:
        """Derive the stored form of ``secret`` (the caller supplies a random ``salt``).

        Raises:
            ValueError: empty secret, short salt, too few rounds or an unknown mechanism.
        """
        if not secret:
            raise ValueError("the secret must not be empty")
        if len(salt) < SALT_BYTES:
            raise ValueError(f"the salt must have at least {SALT_BYTES} bytes")
        if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
            raise ValueError(f"iterations must be {MIN_ITERATIONS}..{MAX_ITERATIONS}")
        name = _hash_of(mechanism)
        salted = hashlib.pbkdf2_hmac(name, secret.encode("utf-8"), salt, iterations)
        client_key = hmac.new(salted, b"Client Key", name).digest()
        return cls(salt, iterations, hashlib.new(name, client_key).digest(),
                   hmac.new(salted, b"Server Key", name).digest(), mechanism)

    def encode(self) -> str:
        """``<mechanism>:<iterations>:<salt>:<stored key>:<server key>`` (base64)."""
        b64 = base64.b64encode
        return ":".join((self.mechanism, str(self.iterations), b64(self.salt).decode(),
                         b64(self.stored_key).decode(), b64(self.server_key).decode()))

    @classmethod
    def decode(cls, text: str, mechanism: str = CREDENTIAL_PREFIX) -> ScramCredential:
        """Parse :meth:`encode`'s form of a ``mechanism`` credential.

        Raises:
            ValueError: anything else.
        """
        size = key_bytes(mechanism)
        parts = text.split(":")
        if len(parts) != 5 or parts[0] != mechanism:
            raise ValueError(f"not a {mechanism} credential")
        try:
            iterations = int(parts[1])
            salt, stored, server = (base64.b64decode(p, validate=True) for p in parts[2:])
        except ValueError as exc:
            raise ValueError(f"malformed {mechanism} credential: {exc}") from None
        if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS or len(salt) < SALT_BYTES:
            raise ValueError("credential salt or iterations out of range")
        if len(stored) != size or len(server) != size:
            raise ValueError(f"{mechanism} credential keys must be {size} bytes")
        return cls(salt, iterations, stored, server, mechanism)


def _hash_of(mechanism: str) -> str:
    try:
        return SCRAM_HASHES[mechanism]
    except KeyError:
        raise ValueError(f"unknown SCRAM mechanism {mechanism[:40]!r} (known: "
                         f"{', '.join(SCRAM_HASHES)})") from None


def key_bytes(mechanism: str) -> int:
    """The size of a ``mechanism`` credential's keys (32 for SHA-256, 64 for SHA-512).

    Raises:
        ValueError: an unknown mechanism.
    """
    return hashlib.new(_hash_of(mechanism)).digest_size


def auth_message(user: str, client_nonce: bytes, server_nonce: bytes, salt: bytes,
                 iterations: int) -> bytes:
    """The bytes both proofs sign: everything exchanged, unambiguously encoded."""
    return bytes(msgpack.packb([MECHANISM, user, client_nonce, server_nonce, salt, iterations],
                               use_bin_type=True))


def check_nonce(nonce: bytes, what: str) -> bytes:
    """Return ``nonce`` if its length is 16..64 bytes.

    Raises:
        RemoteProtocolError: otherwise.
    """
    if not MIN_NONCE_BYTES <= len(nonce) <= MAX_NONCE_BYTES:
        raise RemoteProtocolError(f"{what} must have {MIN_NONCE_BYTES}..{MAX_NONCE_BYTES} bytes, "
                                  f"not {len(nonce)}")
    return nonce


class ScramClient:
    """The client side of one exchange.

    Args:
        user: the user name (app key).
        secret: the user's secret (app secret); kept only in this object.
        client_nonce: fresh random bytes (``secrets.token_bytes(NONCE_BYTES)``).
    """

    __slots__ = ("_auth_message", "_salted", "client_nonce", "secret", "user")

    def __init__(self, user: str, secret: str, client_nonce: bytes) -> None:
        self.user = user
        self.secret = secret
        self.client_nonce = check_nonce(client_nonce, "client nonce")
        self._auth_message: bytes | None = None
        self._salted: bytes | None = None

    def proof(self, salt: bytes, iterations: int, server_nonce: bytes) -> bytes:
        """Answer the broker's challenge with the client proof.

        Raises:
            RemoteProtocolError: the challenge is malformed or asks for too many rounds.
        """
        if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
            raise RemoteProtocolError(f"challenge asks for {iterations} PBKDF2 rounds "
                                      f"(accepted: {MIN_ITERATIONS}..{MAX_ITERATIONS})")
        if not SALT_BYTES <= len(salt) <= MAX_NONCE_BYTES:
            raise RemoteProtocolError("challenge salt has a bad length")
        check_nonce(server_nonce, "server nonce")
        self._salted = salted_password(self.secret, salt, iterations)
        client_key = _hmac(self._salted, b"Client Key")
        stored_key = hashlib.sha256(client_key).digest()
        self._auth_message = auth_message(self.user, self.client_nonce, server_nonce, salt,
                                          iterations)
        return _xor(client_key, _hmac(stored_key, self._auth_message))

    def server_signature_ok(self, signature: bytes) -> bool:
        """True when the broker proved it knows the user's server key (constant time)."""
        if self._salted is None or self._auth_message is None:
            return False
        expected = _hmac(_hmac(self._salted, b"Server Key"), self._auth_message)
        return hmac.compare_digest(expected, signature)


class ScramServer:
    """The broker side of one exchange.

    Args:
        user: the name the client claims.
        credential: the stored credential, or None for an unknown user (then ``decoy`` is
            used and the exchange always fails, at the same point as a wrong secret).
        client_nonce: the client's nonce (already length-checked by :func:`check_nonce`).
        server_nonce: fresh random bytes for this connection.
        decoy: a credential shaped like a real one for unknown users (see :func:`decoy_credential`).
    """

    __slots__ = ("_credential", "_known", "_message", "client_nonce", "server_nonce", "user")

    def __init__(self, user: str, credential: ScramCredential | None, client_nonce: bytes,
                 server_nonce: bytes, decoy: ScramCredential) -> None:
        self.user = user
        self._known = credential is not None
        self._credential = credential if credential is not None else decoy
        self.client_nonce = check_nonce(client_nonce, "client nonce")
        self.server_nonce = server_nonce
        c = self._credential
        self._message = auth_message(user, client_nonce, server_nonce, c.salt, c.iterations)

    def challenge(self) -> tuple[bytes, int, bytes]:
        """``(salt, iterations, server_nonce)`` for the client."""
        return self._credential.salt, self._credential.iterations, self.server_nonce

    def verify(self, client_proof: bytes) -> bytes | None:
        """Check the client's proof; return the server signature, or None when it is wrong.

        The comparison is constant-time and the same work is done for unknown users.
        """
        c = self._credential
        signature = _hmac(c.stored_key, self._message)
        if len(client_proof) != len(signature):
            return None
        client_key = _xor(client_proof, signature)
        ok = hmac.compare_digest(hashlib.sha256(client_key).digest(), c.stored_key)
        if not (ok and self._known):
            return None
        return _hmac(c.server_key, self._message)


def decoy_credential(user: str, process_secret: bytes,
                     mechanism: str = CREDENTIAL_PREFIX) -> ScramCredential:
    """A stable, fake ``mechanism`` credential for an unknown user name: the salt is an HMAC of
    the name under a per-process secret (so asking twice gives the same salt), the keys are
    random-looking."""
    salt = _hmac(process_secret, b"salt\0" + user.encode("utf-8"))[:SALT_BYTES]
    stored = hmac.new(process_secret, b"stored\0" + user.encode("utf-8"),
                      _hash_of(mechanism)).digest()
    return ScramCredential(salt, DEFAULT_ITERATIONS, stored, stored, mechanism)
