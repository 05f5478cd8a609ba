"""The ``etcd`` metadata store: :class:`~ferrymq.cluster.metadata.MetadataStore` on an etcd v3
cluster, through the ``aetcd`` client (asyncio over etcd's gRPC API; ``docs/design.md`` says
why this client).

Theory of operation
-------------------
* **One gRPC channel to every endpoint.** ``etcd://h1:2379,h2:2379`` becomes one channel whose
  target lists every member's address (host names resolved when the store connects); gRPC's
  ``pick_first`` policy talks to the first member that answers and moves to the next when
  that connection breaks, and retries a call on the next member only when the call never
  left (gRPC's transparent retry), so a compare-and-swap is never sent twice by us. A
  connection to a hung member is found dead by keepalive pings
  (:data:`KEEPALIVE_INTERVAL_S`).
* **Every call has a deadline**, ``request_timeout_s``: a dead or hung etcd makes a call raise
  :class:`~ferrymq.errors.MetadataUnavailableError` within it, never hang. A commit that
  raised it may still be applied (a hung etcd applies what it received once it runs again):
  the caller reads again, and the revision checks make a retried commit safe.
* **Commits are etcd transactions**: each :class:`~ferrymq.cluster.metadata.Check` compares a
  key's ``mod_revision`` (0 for an absent key: etcd's create-if-absent), then the deletes and
  the puts run, all at one new revision, or nothing when a compare fails.
* **Watches** are streams of aetcd's watch multiplexer (one gRPC stream per store). A stream
  that breaks, a start revision that etcd compacted away, or :meth:`EtcdMetadataStore.close`
  ends the watch with ``MetadataUnavailableError``; so does a store that stays silent to a probe
  (a plain read) after ``watch_probe_s`` without events, which is how a hung etcd is noticed.
* **Leases** are etcd leases (whole seconds; etcd rounds a TTL up to its minimum, 1.5 election
  timeouts). A keep-alive that etcd answers with a TTL of 0, or a put on a lease etcd does not
  know, raises :class:`~ferrymq.errors.MetadataLeaseExpiredError`.

A store belongs to the event loop of its first call (a gRPC channel cannot change loops).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import aetcd.rpc as rpc

from ferrymq.cluster.metadata.store import COMMIT_MAX_OPS, Check, KeyValue, Put, WatchEvent
from ferrymq.errors import (
    ConfigError,
    MetadataError,
    MetadataLeaseExpiredError,
    MetadataUnavailableError,
)

__all__ = ["DEFAULT_REQUEST_TIMEOUT_S", "DEFAULT_WATCH_PROBE_S", "EtcdMetadataStore",
           "parse_endpoints"]

DEFAULT_PORT = 2379
"""etcd's client port, for an endpoint given without one."""
DEFAULT_REQUEST_TIMEOUT_S = 2.0
"""The deadline of one call: below the shortest broker lease (2 s, ``metadata_lease_ms``) so a
broker learns that etcd is gone while its lease could still be alive; far above an etcd
answer on a healthy cluster (milliseconds; a leader election takes about one election
timeout)."""
DEFAULT_WATCH_PROBE_S = 2.0
"""A watch without events for this long reads one key to check the store still answers."""
KEEPALIVE_INTERVAL_S = 10.0
"""gRPC keepalive pings on an idle connection; etcd refuses pings more often than every 5 s
(its ``--grpc-keepalive-min-time``)."""

RANGE_PAGE_KEYS = 1000
"""A range reads this many keys per request (all pages at the revision of the first, so the
result is one snapshot): a reply stays far below gRPC's 4 MiB message limit with FerryMQ's
records (a few hundred bytes each)."""
RECONNECT_MS = 100
"""gRPC's first wait before connecting again to members that refused."""
RECONNECT_MAX_MS = 1000
"""gRPC's longest wait between connection attempts (its default, 120 s, would keep a store
unavailable for minutes after an etcd outage). Calls wait for a connection up to their
deadline (gRPC's ``wait_for_ready``), so a restarted member is used within a second."""

_LEASE_NOT_FOUND = "requested lease not found"
_UNAVAILABLE = frozenset((rpc.StatusCode.UNAVAILABLE, rpc.StatusCode.DEADLINE_EXCEEDED,
                          rpc.StatusCode.CANCELLED, rpc.StatusCode.UNKNOWN,
                          rpc.StatusCode.INTERNAL, rpc.StatusCode.RESOURCE_EXHAUSTED,
                          rpc.StatusCode.ABORTED, rpc.StatusCode.OUT_OF_RANGE))
"""gRPC codes of a failure to be retried (``MetadataUnavailableError``): etcd down, no leader,
overloaded, a timeout, or a range page's revision compacted meanwhile (OUT_OF_RANGE: read
again). Other codes are refusals of the request itself (``MetadataError``)."""


