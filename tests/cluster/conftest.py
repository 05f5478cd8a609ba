"""Fixtures of the cluster tests: real etcd members (:class:`~ferrymq.testing.EtcdProcess`) on
loopback ports, and every metadata store behind one :class:`StoreBackend` so the same contract
tests run on each.

etcd comes from Debian's ``etcd-server`` (``make test`` installs it as root). A machine without
it skips the etcd tests; with ``FERRYMQ_REQUIRE_ALL_TESTS`` (CI) collecting them fails instead.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from ferrymq.cluster.metadata.etcd import EtcdMetadataStore
from ferrymq.cluster.metadata.memory import MemoryMetadataStore
from ferrymq.cluster.metadata.store import MetadataStore
from ferrymq.testing import ETCD_INSTALL_HINT, EtcdProcess, etcd_binary
from tests.helpers import REQUIRE_ALL_TESTS

ETCD_MISSING = etcd_binary() is None
if ETCD_MISSING and REQUIRE_ALL_TESTS:
    raise RuntimeError(f"the cluster tests need etcd ({ETCD_INSTALL_HINT}), and "
                       "FERRYMQ_REQUIRE_ALL_TESTS is set")
needs_etcd = pytest.mark.skipif(ETCD_MISSING, reason=f"etcd is not installed ({ETCD_INSTALL_HINT})")

REQUEST_TIMEOUT_S = 1.5
"""The etcd stores' deadline in these tests: a dead etcd must be noticed within it."""
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    """One etcd per test module (tests keep apart by key prefix); started in ~0.5 s."""
    if ETCD_MISSING:
        pytest.skip(f"etcd is not installed ({ETCD_INSTALL_HINT})")
    with EtcdProcess(tmp_path_factory.mktemp("etcd") / "data") as etcd:
        yield etcd


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    """An etcd of this test's own, to kill or pause."""
    if ETCD_MISSING:
        pytest.skip(f"etcd is not installed ({ETCD_INSTALL_HINT})")
    with EtcdProcess(tmp_path / "etcd") as member:
        yield member


class StoreBackend:
    """A metadata store under test and the faults a test drives on it.

    ``open()`` makes a store (inside the test's event loop: an etcd store's channel belongs to
    it); ``prefix`` is this test's own key space; ``pass_time`` sleeps (etcd) or moves the
    fake clock (memory); ``lease_ended`` returns once a lease of ``ttl_s`` has expired;
    ``lose`` makes the store go away (etcd: kill -9; memory: unavailable, its watches lost).
    """

    def __init__(self, name: str, open_store: Callable[[], MetadataStore], *,
                 pass_time: Callable[[float], Awaitable[None]],
                 lease_ended: Callable[[MetadataStore, str, int], Awaitable[None]],
                 lose: Callable[[MetadataStore], None]) -> None:
        self.name = name
        self.open = open_store
        self.pass_time = pass_time
        self._lease_ended = lease_ended
        self._lose = lose
        self.prefix = f"/test{next(_prefixes)}-{time.monotonic_ns()}/"

    async def lease_ended(self, store: MetadataStore, key: str, ttl_s: int) -> None:
        """Return once the lease of ``ttl_s`` holding ``key`` has expired (and ``key`` gone)."""
        await self._lease_ended(store, key, ttl_s)

    def lose(self, store: MetadataStore) -> None:
        """The store goes away."""
        self._lose(store)


def memory_backend() -> StoreBackend:
    """The memory store on a fake clock."""
    now = [0.0]
    store = MemoryMetadataStore(clock=lambda: now[0])

    async def pass_time(seconds: float) -> None:
        now[0] += seconds

    async def expire(s: MetadataStore, key: str, ttl_s: int) -> None:
        now[0] += ttl_s + 0.001
        store.expire_leases()

    def lose(s: MetadataStore) -> None:
        store.available = False
        store.lose_watches()

    return StoreBackend("memory", lambda: store, pass_time=pass_time, lease_ended=expire,
                        lose=lose)


def etcd_backend(etcd: EtcdProcess) -> StoreBackend:
    """An etcd store on ``etcd`` (real time: leases end in real seconds)."""
    async def expire(s: MetadataStore, key: str, ttl_s: int) -> None:
        deadline = time.monotonic() + ttl_s + 5  # etcd checks expiries every 0.5 s
        while await s.get(key) is not None:
            assert time.monotonic() < deadline, f"{key} outlived its {ttl_s} s lease"
            await asyncio.sleep(0.1)

    return StoreBackend("etcd", lambda: EtcdMetadataStore.from_url(
        etcd.url, request_timeout_s=REQUEST_TIMEOUT_S, watch_probe_s=REQUEST_TIMEOUT_S),
        pass_time=asyncio.sleep, lease_ended=expire, lose=lambda s: etcd.kill9())


@pytest.fixture(params=["memory", pytest.param("etcd", marks=needs_etcd)])
def backend(request: pytest.FixtureRequest) -> StoreBackend:
    """Each store on a store shared by the module (etcd) or of its own (memory)."""
    if request.param == "memory":
        return memory_backend()
    return etcd_backend(request.getfixturevalue("etcd_server"))


@pytest.fixture(params=["memory", pytest.param("etcd", marks=needs_etcd)])
def lost_backend(request: pytest.FixtureRequest) -> StoreBackend:
    """Each store on a store of the test's own (it is going to be lost)."""
    if request.param == "memory":
        return memory_backend()
    return etcd_backend(request.getfixturevalue("etcd"))
