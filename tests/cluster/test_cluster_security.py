"""A cluster whose brokers require logins and TLS: followers log in to their leaders as
``inter_broker_user`` over TLS, and the settings that cannot work are refused at start."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ferrymq.broker.config import BrokerConfig
from ferrymq.client import AsyncAdminClient, AsyncProducer, Message
from ferrymq.client.message import Durability
from ferrymq.errors import ConfigError, FerryMQTimeoutError
from tests.cluster.inprocess import cluster, run
from tests.security_helpers import Certs, make_certs, make_user, write_users

BROKER_SECRET = "broker-secret-1"
APP = ("app", "app-secret-1")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("pki"))


def secured(tmp_path: Path, certs: Certs, password: str = BROKER_SECRET) -> dict[str, str]:
    users = write_users(tmp_path / "users.toml", make_user("broker", BROKER_SECRET, admin=True),
                        make_user(*APP, produce=("orders",), consume=("orders",)))
    return {"users_file": str(users), "inter_broker_user": "broker",
            "inter_broker_password": password, "tls_cert_file": str(certs.server_cert),
            "tls_key_file": str(certs.server_key), "tls_ca_file": str(certs.ca)}


def test_followers_log_in_to_their_leaders_over_tls(tmp_path: Path, certs: Certs) -> None:
    async def body() -> None:
        async with cluster(tmp_path, **secured(tmp_path, certs)) as c:
            async with AsyncAdminClient(c.bootstrap, auth=("broker", BROKER_SECRET),
                                        tls=str(certs.ca)) as admin:
                await admin.create_topic("orders", 2, replicas=3, min_insync=3)
            async with AsyncProducer(c.bootstrap, auth=APP, tls=str(certs.ca),
                                     delivery_timeout_s=30) as p:
                for i in range(20):
                    r = await p.send(Message("orders", f"m{i}".encode()))
                    assert r.durability == Durability.REPLICATED  # all three hold it
            for q in (0, 1):
                ends = {bid: s.topics.queue("orders", q).log.end_offset
                        for bid, s in c.brokers.items()}
                assert len(set(ends.values())) == 1, ends
    run(body)


def test_a_wrong_inter_broker_password_is_reported_once_and_nothing_is_acknowledged(
        tmp_path: Path, certs: Certs, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with cluster(tmp_path, **secured(tmp_path, certs, "wrong"),
                           auth_failure_delay_ms=100) as c:
            async with AsyncAdminClient(c.bootstrap, auth=("broker", BROKER_SECRET),
                                        tls=str(certs.ca)) as admin:
                await admin.create_topic("orders", 1, replicas=3, min_insync=2)
            async with AsyncProducer(c.bootstrap, auth=APP, tls=str(certs.ca),
                                     delivery_timeout_s=3) as p:
                with pytest.raises(FerryMQTimeoutError, match="NOT_ENOUGH_REPLICAS"):
                    await p.send(Message("orders", b"never acknowledged"))
    with caplog.at_level(logging.INFO, logger="ferrymq.cluster"):
        run(body)
    refused = [r for r in caplog.records if "refused this broker's login" in r.getMessage()]
    assert refused, "the refused login was not logged"
    errors = [r for r in refused if r.levelno == logging.ERROR]
    assert 1 <= len(errors) <= 2, errors  # once per follower of the one queue ...
    assert len(refused) > len(errors)  # ... and its retries quietly


def test_a_cluster_broker_with_users_needs_an_inter_broker_user(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="inter_broker_user"):
        BrokerConfig(metadata="memory://", users_file=str(tmp_path / "u.toml")).validate()
    with pytest.raises(ConfigError, match="go together"):
        BrokerConfig(inter_broker_user="broker").validate()
    assert "hunter2" not in repr(BrokerConfig(inter_broker_user="b",
                                              inter_broker_password="hunter2"))


def test_an_inter_broker_user_without_admin_rights_is_refused_at_start(tmp_path: Path,
                                                                       certs: Certs) -> None:
    settings = {**secured(tmp_path, certs), "inter_broker_user": APP[0],
                "inter_broker_password": APP[1]}

    async def body() -> None:
        with pytest.raises(ConfigError, match="not an admin"):
            async with cluster(tmp_path, 1, **settings):
                pass
    run(body)
