"""The connector against a broker with authentication and TLS on: write and read back through
real Spark with the ``auth.*`` and ``tls.*`` options; wrong credentials and a missing ``tls``
fail the job with a clear message."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ferrymq import AdminClient
from tests.helpers import BrokerProcess
from tests.security_helpers import Certs, make_certs, make_user, write_users

pytestmark = pytest.mark.integration
APP = ("spark-app", "app-secret-1")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory, certs: Certs
                  ) -> Iterator[BrokerProcess]:
    """A broker process with authentication and TLS on."""
    d = tmp_path_factory.mktemp("secure")
    users = write_users(d / "users.toml", make_user("root", "root-secret", admin=True),
                        make_user(*APP, produce=("sec*",), consume=("sec*",),
                                  groups=("spark-write-*",)))
    with BrokerProcess(d / "data", extra=["--users-file", str(users), "--tls-cert-file",
                                          str(certs.server_cert), "--tls-key-file",
                                          str(certs.server_key)]) as b:
        with AdminClient(b.address, auth=("root", "root-secret"), tls=str(certs.ca)) as admin:
            admin.create_topic("sec-orders", 2)
        yield b


def _opts(broker: BrokerProcess, certs: Certs, **extra: str) -> dict[str, str]:
    return {"servers": broker.address, "auth.user": APP[0], "auth.secret": APP[1],
            "tls.cafile": str(certs.ca), **extra}


def test_write_and_read_with_auth_and_tls(spark: Any, secure_broker: BrokerProcess, certs: Certs) -> None:
    df = spark.sql("SELECT CONCAT('o-', CAST(id AS STRING)) AS value FROM range(0, 2000, 1, 2)")
    df.write.format("ferrymq").options(**_opts(secure_broker, certs, topic="sec-orders")).mode(
        "append").save()  # deliveryMode=transactional: INIT_TXN, stage, COMMIT_STAGED
    rows = (spark.read.format("ferrymq")
            .options(**_opts(secure_broker, certs, subscribe="sec-orders")).load()
            .selectExpr("CAST(value AS STRING) AS v").collect())
    assert sorted(r.v for r in rows) == sorted(f"o-{i}" for i in range(2000))


def test_bad_credentials_and_plain_tcp_fail_clearly(spark: Any, secure_broker: BrokerProcess,
                                                    certs: Certs, tmp_path: Path) -> None:
    bad = _opts(secure_broker, certs, subscribe="sec-orders")
    bad["auth.secret"] = "wrong"
    with pytest.raises(Exception, match=r"(?i)authentication"):
        spark.read.format("ferrymq").options(**bad).load().collect()
    plain = {"servers": secure_broker.address, "auth.user": APP[0], "auth.secret": APP[1],
             "subscribe": "sec-orders"}
    with pytest.raises(Exception, match="option 'tls'"):
        spark.read.format("ferrymq").options(**plain).load().collect()
    untrusted = _opts(secure_broker, certs, subscribe="sec-orders")
    untrusted["tls.cafile"] = str(certs.other_ca)
    with pytest.raises(Exception, match="TLS handshake"):
        spark.read.format("ferrymq").options(**untrusted).load().collect()