def parse_endpoints(url: str) -> list[tuple[str, int]]:
    """The ``(host, port)`` pairs of ``etcd://host[:port][,host[:port]...]``.

    Raises:
        ConfigError: not an etcd URL, no endpoint, or a malformed one.
    """
    parts = urlsplit(url)
    if parts.scheme != "etcd" or not parts.netloc or parts.path not in ("", "/"):
        raise ConfigError(f"metadata store {url!r}: expected etcd://host:port[,host:port...]")
    endpoints = []
    for item in parts.netloc.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or host.endswith(":") or (host.count(":") and not host.startswith("[")):
            host, port = item.strip(), str(DEFAULT_PORT)  # no port (or a bare IPv6 address)
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"metadata store {url!r}: {item!r} is not a host:port")
        endpoints.append((host, int(port)))
    return endpoints


class EtcdMetadataStore:
    """A :class:`~ferrymq.cluster.metadata.MetadataStore` on etcd v3.

    Args:
        endpoints: ``(host, port)`` of the members to try, in turn.
        request_timeout_s: the deadline of each call (:data:`DEFAULT_REQUEST_TIMEOUT_S`).
        watch_probe_s: how long a watch waits for events before it checks the store still
            answers (:data:`DEFAULT_WATCH_PROBE_S`).
        range_page_keys: keys per request of a range (:data:`RANGE_PAGE_KEYS`).
        max_txn_ops: the etcd cluster's ``--max-txn-ops``: a commit with more checks, or more
            puts and deletes, is refused here, naming the limit (default
            :data:`~ferrymq.cluster.metadata.store.COMMIT_MAX_OPS`, what etcd must allow).

    Raises:
        ConfigError: no endpoint, or a timeout or limit that is not positive.
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]], *,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 watch_probe_s: float = DEFAULT_WATCH_PROBE_S,
                 range_page_keys: int = RANGE_PAGE_KEYS,
                 max_txn_ops: int = COMMIT_MAX_OPS) -> None:
        if not endpoints:
            raise ConfigError("an etcd metadata store needs at least one endpoint")
        for name, value in (("request_timeout_s", request_timeout_s),
                            ("watch_probe_s", watch_probe_s),
                            ("range_page_keys", range_page_keys), ("max_txn_ops", max_txn_ops)):
            if not value > 0:
                raise ConfigError(f"etcd metadata store: {name} must be > 0, not {value}")
        self.endpoints = list(endpoints)
        self.request_timeout_s = request_timeout_s
        self.watch_probe_s = watch_probe_s
        self.range_page_keys = range_page_keys
        self.max_txn_ops = max_txn_ops
        self._call: dict[str, Any] = {"timeout": request_timeout_s, "wait_for_ready": True}
        """Every call's deadline; it waits for a connection up to that (see RECONNECT_MAX_MS)."""
        self._client: Any = None  # aetcd.Client, made at the first call (in its event loop)
        self._connecting = asyncio.Lock()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, *, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 watch_probe_s: float = DEFAULT_WATCH_PROBE_S,
                 range_page_keys: int = RANGE_PAGE_KEYS,
                 max_txn_ops: int = COMMIT_MAX_OPS) -> EtcdMetadataStore:
        """The store of ``etcd://host:port[,host:port...]`` (port 2379 when left out); the
        options as for the constructor.

        Raises:
            ConfigError: a malformed URL or option.
        """
        return cls(parse_endpoints(url), request_timeout_s=request_timeout_s,
                   watch_probe_s=watch_probe_s, range_page_keys=range_page_keys,
                   max_txn_ops=max_txn_ops)

    def __repr__(self) -> str:
        return "EtcdMetadataStore(etcd://" + ",".join(f"{h}:{p}" for h, p in self.endpoints) + ")"

    # --- the interface ---------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        client = await self._connected()
        with self._mapped():
            resp = await client.kvstub.Range(rpc.RangeRequest(key=key.encode()),
                                             **self._call)
        return _key_value(resp.kvs[0]) if resp.kvs else None

    async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        client = await self._connected()
        start, end = prefix.encode() or b"\0", _prefix_end(prefix.encode())
        kvs: list[KeyValue] = []
        revision = 0  # the first page's revision, then every page at it: one snapshot
        while True:
            request = rpc.RangeRequest(key=start, range_end=end, limit=self.range_page_keys,
                                       revision=revision, sort_order=rpc.RangeRequest.ASCEND,
                                       sort_target=rpc.RangeRequest.KEY)
            with self._mapped():
                resp = await client.kvstub.Range(request, **self._call)
            revision = revision or int(resp.header.revision)
            kvs.extend(_key_value(kv) for kv in resp.kvs)
            if not resp.more or not resp.kvs:
                return kvs, revision
            start = resp.kvs[-1].key + b"\0"  # the next key after the last one read

    async def commit(self, checks: Sequence[Check], puts: Sequence[Put] = (),
                     deletes: Sequence[str] = ()) -> int | None:
        ops = len(puts) + len(deletes)
        if len(checks) > self.max_txn_ops or ops > self.max_txn_ops:
            raise MetadataError(f"a commit of {len(checks)} checks and {ops} puts and deletes "
                                f"passes the limit of {self.max_txn_ops} of each "
                                "(max_txn_ops: etcd's --max-txn-ops)")
        client = await self._connected()
        compare = [rpc.Compare(key=c.key.encode(), target=rpc.Compare.MOD,
                               result=rpc.Compare.EQUAL, mod_revision=c.mod_revision)
                   for c in checks]
        success = [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=d.encode()))
                   for d in deletes]
        success += [rpc.RequestOp(request_put=rpc.PutRequest(key=p.key.encode(), value=p.value,
                                                             lease=p.lease))
                    for p in puts]
        with self._mapped():
            resp = await client.kvstub.Txn(rpc.TxnRequest(compare=compare, success=success),
                                           **self._call)
        return int(resp.header.revision) if resp.succeeded else None

    async def grant_lease(self, ttl_s: int) -> int:
        if ttl_s < 1:
            raise ConfigError(f"a lease's ttl_s must be >= 1, not {ttl_s}")
        client = await self._connected()
        with self._mapped():
            resp = await client.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl_s),
                                                     **self._call)
        if resp.error:
            raise MetadataUnavailableError(f"etcd refused a lease: {resp.error}")
        return int(resp.ID)

    async def keep_alive(self, lease: int) -> int:
        client = await self._connected()
        ttl: int | None = None
        replies = client.leasestub.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lease)]),
                                                  **self._call)
        try:
            with self._mapped():
                async for reply in replies:  # one request, one reply
                    ttl = int(reply.TTL)
                    break
        finally:
            replies.cancel()  # also when the caller gave up first
        if ttl is None:
            raise MetadataUnavailableError(f"etcd did not answer the keep-alive of lease "
                                           f"{lease:x}")
        if ttl <= 0:  # etcd's answer for a lease it does not know
            raise MetadataLeaseExpiredError(f"lease {lease:x} has expired")
        return ttl

    async def revoke_lease(self, lease: int) -> None:
        client = await self._connected()
        with contextlib.suppress(MetadataLeaseExpiredError), self._mapped():
            await client.leasestub.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease),
                                               **self._call)

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        client = await self._connected()
        events: asyncio.Queue[WatchEvent | BaseException | None] = asyncio.Queue()
        with self._mapped():
            stream = await client.watch(prefix.encode() or b"\0",
                                        range_end=_prefix_end(prefix.encode()),
                                        start_revision=start_revision, prev_kv=True)
        pump = asyncio.get_running_loop().create_task(_pump(stream, events))
        try:
            while True:
                try:
                    first = await asyncio.wait_for(events.get(), self.watch_probe_s)
                except TimeoutError:
                    await self.get(prefix or "\0")  # still answering? (raises if not)
                    continue
                batch = [first]
                while not events.empty():
                    batch.append(events.get_nowait())
                ready = [e for e in batch if isinstance(e, WatchEvent)]
                if ready:
                    yield ready
                if len(ready) < len(batch):
                    end = next(e for e in batch if not isinstance(e, WatchEvent))
                    if self._closed or end is None:
                        raise MetadataUnavailableError("the etcd watch ended (store closed "
                                                       "or connection lost)")
                    raise _unavailable(end) from end
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump
            with contextlib.suppress(Exception):
                await asyncio.wait_for(stream.cancel(), self.request_timeout_s)

    async def close(self) -> None:
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()

    # --- inside ----------------------------------------------------------------------------

    async def _connected(self) -> Any:
        """The aetcd client, connected (one channel over every endpoint)."""
        if self._closed:
            raise MetadataUnavailableError(f"{self!r} is closed")
        async with self._connecting:  # concurrent first calls make one channel
            if self._client is None:
                self._client = await self._connect()
        return self._client

    async def _connect(self) -> Any:
        """A client whose channel lists every endpoint (see the module's docstring)."""
        with self._mapped():  # a name lookup gets the call's deadline too
            target = await asyncio.wait_for(_target(self.endpoints), self.request_timeout_s)
        host, _, port = target.rpartition(":")  # aetcd joins them back as host:port
        keepalive_ms = int(KEEPALIVE_INTERVAL_S * 1000)
        client = aetcd.Client(host=host, port=int(port), timeout=self.request_timeout_s,
                              options={"grpc.keepalive_time_ms": keepalive_ms,
                                       "grpc.keepalive_timeout_ms":
                                           int(self.request_timeout_s * 1000),
                                       "grpc.keepalive_permit_without_calls": 1,
                                       "grpc.initial_reconnect_backoff_ms": RECONNECT_MS,
                                       "grpc.min_reconnect_backoff_ms": RECONNECT_MS,
                                       "grpc.max_reconnect_backoff_ms": RECONNECT_MAX_MS})
        with self._mapped():
            await client.connect()
        return client

    @contextlib.contextmanager
    def _mapped(self) -> Iterator[None]:
        """etcd's and gRPC's errors as FerryMQ's."""
        try:
            yield
        except (rpc.AioRpcError, aetcd.exceptions.ClientError, TimeoutError, OSError) as exc:
            raise _unavailable(exc) from exc


