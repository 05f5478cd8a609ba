"""Users and their rights on a cluster: one set for every broker, kept in the metadata store.

Theory of operation
-------------------
A single broker keeps its users in its ``users_file`` (:mod:`ferrymq.broker.auth`). On a
cluster the users live in the metadata store instead, one key per user (``users/<name>``, its
value a users-file entry: SCRAM keys and rights, never a secret), and every change also bumps
``counters/users_version`` under a compare-and-swap of it. Each broker **mirrors** the store's
users into its own users file, so everything that reads users (the handshake, the ACL check on
every request, LIST_USERS) is unchanged and a restart finds them even before etcd answers.

* **Seeding.** The first broker of a cluster that starts with a users file (the version key
  absent) writes its file's users into the store, in one commit that creates the version key;
  brokers after it adopt the store's users and rewrite their files to match. So a cluster
  starts from one broker's file, copied to the others, as Kafka seeds SCRAM users once.
* **Changes over the wire** (UPSERT_USER, DELETE_USER, on any broker): read the version and the
  users, run the handler's checks (the user exists, the last admin stays), commit with a check
  of the version (a concurrent change makes it fail: read again, up to
  :data:`MAX_WRITE_ATTEMPTS`), then mirror at once, so the answer means this broker applies it.
  The other brokers mirror when their watch brings the change: a removed user's open
  connections there are closed as on the broker asked.
* **An offline edit** of one broker's users file (``ferrymq user add --users-file``) would split
  the cluster's users: the broker logs it as an error and mirrors the store's users back.

Not yet: a cluster whose brokers mix files and no files is not refused (a broker without
``users_file`` has authentication off, whatever the cluster's users are; it logs that).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ferrymq.broker.auth import Authenticator, User, parse_users, render_users, update_users_file
from ferrymq.cluster.metadata.store import COMMIT_MAX_OPS, Check, Put
from ferrymq.cluster.model import Counter
from ferrymq.errors import ConfigError, InternalBrokerError, MetadataError

if TYPE_CHECKING:
    from ferrymq.broker.config import BrokerConfig
    from ferrymq.cluster.node import ClusterNode

log = logging.getLogger("ferrymq.broker.users")

MAX_WRITE_ATTEMPTS = 8
"""Compare-and-swap attempts of one user change before it is refused as contended."""

UsersCheck = Callable[[dict[str, User]], None]
"""A handler's check of a change against the current users (raises to refuse it)."""


class UsersHost(Protocol):
    """What the cluster's users need of the broker."""

    @property
    def config(self) -> BrokerConfig:
        """The broker's settings (``users_file``)."""

    @property
    def auth(self) -> Authenticator | None:
        """The broker's users (None: authentication off)."""

    def close_removed_users(self) -> None:
        """Close the open connections of users the users file no longer has."""


