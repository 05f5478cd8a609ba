"""Users, their stored credentials and rights, and the broker side of the SCRAM handshake.

Theory of operation
-------------------
Authentication is on when the broker config names a ``users_file``. The file is TOML, written
by ``ferrymq user add`` (never holds a secret, only SCRAM keys)::

    [users.alice]
    scram = "SCRAM-SHA-256:4096:<salt>:<stored key>:<server key>"
    scram_sha_512 = "SCRAM-SHA-512:4096:<salt>:<stored key>:<server key>"  # optional
    admin = false
    produce = ["orders", "orders.*"]     # topic name patterns (fnmatch: * and ?)
    consume = ["orders*"]
    groups = ["billing-*"]               # consumer, delivery and producer groups, txn ids
    produce_bytes_per_s = 0              # 0: no quota

:class:`UserStore` loads it at start (a bad file stops the broker with a clear error) and
reloads it when its modification time changes (checked by the broker's housekeeping), so
``ferrymq user add`` / ``remove`` take effect without a restart. ``scram`` is every user's
credential (the native handshake, and SCRAM-SHA-256 on the Kafka port); ``scram_sha_512``, which
``ferrymq user add`` writes too, lets Kafka clients log in with SCRAM-SHA-512 (a user written
before it existed has none until its secret is set again). A reload that fails keeps the
users that were loaded and logs why. Rights are looked up by name on every request, so a
revoked right or a removed user takes effect at once on open connections too. Admins change
users over the wire too (:mod:`ferrymq.broker.handlers.users`: the same
:func:`update_users_file`, then an immediate reload; a user deleted that way also has its
connections closed).

The handshake itself (the maths) is :mod:`ferrymq.protocol.auth`; :class:`Authenticator` holds
the per-process decoy secret and the failure delay, and the handlers
(:mod:`ferrymq.broker.handlers.auth`) drive a connection's state: ``AUTH_START`` once, then
``AUTH_FINISH`` once. Any failure is answered
after ``auth_failure_delay_ms`` with AUTHENTICATION_FAILED and the connection is closed
(:mod:`ferrymq.broker.connection` closes after an error answer to an AUTH_* request). The log
line names the user (``%r``, so control characters cannot forge lines) and the peer, never the
proof or the secret.
"""

from __future__ import annotations

import fcntl
import logging
import secrets
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ferrymq.errors import AuthenticationFailedError, ConfigError
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import (
    MAX_ITERATIONS,
    MAX_NONCE_BYTES,
    MECHANISM,
    MIN_ITERATIONS,
    NONCE_BYTES,
    SALT_BYTES,
    SHA512_MECHANISM,
    ScramCredential,
    ScramServer,
    check_nonce,
    check_user_name,
    decoy_credential,
    key_bytes,
)
from ferrymq.storage.files import atomic_write

log = logging.getLogger("ferrymq.broker.auth")


MAX_USERS = 100_000
"""Most users one file may hold (the file is read into memory)."""
MAX_USERS_FILE_BYTES = 64 * 1024 * 1024
"""A users file larger than this is refused before it is read."""
MAX_PATTERNS = 1000
"""Most patterns in one right of one user."""
MAX_PATTERN_CHARS = 512
"""Longest pattern: names are at most 249 characters, so this leaves room for wildcards while a
hostile admin request cannot make every ACL check match kilobytes."""
MAX_PRODUCE_BYTES_PER_S = 1 << 40
"""Largest produce quota (1 TiB/s, far above any link): keeps the value a TOML integer (int64)
and exact in the token bucket's float arithmetic."""


@dataclass(frozen=True, slots=True)
class User:
    """One user: credential and rights."""

    name: str
    credential: ScramCredential
    admin: bool = False
    produce: tuple[str, ...] = ()
    consume: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    produce_bytes_per_s: int = 0
    scram_sha_512: ScramCredential | None = None
    """The optional SCRAM-SHA-512 credential (Kafka clients that ask for that mechanism)."""


