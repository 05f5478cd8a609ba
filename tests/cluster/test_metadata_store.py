"""The MetadataStore contract, the same tests on every backend: the memory store (fake clock)
and a real etcd (real time). Then what only etcd has: a cluster of members, endpoint URLs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aetcd
import pytest

from ferrymq.cluster.metadata.etcd import EtcdMetadataStore, parse_endpoints
from ferrymq.cluster.metadata.store import (
    COMMIT_MAX_OPS,
    Check,
    KeyValue,
    MetadataStore,
    Put,
    WatchEvent,
    create,
    open_store,
    replace,
)
from ferrymq.errors import (
    ConfigError,
    MetadataError,
    MetadataLeaseExpiredError,
    MetadataUnavailableError,
)
from ferrymq.testing import EtcdCluster, EtcdProcess, free_port
from tests.cluster.conftest import REQUEST_TIMEOUT_S, StoreBackend, etcd_backend, needs_etcd


def run(backend: StoreBackend, body: Callable[[MetadataStore, str], Awaitable[None]]) -> None:
    """Run ``body(store, prefix)`` on a fresh event loop; close the store after."""
    async def main() -> None:
        store = backend.open()
        try:
            await body(store, backend.prefix)
        finally:
            await store.close()
    asyncio.run(main())


async def next_events(watch: object, count: int, timeout: float = 5.0) -> list[WatchEvent]:
    """The next ``count`` events of ``watch`` (across batches)."""
    it = watch.__aiter__()  # type: ignore[attr-defined]
    got: list[WatchEvent] = []
    while len(got) < count:
        got.extend(await asyncio.wait_for(it.__anext__(), timeout))
    return got


# --- reads and compare-and-swap ------------------------------------------------------------


def test_range_is_sorted_by_key_with_the_revision_of_the_read(backend: StoreBackend) -> None:
    async def body(store: MetadataStore, p: str) -> None:
        assert await store.get(p + "a") is None
        assert (await store.range(p))[0] == []
        r1 = await store.commit([], [Put(p + "b", b"2"), Put(p + "a", b"1")])
        r2 = await store.commit([], [Put(p + "c/x", b"3")])
        await store.commit([], [Put(p[:-1] + "0", b"outside")])  # shares p's start, not p
        assert r1 is not None and r2 == r1 + 1
        kvs, rev = await store.range(p)
        assert [(kv.key, kv.value, kv.mod_revision) for kv in kvs] == [
            (p + "a", b"1", r1), (p + "b", b"2", r1), (p + "c/x", b"3", r2)]
        assert rev == r2 + 1  # the store's revision, after the outside write
        assert [kv.key for kv in (await store.range(p + "c/"))[0]] == [p + "c/x"]
        assert await store.get(p + "a") == KeyValue(p + "a", b"1", r1, r1)
    run(backend, body)


def test_commit_applies_when_every_check_holds(backend: StoreBackend) -> None:
    async def body(store: MetadataStore, p: str) -> None:
        r1 = await store.commit([Check(p + "a", 0), Check(p + "b", 0)],
                                [Put(p + "a", b"1"), Put(p + "b", b"1"), Put(p + "gone", b"x")])
        assert r1 is not None
        r2 = await store.commit([Check(p + "a", r1), Check(p + "b", r1)],
                                [Put(p + "a", b"2")], [p + "gone"])
        assert r2 == r1 + 1  # puts and deletes at one new revision
        a = await store.get(p + "a")
        assert a == KeyValue(p + "a", b"2", r2, r1)  # created at r1, changed at r2
        assert await store.get(p + "gone") is None
        b = await store.get(p + "b")
        assert b is not None and b.mod_revision == r1
    run(backend, body)


def test_a_failed_check_changes_nothing_over_any_key(backend: StoreBackend) -> None:
    async def body(store: MetadataStore, p: str) -> None:
        r1 = await store.commit([], [Put(p + "a", b"1"), Put(p + "b", b"1"), Put(p + "c", b"1")])
        assert r1 is not None
        r2 = await store.commit([], [Put(p + "b", b"2")])  # b moves on
        assert r2 is not None
        before = await store.range(p)
        # a's check holds, b's does not: nothing of the commit happens
        assert await store.commit([Check(p + "a", r1), Check(p + "b", r1)],
                                  [Put(p + "a", b"X"), Put(p + "new", b"X")], [p + "c"]) is None
        assert await store.range(p) == before
        assert before[1] == r2  # and the revision did not move
        # a stale creator: the key exists
        assert await store.commit([Check(p + "a", 0)], [Put(p + "a", b"Y")]) is None
        assert await replace(store, p + "b", b"3", mod_revision=r1) is None
        assert await replace(store, p + "b", b"3", mod_revision=r2) == r2 + 1
    run(backend, body)


def test_create_puts_only_an_absent_key(backend: StoreBackend) -> None:
    async def body(store: MetadataStore, p: str) -> None:
        rev = await create(store, p + "controller", b"1")
        assert rev is not None
        assert await create(store, p + "controller", b"2") is None
        kv = await store.get(p + "controller")
        assert kv is not None and kv.value == b"1" and kv.create_revision == rev
        await store.commit([Check(p + "controller", rev)], [], [p + "controller"])
        again = await create(store, p + "controller", b"3")
        assert again is not None and again > rev  # absent again after a delete
    run(backend, body)


def test_a_commit_past_the_op_limit_is_refused_whole(backend: StoreBackend) -> None:
    async def body(store: MetadataStore, p: str) -> None:
        most = [Put(f"{p}{i:05d}", b"q") for i in range(COMMIT_MAX_OPS - 1)]
        assert await store.commit([Check(p + "x", 0)], most, [p + "x"]) is not None
        with pytest.raises(MetadataError, match=f"limit of {COMMIT_MAX_OPS}"):
            await store.commit([], [Put(p + "x", b""), Put(p + "y", b"")], [m.key for m in most])
        assert len((await store.range(p))[0]) == COMMIT_MAX_OPS - 1  # nothing deleted
    run(backend, body)


# --- leases ----------------------------------------------------------------------------------


def test_a_revoked_lease_takes_its_keys_and_cannot_be_kept_alive(backend: StoreBackend) -> None:
    async def body(store: MetadataStore, p: str) -> None:
        lease = await store.grant_lease(5)
        other = await store.grant_lease(5)
        assert lease != 0 and other != lease
        await store.commit([], [Put(p + "mine", b"1", lease), Put(p + "other", b"1", other),
                                Put(p + "kept", b"1")])
        kv = await store.get(p + "mine")
        assert kv is not None and kv.lease == lease
        assert await store.keep_alive(lease) == 5
        await store.revoke_lease(lease)
        assert [kv.key for kv in (await store.range(p))[0]] == [p + "kept", p + "other"]
        with pytest.raises(MetadataLeaseExpiredError):
            await store.keep_alive(lease)
        with pytest.raises(MetadataLeaseExpiredError):
            await store.commit([], [Put(p + "late", b"1", lease)])
        assert await store.get(p + "late") is None
        await store.revoke_lease(lease)  # unknown: ignored
        await store.revoke_lease(other)
    run(backend, body)


def test_an_expired_lease_deletes_its_keys(backend: StoreBackend) -> None:
    async def body(store: MetadataStore, p: str) -> None:
        lease = await store.grant_lease(1)
        await store.commit([], [Put(p + "a", b"1", lease), Put(p + "b", b"1", lease),
                                Put(p + "stays", b"1")])
        _, rev = await store.range(p)
        watch = store.watch(p, rev + 1)
        await backend.lease_ended(store, p + "a", 1)
        assert [kv.key for kv in (await store.range(p))[0]] == [p + "stays"]
        gone = await next_events(watch, 2)
        assert {(e.deleted, e.kv.key) for e in gone} == {(True, p + "a"), (True, p + "b")}
        assert len({e.kv.mod_revision for e in gone}) == 1  # one revision for the expiry
        with pytest.raises(MetadataLeaseExpiredError):
            await store.keep_alive(lease)
        await watch.aclose()  # type: ignore[attr-defined]
    run(backend, body)


def test_keep_alive_keeps_a_lease_past_its_ttl(backend: StoreBackend) -> None:
    async def body(store: MetadataStore, p: str) -> None:
        lease = await store.grant_lease(2)
        await store.commit([], [Put(p + "a", b"1", lease)])
        for _ in range(4):  # 3.2 s of renewals every 0.8 s: a 2 s lease outlives its TTL
            await backend.pass_time(0.8)
            assert await store.keep_alive(lease) == 2
        assert await store.get(p + "a") is not None
        await store.revoke_lease(lease)
    run(backend, body)


# --- watches ---------------------------------------------------------------------------------


def test_a_watch_yields_past_and_new_changes_in_revision_order(backend: StoreBackend) -> None:
    async def body(store: MetadataStore, p: str) -> None:
        r0 = await store.commit([], [Put(p + "before", b"0")])
        r1 = await store.commit([], [Put(p + "a", b"1"), Put(p + "b", b"1")])
        r2 = await store.commit([], [Put(p + "a", b"2")], [p + "b"])
        await store.commit([], [Put("/elsewhere" + p, b"x")])  # not under p
        assert r0 is not None and r1 is not None and r2 is not None
        watch = store.watch(p, r1)  # from r1: the past from there on, not "before"
        past = await next_events(watch, 4)
        r3 = await store.commit([], [], [p + "a"])
        r4 = await store.commit([], [Put(p + "c", b"3")])
        new = await next_events(watch, 2)
        seen = [(e.deleted, e.kv.key, e.kv.value, e.kv.mod_revision) for e in past + new]
        assert sorted(seen[:2]) == [(False, p + "a", b"1", r1), (False, p + "b", b"1", r1)]
        assert sorted(seen[2:4]) == [(False, p + "a", b"2", r2), (True, p + "b", b"", r2)]
        assert seen[4:] == [(True, p + "a", b"", r3), (False, p + "c", b"3", r4)]
        deleted_b = next(e for e in past if e.deleted)
        assert deleted_b.kv.create_revision == r1
        await watch.aclose()  # type: ignore[attr-defined]
    run(backend, body)


def test_a_watch_ends_unavailable_when_the_store_closes(backend: StoreBackend) -> None:
    async def body(store: MetadataStore, p: str) -> None:
        rev = await store.commit([], [Put(p + "a", b"1")])
        assert rev is not None
        watch = store.watch(p, rev)
        assert len(await next_events(watch, 1)) == 1
        waiting = asyncio.ensure_future(next_events(watch, 1))
        await asyncio.sleep(0.2)
        await store.close()
        with pytest.raises(MetadataUnavailableError):
            await asyncio.wait_for(waiting, 5)
    run(backend, body)


# --- losing the store ------------------------------------------------------------------------


def test_a_lost_store_ends_watches_and_fails_calls_in_time(lost_backend: StoreBackend) -> None:
    async def body(store: MetadataStore, p: str) -> None:
        rev = await store.commit([], [Put(p + "a", b"1")])
        assert rev is not None
        watch = store.watch(p, rev + 1)
        waiting = asyncio.ensure_future(next_events(watch, 1, timeout=30))
        await asyncio.sleep(0.2)
        lost_backend.lose(store)
        started = time.monotonic()
        with pytest.raises(MetadataUnavailableError):
            await asyncio.wait_for(waiting, 5)
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: store.get(p + "a"), lambda: store.range(p),
            lambda: store.commit([Check(p + "a", rev)], [Put(p + "a", b"2")]),
            lambda: store.grant_lease(5), lambda: store.keep_alive(1)]
        for call in calls:
            started = time.monotonic()
            with pytest.raises(MetadataUnavailableError):
                await asyncio.wait_for(call(), REQUEST_TIMEOUT_S + 3)
            assert time.monotonic() - started < REQUEST_TIMEOUT_S + 1
    run(lost_backend, body)


@needs_etcd
def test_a_paused_etcd_fails_calls_and_ends_watches_in_time(etcd: EtcdProcess) -> None:
    backend = etcd_backend(etcd)

    async def body(store: MetadataStore, p: str) -> None:
        rev = await store.commit([], [Put(p + "a", b"1")])
        assert rev is not None
        watch = store.watch(p, rev + 1)
        waiting = asyncio.ensure_future(next_events(watch, 1, timeout=30))
        await asyncio.sleep(0.2)
        etcd.pause()  # a hung etcd: connections stay open, nothing answers
        try:
            started = time.monotonic()
            with pytest.raises(MetadataUnavailableError):
                await store.commit([Check(p + "a", rev)], [Put(p + "a", b"2")])
            assert time.monotonic() - started < REQUEST_TIMEOUT_S + 1
            with pytest.raises(MetadataUnavailableError):
                await asyncio.wait_for(waiting, 2 * REQUEST_TIMEOUT_S + 2)  # probe + its call
        finally:
            etcd.resume()
        # the same store works again. The commit that timed out was sent: etcd may apply it
        # once it runs again, so a caller must re-read (its check makes a retry safe)
        # (re-read, as a caller does: the late commit may also land between a read and a CAS)
        for _attempt in range(5):
            kv = await store.get(p + "a")
            assert kv is not None and kv.value in (b"1", b"2")
            if await replace(store, p + "a", b"3", mod_revision=kv.mod_revision) is not None:
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("a CAS on a freshly read revision kept failing")
    run(backend, body)


@needs_etcd
def test_a_restarted_etcd_is_used_again_by_the_same_store(etcd: EtcdProcess) -> None:
    backend = etcd_backend(etcd)

    async def body(store: MetadataStore, p: str) -> None:
        rev = await store.commit([], [Put(p + "a", b"1")])
        etcd.kill9()
        with pytest.raises(MetadataUnavailableError):
            await store.get(p + "a")
        etcd.start()
        kv = await store.get(p + "a")
        assert kv is not None and kv.mod_revision == rev  # its data survived (fsynced WAL)
        assert await replace(store, p + "a", b"2", mod_revision=kv.mod_revision) is not None
    run(backend, body)


@needs_etcd
def test_a_cluster_serves_on_while_any_one_member_is_down(tmp_path: Path) -> None:
    with EtcdCluster(3, tmp_path / "etcd") as cluster:
        async def body() -> None:
            store = EtcdMetadataStore.from_url(cluster.url, request_timeout_s=REQUEST_TIMEOUT_S)
            try:
                rev = await create(store, "/k", b"0")
                assert rev is not None
                watch = store.watch("/k", rev + 1)
                for i in range(3):  # each member in turn, the one connected to first
                    cluster.kill9(i)
                    rev = await eventually(lambda i=i: bump(store, str(i + 1).encode()),
                                           within=ELECTION_S + 2 * REQUEST_TIMEOUT_S)
                    try:
                        seen = await next_events(watch, 1)
                    except MetadataUnavailableError:  # the watch was on the killed member
                        watch = store.watch("/k", rev)
                        seen = await next_events(watch, 1)
                    assert seen[-1].kv.value == str(i + 1).encode()
                    cluster.restart(i)
                await watch.aclose()  # type: ignore[attr-defined]
            finally:
                await store.close()
        asyncio.run(body())


ELECTION_S = 1.5
"""How long two etcd members take to elect a new leader after the leader's loss, at most (an
election timeout of 0.5 s, randomised up to twice that, plus the vote)."""


async def bump(store: MetadataStore, value: bytes) -> int:
    """Read /k and compare-and-swap it to ``value``: the new revision."""
    kv = await store.get("/k")
    assert kv is not None
    rev = await replace(store, "/k", value, mod_revision=kv.mod_revision)
    assert rev is not None, "a compare-and-swap lost to nobody"
    return rev


async def eventually(call: Callable[[], Awaitable[int]], within: float) -> int:
    """``call()``, retried while the store is unavailable, for at most ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await call()
        except MetadataUnavailableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


