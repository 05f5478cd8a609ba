"""The :class:`MetadataStore` interface and its values.

Semantics (etcd v3's, which every backend keeps):

* Every change bumps one store-wide **revision**; each key carries the revision of its last
  change (``mod_revision``) and of its creation (``create_revision``).
* Writes are **compare-and-swap**: :meth:`MetadataStore.commit` applies its puts and deletes
  only if every :class:`Check` holds (a key's ``mod_revision`` equals the given one; 0 means the
  key must be absent), all or nothing. A lease or a lock alone never fences (Jepsen's lesson on
  etcd): the callers put the revision they read into their writes.
* A **lease** has a TTL; keys put with it vanish when it expires or is revoked. A holder must
  :meth:`~MetadataStore.keep_alive` it; :class:`~ferrymq.errors.MetadataLeaseExpiredError`
  says it is gone.
* A **watch** yields every change under a prefix after a revision, in revision order.

Failures to reach the store raise :class:`~ferrymq.errors.MetadataUnavailableError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from ferrymq.errors import ConfigError

COMMIT_MAX_OPS = 4096
"""The most checks, and the most puts and deletes, one :meth:`MetadataStore.commit` may carry:
a topic's create writes its queues (``max_queues``, 1024 by default) and two more keys in one
commit. etcd refuses more than its ``--max-txn-ops`` (128 unless set): FerryMQ's etcd must be
started with ``--max-txn-ops 4096`` (its launchers do)."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as stored."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change under a watched prefix: a put (``kv`` is the new value) or a delete (``kv.value``
    is empty and ``kv.mod_revision`` is the revision of the delete)."""

    deleted: bool
    kv: KeyValue


@dataclass(frozen=True, slots=True)
class Check:
    """A condition of :meth:`MetadataStore.commit`: ``key``'s mod revision is ``mod_revision``
    (0: the key does not exist)."""

    key: str
    mod_revision: int


@dataclass(frozen=True, slots=True)
class Put:
    """A write of :meth:`MetadataStore.commit`, attached to ``lease`` when not 0."""

    key: str
    value: bytes
    lease: int = 0


class MetadataStore(Protocol):
    """A strictly serialisable key-value store with revisions, leases and watches."""

    async def get(self, key: str) -> KeyValue | None:
        """The key, or None."""
        ...

    async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key starting with ``prefix``, sorted by key, and the store's revision then."""
        ...

    async def commit(self, checks: Sequence[Check], puts: Sequence[Put] = (),
                     deletes: Sequence[str] = ()) -> int | None:
        """Apply ``puts`` and ``deletes`` if every check holds: the new revision, or None (and
        nothing changed) when a check failed."""
        ...

    async def grant_lease(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id (never 0)."""
        ...

    async def keep_alive(self, lease: int) -> int:
        """Renew the lease; its TTL in seconds. Raises ``MetadataLeaseExpiredError`` if it is
        gone."""
        ...

    async def revoke_lease(self, lease: int) -> None:
        """End the lease now (its keys go); unknown leases are ignored."""
        ...

    def watch(self, prefix: str, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        """Every change under ``prefix`` from ``start_revision`` on, in revision order, in
        batches. Ends (raising ``MetadataUnavailableError``) when the store is lost; the caller
        re-reads with :meth:`range` and watches again."""
        ...

    async def close(self) -> None:
        """Release connections; ends open watches."""
        ...


async def create(store: MetadataStore, key: str, value: bytes, *, lease: int = 0) -> int | None:
    """Put ``key`` only if it does not exist: the new revision, or None."""
    return await store.commit([Check(key, 0)], [Put(key, value, lease)])


async def replace(store: MetadataStore, key: str, value: bytes, *, mod_revision: int,
                  lease: int = 0) -> int | None:
    """Put ``key`` only if its mod revision is ``mod_revision``: the new revision, or None."""
    return await store.commit([Check(key, mod_revision)], [Put(key, value, lease)])


def open_store(url: str) -> MetadataStore:
    """The store a ``--metadata`` URL names: ``etcd://host:port[,host:port...]`` or
    ``memory://`` (one process only: tests).

    Raises:
        ConfigError: an unknown scheme or a malformed address list.
    """
    scheme = urlsplit(url).scheme
    if scheme == "etcd":
        from ferrymq.cluster.metadata.etcd import EtcdMetadataStore

        return EtcdMetadataStore.from_url(url)
    if scheme == "memory":
        from ferrymq.cluster.metadata.memory import MemoryMetadataStore

        return MemoryMetadataStore()
    raise ConfigError(f"metadata store {url!r}: expected etcd://host:port[,host:port...] "
                      "or memory://")