def _patterns(name: str, key: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise ConfigError(f"user {name!r}: {key} must be a list of non-empty strings")
    if len(value) > MAX_PATTERNS:
        raise ConfigError(f"user {name!r}: more than {MAX_PATTERNS} {key} patterns")
    if any(len(p) > MAX_PATTERN_CHARS for p in value):
        raise ConfigError(f"user {name!r}: a {key} pattern is longer than {MAX_PATTERN_CHARS} "
                          "characters")
    return tuple(value)


def check_user(user: User) -> User:
    """Return ``user`` if it may be written to a users file (UPSERT_USER): the rules of
    :func:`parse_users`, plus a salt of at most 64 bytes (longer ones fail the client's
    handshake) and patterns without control characters. Only sizes, counts and characters are
    looked at: linear in the request, nothing allocated.

    Raises:
        ValueError: naming the first problem (no key material in the message).
    """
    check_user_name(user.name)
    _check_credential(user.credential, MECHANISM)
    if user.scram_sha_512 is not None:
        _check_credential(user.scram_sha_512, SHA512_MECHANISM)
    for key, patterns in (("produce", user.produce), ("consume", user.consume),
                          ("groups", user.groups)):
        if len(patterns) > MAX_PATTERNS:
            raise ValueError(f"more than {MAX_PATTERNS} {key} patterns")
        for p in patterns:
            if not p or len(p) > MAX_PATTERN_CHARS:
                raise ValueError(f"{key} patterns must have 1..{MAX_PATTERN_CHARS} characters")
            if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in p):
                raise ValueError(f"{key} patterns must not contain control characters")
    if not 0 <= user.produce_bytes_per_s <= MAX_PRODUCE_BYTES_PER_S:
        raise ValueError(f"produce_bytes_per_s must be 0..{MAX_PRODUCE_BYTES_PER_S}")
    return user


def _check_credential(c: ScramCredential, mechanism: str) -> None:
    """:func:`check_user`'s rules for one credential.

    Raises:
        ValueError: another mechanism, a salt, iterations or keys out of range.
    """
    if c.mechanism != mechanism:
        raise ValueError(f"a {c.mechanism[:40]!r} credential where {mechanism} is expected")
    if not SALT_BYTES <= len(c.salt) <= MAX_NONCE_BYTES:
        raise ValueError(f"the salt must have {SALT_BYTES}..{MAX_NONCE_BYTES} bytes, "
                         f"not {len(c.salt)}")
    if not MIN_ITERATIONS <= c.iterations <= MAX_ITERATIONS:
        raise ValueError(f"iterations must be {MIN_ITERATIONS}..{MAX_ITERATIONS}")
    size = key_bytes(mechanism)
    if len(c.stored_key) != size or len(c.server_key) != size:
        raise ValueError(f"the {mechanism} stored key and server key must have {size} bytes")