@needs_etcd
def test_a_watch_from_a_compacted_revision_ends_unavailable(etcd: EtcdProcess) -> None:
    async def body() -> None:
        store = EtcdMetadataStore.from_url(etcd.url, request_timeout_s=REQUEST_TIMEOUT_S)
        compactor = aetcd.Client("127.0.0.1", etcd.client_port)
        try:
            first = await store.commit([], [Put("/c/a", b"1")])
            last = await store.commit([], [Put("/c/a", b"2")])
            assert first is not None and last is not None
            await compactor.compact(last, physical=True)  # history before `last` is gone
            with pytest.raises(MetadataUnavailableError, match=r"compacted.*read again"):
                await next_events(store.watch("/c/", first), 1)
            kvs, _ = await store.range("/c/")  # what a caller does next
            assert [kv.value for kv in kvs] == [b"2"]
            assert (await next_events(store.watch("/c/", last), 1))[0].kv.value == b"2"
        finally:
            await compactor.close()
            await store.close()
    asyncio.run(body())


@needs_etcd
def test_a_range_larger_than_a_page_is_read_whole_at_one_revision(
        etcd_server: EtcdProcess) -> None:
    async def body() -> None:
        store = EtcdMetadataStore.from_url(etcd_server.url, range_page_keys=3)
        p = f"/paged-{time.monotonic_ns()}/"
        try:
            keys = [f"{p}{i:02d}" for i in range(10)]
            for k in reversed(keys):
                rev = await store.commit([], [Put(k, k.encode())])
            kvs, at = await store.range(p)
            assert [kv.key for kv in kvs] == keys and at == rev
            assert [kv.value for kv in kvs] == [k.encode() for k in keys]
            assert (await store.range(p + "09"))[0] == kvs[-1:]
        finally:
            await store.close()
    asyncio.run(body())