class ClusterUsers:
    """The cluster's users for one broker: seeding, changes, and the mirror into its file."""

    def __init__(self, server: UsersHost, node: ClusterNode) -> None:
        self.server = server
        self.node = node
        self._mirror_lock = asyncio.Lock()
        self._mirror_task: asyncio.Task[None] | None = None

    # --- start ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Seed the store from this broker's users file (first broker) or adopt the store's
        users; then keep mirroring them.

        Raises:
            ConfigError: the file holds more users than one commit may write.
            MetadataError: the store did not answer.
        """
        srv, node = self.server, self.node
        keys = node.keys
        if srv.auth is None:
            if node.view.users:
                log.warning("the cluster %r has %d users but this broker has no users_file: "
                            "authentication is OFF on it", node.cluster, len(node.view.users))
            return
        if await node.store.get(keys.users_version) is None:
            users = srv.auth.store.users
            if len(users) + 1 > COMMIT_MAX_OPS:
                raise ConfigError(f"cannot seed the cluster's users: {len(users)} users, one "
                                  f"commit writes at most {COMMIT_MAX_OPS - 1}")
            puts = [Put(keys.users_version, Counter(1).encode()),
                    *(Put(keys.user(u.name), render_users([u]).encode())
                      for u in users.values())]
            if await node.store.commit([Check(keys.users_version, 0)], puts) is not None:
                log.info("the cluster's users seeded from %s (%d users)", srv.config.users_file,
                         len(users))
        kvs, _ = await node.store.range(keys.users)
        await self.mirror({kv.key[len(keys.users):]: kv.value for kv in kvs})
        node.on_users_changed = self._users_changed

    # --- changes over the wire ----------------------------------------------------------------

    async def write(self, change: dict[str, User | None], check: UsersCheck) -> None:
        """Apply ``change`` (name -> new user, or None to delete) to the cluster's users if
        ``check`` accepts the current ones; then this broker's file has it.

        Raises:
            whatever ``check`` raises; InternalBrokerError: contended or the store failed.
        """
        store, keys = self.node.store, self.node.keys
        for _ in range(MAX_WRITE_ATTEMPTS):
            try:
                version = await store.get(keys.users_version)
                kvs, _ = await store.range(keys.users)
                users = _parse({kv.key[len(keys.users):]: kv.value for kv in kvs})
                check(users)
                n = Counter.decode(version).value if version is not None else 0
                puts = [Put(keys.users_version, Counter(n + 1).encode())]
                puts += [Put(keys.user(name), render_users([u]).encode())
                         for name, u in change.items() if u is not None]
                deletes = [keys.user(name) for name, u in change.items() if u is None]
                checks = [Check(keys.users_version,
                                version.mod_revision if version is not None else 0)]
                if await store.commit(checks, puts, deletes) is None:
                    continue  # another change came first: check again against it
            except MetadataError as exc:
                raise InternalBrokerError(f"the cluster's users were not changed: {exc}") from None
            for name, u in change.items():
                if u is None:
                    users.pop(name, None)
                else:
                    users[name] = u
            await self.mirror({n: render_users([u]).encode() for n, u in users.items()})
            return
        raise InternalBrokerError(f"the cluster's users changed {MAX_WRITE_ATTEMPTS} times while "
                                  "this change was written: try again")

    # --- the mirror ---------------------------------------------------------------------------

    def _users_changed(self) -> None:
        """The watch changed the view's users: mirror them (one mirror at a time)."""
        if self._mirror_task is None or self._mirror_task.done():
            self._mirror_task = asyncio.get_running_loop().create_task(
                self.mirror(dict(self.node.view.users)))
            self._mirror_task.add_done_callback(_log_failure)

    def file_changed(self) -> None:
        """The users file was reloaded after an edit this broker did not make: put the
        cluster's users back if it now differs from them."""
        auth = self.server.auth
        if auth is None or _parse(self.node.view.users) == auth.store.users:
            return
        log.error("the users file %s was edited on this broker, but a cluster's users live in "
                  "its metadata store: the edit is undone (change users over the wire: "
                  "ferrymq user add --server ...)", auth.store.path)
        self._users_changed()

    async def mirror(self, entries: dict[str, bytes]) -> None:
        """Make this broker's users file hold exactly ``entries`` (name -> users-file entry),
        then load it and close the connections of users that are gone."""
        auth = self.server.auth
        if auth is None:
            return
        async with self._mirror_lock:
            users = _parse(entries)
            have = auth.store.users
            change: dict[str, User | None] = {n: u for n, u in users.items() if have.get(n) != u}
            change.update({n: None for n in have if n not in users})
            if not change:
                return
            await asyncio.to_thread(update_users_file, auth.store.path, change, None)
            auth.store.reload_if_changed()
            self.server.close_removed_users()
            log.info("users file %s now holds the cluster's %d users", auth.store.path,
                     len(users))


def _parse(entries: dict[str, bytes]) -> dict[str, User]:
    """Users-file entries as users (a bad entry, written by a newer broker, is skipped)."""
    out: dict[str, User] = {}
    for name, raw in entries.items():
        try:
            out.update(parse_users(raw.decode(), f"cluster user {name!r}"))
        except (ConfigError, UnicodeDecodeError) as exc:
            log.error("cluster user %r skipped: %s", name, exc)
    return out


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("the cluster's users were not mirrored into the users file: %s", exc)