async def _pump(stream: Any, events: asyncio.Queue[WatchEvent | BaseException | None]) -> None:
    """Move aetcd's watch events into ``events``; then None (ended) or the error."""
    try:
        async for event in stream:
            kv = event.kv
            if event.kind == "DELETE":
                created = event.prev_kv.create_revision if event.prev_kv is not None else 0
                events.put_nowait(WatchEvent(True, KeyValue(kv.key.decode(), b"",
                                                            int(kv.mod_revision),
                                                            int(created))))
            else:
                events.put_nowait(WatchEvent(False, _key_value(kv)))
    except Exception as exc:  # noqa: BLE001 - handed on: watch() raises it, mapped
        events.put_nowait(exc)
    else:
        events.put_nowait(None)


def _unavailable(exc: BaseException) -> MetadataError:
    """The FerryMQ error for an etcd or gRPC failure."""
    details = exc.details() if isinstance(exc, rpc.AioRpcError) else str(exc)
    if _LEASE_NOT_FOUND in (details or ""):
        return MetadataLeaseExpiredError(f"etcd: {details}")
    if "too many operations in txn request" in (details or ""):
        return MetadataError(f"etcd refused a commit: {details}: start etcd with --max-txn-ops "
                             f"{COMMIT_MAX_OPS} (a topic's create writes all its queues at once)")
    if isinstance(exc, rpc.AioRpcError) and exc.code() not in _UNAVAILABLE:
        return MetadataError(f"etcd refused the request: {exc.code().name}: {details}")
    if isinstance(exc, aetcd.exceptions.RevisionCompactedError):
        return MetadataUnavailableError(f"etcd: the watch's start revision is compacted away "
                                        f"({details}); read again")
    if isinstance(exc, (aetcd.exceptions.InvalidArgumentError,
                        aetcd.exceptions.PreconditionFailedError)):
        return MetadataError(f"etcd refused the request: {details}")
    return MetadataUnavailableError(f"etcd unreachable: {details or type(exc).__name__}")