def parse_users(text: str, source: str = "users file") -> dict[str, User]:
    """Parse a users file.

    Raises:
        ConfigError: not TOML, or an entry that is not valid (naming it).
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    table = data.get("users", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [users] must be a table")
    if len(table) > MAX_USERS:
        raise ConfigError(f"{source}: more than {MAX_USERS} users")
    users: dict[str, User] = {}
    known = {"scram", "scram_sha_512", "admin", "produce", "consume", "groups",
             "produce_bytes_per_s"}
    for name, entry in table.items():
        try:
            check_user_name(name)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        if not isinstance(entry, dict):
            raise ConfigError(f"{source}: users.{name} must be a table")
        unknown = set(entry) - known
        if unknown:
            raise ConfigError(f"{source}: user {name!r}: unknown keys {sorted(unknown)}")
        try:
            cred = ScramCredential.decode(str(entry.get("scram", "")))
            sha512 = (ScramCredential.decode(str(entry["scram_sha_512"]), SHA512_MECHANISM)
                      if "scram_sha_512" in entry else None)
        except ValueError as exc:
            raise ConfigError(f"{source}: user {name!r}: {exc}") from None
        admin = entry.get("admin", False)
        rate = entry.get("produce_bytes_per_s", 0)
        if not isinstance(admin, bool):
            raise ConfigError(f"{source}: user {name!r}: admin must be true or false")
        if (not isinstance(rate, int) or isinstance(rate, bool)
                or not 0 <= rate <= MAX_PRODUCE_BYTES_PER_S):
            raise ConfigError(f"{source}: user {name!r}: produce_bytes_per_s must be an int "
                              f"0..{MAX_PRODUCE_BYTES_PER_S}")
        users[name] = User(
            name, cred, admin,
            _patterns(name, "produce", entry.get("produce", [])),
            _patterns(name, "consume", entry.get("consume", [])),
            _patterns(name, "groups", entry.get("groups", [])),
            rate,
            sha512,
        )
    return users


def _toml_str(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_list(items: Iterable[str]) -> str:
    return "[" + ", ".join(_toml_str(i) for i in items) + "]"


def render_users(users: Iterable[User]) -> str:
    """The users file text for ``users`` (sorted by name)."""
    lines = ["# FerryMQ users (written by `ferrymq user add`). Secrets are not stored: only",
             "# SCRAM keys derived from them. Patterns use * and ? (fnmatch).", ""]
    for u in sorted(users, key=lambda u: u.name):
        lines += [
            f"[users.{_toml_str(u.name)}]",
            f"scram = {_toml_str(u.credential.encode())}",
            *([f"scram_sha_512 = {_toml_str(u.scram_sha_512.encode())}"]
              if u.scram_sha_512 is not None else []),
            f"admin = {'true' if u.admin else 'false'}",
            f"produce = {_toml_list(u.produce)}",
            f"consume = {_toml_list(u.consume)}",
            f"groups = {_toml_list(u.groups)}",
            f"produce_bytes_per_s = {u.produce_bytes_per_s}",
            "",
        ]
    return "\n".join(lines)


def read_users_file(path: str | Path) -> dict[str, User]:
    """Read and parse a users file (a missing file is an empty one).

    Raises:
        ConfigError: unreadable, too large or invalid.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"cannot read users file {p}: {exc.strerror}") from None
    if size > MAX_USERS_FILE_BYTES:
        raise ConfigError(f"users file {p} is larger than {MAX_USERS_FILE_BYTES} bytes")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read users file {p}: {exc}") from None
    return parse_users(text, str(p))


def update_users_file(path: str | Path, change: dict[str, User | None],
                      check: Callable[[dict[str, User]], None] | None = None) -> dict[str, User]:
    """Apply ``change`` (name -> new entry, or None to remove) to the file atomically.

    The file is locked while it is read, changed and replaced (tmp, fsync, rename, fsync dir),
    and created with mode 0600 when new.

    Args:
        path: the users file.
        change: the entries to write or remove.
        check: called with the users read under the lock, before the change: it may raise to
            refuse the change (nothing is written), e.g. when it would remove the last admin.
            Checks that depend on the file's current content belong here, not before the call
            (another writer may change the file in between).

    Raises:
        ConfigError: the file is invalid or cannot be written.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    lock_path = p.with_name(p.name + ".lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        users = read_users_file(p)
        if check is not None:
            check(users)
        for name, user in change.items():
            if user is None:
                users.pop(name, None)
            else:
                users[name] = user
        mode = p.stat().st_mode & 0o777 if p.exists() else 0o600
        atomic_write(p, render_users(users.values()).encode("utf-8"), mode)
    return users


@dataclass(slots=True)
class UserStore:
    """The broker's users, reloaded when the file changes."""

    path: Path
    users: dict[str, User] = field(default_factory=dict)
    _stamp: tuple[int, int, int] | None = None

    @classmethod
    def open(cls, path: str | Path) -> UserStore:
        """Load the file (it must exist: a typo would otherwise lock everybody out silently).

        Raises:
            ConfigError: missing, unreadable or invalid.
        """
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"users_file {p} does not exist (create it with "
                              f"`ferrymq user add NAME --users-file {p}`)")
        store = cls(p)
        store.users = read_users_file(p)
        store._stamp = store._file_stamp()
        return store

    def _file_stamp(self) -> tuple[int, int, int] | None:
        # the inode too: every atomic rewrite (update_users_file) is a new file, so two writes
        # of the same size within one tick of a coarse mtime clock are still told apart
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def reload_if_changed(self) -> bool:
        """Reload when the file's mtime or size changed; True when new users were loaded."""
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            users = read_users_file(self.path)
        except ConfigError as exc:
            log.error("users file not reloaded, keeping %d users: %s", len(self.users), exc)
            return False
        self.users = users
        log.info("users file %s reloaded: %d users", self.path, len(users))
        return True

    def get(self, name: str) -> User | None:
        """The user called ``name``, if any."""
        return self.users.get(name)


