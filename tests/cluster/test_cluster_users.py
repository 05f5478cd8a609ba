"""A cluster's users live in the metadata store: the first broker's users file seeds them, every
broker's file mirrors them, and a change made through any broker reaches all of them (logins,
rights, a deleted user's connections closed); an offline edit of one broker's file is undone."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from ferrymq.broker.auth import read_users_file
from ferrymq.client import AdminClient, AsyncAdminClient, AsyncProducer, Message
from ferrymq.cluster.metadata.memory import MemoryMetadataStore
from ferrymq.errors import AuthenticationFailedError, ConnectionClosedError, InvalidRequestError
from ferrymq.testing import ClusterProcess
from tests.cluster.conftest import needs_etcd
from tests.cluster.inprocess import Cluster, run
from tests.security_helpers import make_user, write_users

ADMIN = ("broker", "broker-secret-1")
ALICE = ("alice", "alice-secret-1")


def address(c: Cluster, broker_id: int) -> str:
    host, port = c.brokers[broker_id].address
    return f"{host}:{port}"


async def can_log_in(addr: str, auth: tuple[str, str]) -> bool:
    try:
        async with AsyncAdminClient(addr, auth=auth, connect_timeout_s=2) as admin:
            await admin.whoami()
        return True
    except (AuthenticationFailedError, ConnectionClosedError):
        return False


async def eventually(cond, what: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not await cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def start_three(tmp_path: Path) -> tuple[Cluster, list[Path]]:
    """Broker 1's file has the admin and alice; brokers 2 and 3 only the admin."""
    files = [write_users(tmp_path / "users-1.toml", make_user(*ADMIN, admin=True),
                         make_user(*ALICE, produce=("orders",))),
             write_users(tmp_path / "users-2.toml", make_user(*ADMIN, admin=True)),
             write_users(tmp_path / "users-3.toml", make_user(*ADMIN, admin=True))]
    c = Cluster(tmp_path, MemoryMetadataStore(), inter_broker_user=ADMIN[0],
                inter_broker_password=ADMIN[1], auth_failure_delay_ms=100)
    return c, files


def test_the_first_brokers_file_seeds_the_cluster_and_changes_reach_every_broker(
        tmp_path: Path) -> None:
    async def body() -> None:
        c, files = start_three(tmp_path)
        try:
            for i, f in enumerate(files, 1):
                await c.start(i, users_file=str(f))
            # brokers 2 and 3 adopted broker 1's users: their files say so, alice logs in there
            assert set(read_users_file(files[2])) == {"broker", "alice"}
            assert await can_log_in(address(c, 3), ALICE)
            async with AsyncAdminClient(address(c, 1), auth=ADMIN) as admin:
                assert await admin.add_user("carol", "carol-secret-1", produce=["orders"])
            await eventually(lambda: can_log_in(address(c, 3), ("carol", "carol-secret-1")),
                             "carol, added through broker 1, to log in on broker 3")
            assert "carol" in read_users_file(files[1])
            # her SCRAM-SHA-512 credential (Kafka clients) travels with her through the store
            assert read_users_file(files[1])["carol"].scram_sha_512 is not None
            assert (read_users_file(files[1])["carol"].scram_sha_512
                    == read_users_file(files[0])["carol"].scram_sha_512)
            async with AsyncProducer(address(c, 3), auth=("carol", "carol-secret-1"),
                                     delivery_timeout_s=5) as p:
                await p.send(Message("orders", b"by carol"))
                async with AsyncAdminClient(address(c, 2), auth=ADMIN) as admin:
                    await admin.remove_user("carol")
                    with pytest.raises(InvalidRequestError, match="last admin"):
                        await admin.remove_user("broker")
                await eventually(lambda: _closed(p), "carol's connection to broker 3 to close")
            assert not await can_log_in(address(c, 3), ("carol", "carol-secret-1"))
            assert all("carol" not in read_users_file(f) for f in files)
        finally:
            for i in list(c.brokers):
                await c.stop(i)
    run(body)


async def _closed(p: AsyncProducer) -> bool:
    try:
        await p.send(Message("orders", b"after the delete"))
    except Exception:  # the deleted user's connection was closed and cannot log in again
        return True
    return False


def test_an_offline_edit_of_one_brokers_file_is_undone(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        c, files = start_three(tmp_path)
        try:
            for i, f in enumerate(files[:2], 1):
                await c.start(i, users_file=str(f))
            write_users(files[1], make_user("mallory", "mallory-secret-1", admin=True))
            await eventually(lambda: _without(files[1], "mallory"), "the edit to be undone")
            assert not await can_log_in(address(c, 2), ("mallory", "mallory-secret-1"))
        finally:
            for i in list(c.brokers):
                await c.stop(i)
    with caplog.at_level(logging.ERROR, logger="ferrymq.broker.users"):
        run(body)
    assert any("edited on this broker" in r.getMessage() for r in caplog.records)


async def _without(path: Path, name: str) -> bool:
    return name not in read_users_file(path)


@needs_etcd
def test_on_etcd_a_user_added_through_one_broker_logs_in_on_another(tmp_path: Path) -> None:
    env = {"FERRYMQ_INTER_BROKER_USER": ADMIN[0], "FERRYMQ_INTER_BROKER_PASSWORD": ADMIN[1],
           "FERRYMQ_AUTH_FAILURE_DELAY_MS": "100"}
    c = ClusterProcess(2, tmp_path / "c", cluster="u", env=env)
    for i, b in c.brokers.items():  # a users file of its own each: only etcd connects them
        b.extra += ["--users-file", str(write_users(tmp_path / f"users-{i}.toml",
                                                    make_user(*ADMIN, admin=True)))]
    with c:
        one, two = c.addresses[1], c.addresses[2]
        with AdminClient(one, auth=ADMIN) as admin:
            admin.add_user("dave", "dave-secret-1")
        deadline = time.monotonic() + 15
        while True:
            try:
                with AdminClient(two, auth=("dave", "dave-secret-1"), connect_timeout_s=2) as a:
                    assert a.whoami().user == "dave"
                break
            except (AuthenticationFailedError, ConnectionClosedError):
                assert time.monotonic() < deadline, "dave never logged in on broker 2"
                time.sleep(0.2)