def _key_value(kv: Any) -> KeyValue:
    return KeyValue(kv.key.decode(), bytes(kv.value), int(kv.mod_revision),
                    int(kv.create_revision), int(kv.lease))


def _prefix_end(prefix: bytes) -> bytes:
    """The end of the key range of ``prefix`` (``\\0``: every key, for an empty prefix)."""
    for i in reversed(range(len(prefix))):
        if prefix[i] < 0xFF:
            return prefix[:i] + bytes([prefix[i] + 1])
    return b"\0"


async def _target(endpoints: Sequence[tuple[str, int]]) -> str:
    """The gRPC target of every endpoint: ``ipv4:a:p,b:p`` (or ``ipv6:[a]:p,...``), host names
    resolved now (gRPC's ``dns:`` scheme takes one name only).

    Raises:
        MetadataUnavailableError: a host name does not resolve.
        ConfigError: IPv4 and IPv6 endpoints mixed (one gRPC target holds one family).
    """
    loop = asyncio.get_running_loop()
    addresses: list[tuple[int, str, int]] = []
    for host, port in endpoints:
        try:
            ip = ipaddress.ip_address(host)
            addresses.append((ip.version, str(ip), port))
            continue
        except ValueError:
            pass
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise MetadataUnavailableError(f"etcd endpoint {host}:{port}: {exc}") from exc
        infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first
        for family, _, _, _, sockaddr in infos:
            addresses.append((4 if family == socket.AF_INET else 6, str(sockaddr[0]), port))
            break
    families = {v for v, _, _ in addresses}
    if len(families) > 1:
        raise ConfigError(f"etcd endpoints {endpoints}: IPv4 and IPv6 addresses mixed")
    if families == {6}:
        return "ipv6:" + ",".join(f"[{ip}]:{port}" for _, ip, port in addresses)
    return "ipv4:" + ",".join(f"{ip}:{port}" for _, ip, port in addresses)