@needs_etcd
def test_a_commit_carries_up_to_the_op_limit_and_more_is_refused(
        etcd_server: EtcdProcess) -> None:
    async def body() -> None:
        p = f"/big-{time.monotonic_ns()}/"
        small = EtcdMetadataStore.from_url(etcd_server.url, max_txn_ops=2)
        unaware = EtcdMetadataStore.from_url(etcd_server.url, max_txn_ops=10 * COMMIT_MAX_OPS)
        try:
            with pytest.raises(MetadataError, match=r"3 puts and deletes .* 2 .*max_txn_ops"):
                await small.commit([], [Put(p + "a", b""), Put(p + "b", b"")], [p + "c"])
            # what the launchers' etcd allows (a topic of max_queues queues is one commit) ...
            most = [Put(f"{p}{i:05d}", b"q") for i in range(COMMIT_MAX_OPS)]
            assert await unaware.commit([], most) is not None
            assert len((await unaware.range(p))[0]) == COMMIT_MAX_OPS
            # ... and past etcd's --max-txn-ops: a refusal naming the flag, not an outage
            too_many = [Put(f"{p}x{i:05d}", b"") for i in range(COMMIT_MAX_OPS + 1)]
            with pytest.raises(MetadataError, match="--max-txn-ops 4096") as refused:
                await unaware.commit([], too_many)
            assert not isinstance(refused.value, MetadataUnavailableError)
            assert len((await unaware.range(p))[0]) == COMMIT_MAX_OPS  # none of them written
        finally:
            await small.close()
            await unaware.close()
    asyncio.run(body())