class AuthConnection(Protocol):
    """What the handshake reads and changes on a connection."""

    scram: ScramServer | None
    """The handshake in progress (between AUTH_START and AUTH_FINISH)."""

    @property
    def peer(self) -> str:
        """``host:port`` of the client."""

    @property
    def authenticated(self) -> bool:
        """False until AUTH_FINISH succeeds (True at once when authentication is off)."""

    def authenticated_as(self, user: str) -> None:
        """The handshake succeeded: lift the pre-auth limits."""


class Authenticator:
    """The broker's side of authentication: users, decoy secret, failure delay."""

    def __init__(self, store: UserStore, failure_delay_ms: int) -> None:
        self.store = store
        self.failure_delay_s = failure_delay_ms / 1000
        self._process_secret = secrets.token_bytes(32)
        self.failures = 0
        self.successes = 0

    def start(self, conn: AuthConnection, req: m.AuthStartRequest) -> m.AuthStartResponse:
        """Answer AUTH_START with a challenge (also for unknown users).

        Raises:
            AuthenticationFailedError: a second AUTH_START, an unknown mechanism, a bad nonce
                or user name (answered after the failure delay; the connection closes).
        """
        if conn.authenticated or conn.scram is not None:
            raise AuthenticationFailedError("authentication already started on this connection")
        if req.mechanism != MECHANISM:
            raise AuthenticationFailedError(f"unsupported mechanism {req.mechanism[:40]!r} "
                                            f"(supported: {MECHANISM})")
        try:
            check_user_name(req.user)
            check_nonce(req.client_nonce, "client nonce")
        except ValueError as exc:
            raise AuthenticationFailedError(str(exc)) from None
        user = self.store.get(req.user)
        conn.scram = ScramServer(
            req.user, user.credential if user is not None else None, req.client_nonce,
            secrets.token_bytes(NONCE_BYTES), self.decoy(req.user),
        )
        salt, iterations, nonce = conn.scram.challenge()
        return m.AuthStartResponse(salt, iterations, nonce)

    def finish(self, conn: AuthConnection, req: m.AuthFinishRequest) -> m.AuthFinishResponse:
        """Check the proof; on success the connection is authenticated as the user.

        Raises:
            AuthenticationFailedError: no AUTH_START before, or a wrong proof (wrong secret,
                unknown user, a proof replayed from another connection).
        """
        scram = conn.scram
        if conn.authenticated or scram is None:
            raise AuthenticationFailedError("AUTH_FINISH without AUTH_START")
        conn.scram = None  # one attempt per connection
        signature = scram.verify(req.client_proof)
        user = self.store.get(scram.user)
        if signature is None or user is None:
            raise AuthenticationFailedError("authentication failed: unknown user or wrong secret")
        conn.authenticated_as(user.name)
        self.successes += 1
        log.info("%s authenticated as %r", conn.peer, user.name)
        return m.AuthFinishResponse(signature, user.name, user.admin)

    def decoy(self, user: str, mechanism: str = MECHANISM) -> ScramCredential:
        """The stable decoy credential of an unknown user name (its challenge looks real)."""
        return decoy_credential(user, self._process_secret, mechanism)

    def failed(self, conn: AuthConnection, user: str, reason: str) -> None:
        """Log a failed attempt (without any secret material)."""
        self.failures += 1
        log.warning("authentication failed from %s (user %r): %s", conn.peer, user[:128], reason)