# --- addresses -------------------------------------------------------------------------------


def test_an_etcd_url_lists_endpoints_in_order() -> None:
    assert parse_endpoints("etcd://h1:2379,10.0.0.2:2380,h3") == [
        ("h1", 2379), ("10.0.0.2", 2380), ("h3", 2379)]
    assert parse_endpoints("etcd://[::1]:2379") == [("::1", 2379)]
    store = open_store("etcd://127.0.0.1:1,127.0.0.1:2")
    assert isinstance(store, EtcdMetadataStore)
    assert store.endpoints == [("127.0.0.1", 1), ("127.0.0.1", 2)]


@pytest.mark.parametrize("url", ["etcd://", "etcd://h:port", "etcd://h:0", "etcd://h:70000",
                                 "etcd://h:1/path", "http://h:2379", "etcd://h:1,,h:2"])
def test_a_malformed_etcd_url_is_refused_by_name(url: str) -> None:
    with pytest.raises(ConfigError, match="metadata store"):
        EtcdMetadataStore.from_url(url)


@pytest.mark.parametrize("option", ["request_timeout_s", "watch_probe_s", "range_page_keys",
                                    "max_txn_ops"])
def test_a_store_option_that_is_not_positive_is_refused_by_name(option: str) -> None:
    with pytest.raises(ConfigError, match=f"{option} must be > 0, not 0"):
        EtcdMetadataStore.from_url("etcd://h:1", **{option: 0})


@needs_etcd
def test_endpoints_by_host_name_are_resolved_and_tried_in_turn(etcd_server: EtcdProcess) -> None:
    async def body() -> None:
        # a dead endpoint first, then the live one by name
        store = EtcdMetadataStore.from_url(
            f"etcd://127.0.0.1:{free_port()},localhost:{etcd_server.client_port}",
            request_timeout_s=REQUEST_TIMEOUT_S)
        try:
            assert await create(store, f"/named-{time.monotonic_ns()}", b"1") is not None
        finally:
            await store.close()
        nowhere = EtcdMetadataStore.from_url("etcd://no-such-host.invalid:2379")
        with pytest.raises(MetadataUnavailableError, match=r"no-such-host\.invalid:2379"):
            await nowhere.get("/x")
    asyncio.run(body())


def test_an_unreachable_endpoint_fails_in_time() -> None:
    async def body() -> None:
        store = EtcdMetadataStore.from_url("etcd://127.0.0.1:1", request_timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(MetadataUnavailableError, match="etcd unreachable"):
            await store.get("/x")
        assert time.monotonic() - started < 1.5
        await store.close()
        with pytest.raises(MetadataUnavailableError, match="closed"):
            await store.get("/x")
    asyncio.run(body())
