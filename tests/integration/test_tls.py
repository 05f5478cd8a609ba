"""TLS on the listener: round trips, mismatches that must fail cleanly, client certificates.

Certificates are generated at test time with the openssl CLI (tests/security_helpers.py).
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ferrymq
from ferrymq.errors import ConfigError, ConnectionClosedError
from tests.security_helpers import Certs, make_certs, make_user, write_users

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI"),
]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_broker(tmp_path: Path, certs: Certs) -> Iterator[ferrymq.Broker]:
    with ferrymq.Broker(tmp_path / "data", tls_cert_file=str(certs.server_cert),
                        tls_key_file=str(certs.server_key), auth_timeout_ms=2000) as b:
        yield b


def round_trip(address: str, topic: str, **options: object) -> list[bytes]:
    with ferrymq.Producer(address, **options) as p:
        p.send(ferrymq.Message(topic, b"over tls"))
    with ferrymq.PullConsumer(address, group="g", auto_offset_reset="earliest",
                              **options) as c:
        c.subscribe(topic)
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = [msg.body for msg in c.poll(timeout=0.5)]
    return got


def test_tls_round_trip(tls_broker: ferrymq.Broker, certs: Certs) -> None:
    assert round_trip(tls_broker.address, "t", tls=str(certs.ca)) == [b"over tls"]
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    assert round_trip(tls_broker.address, "t2", tls=ctx) == [b"over tls"]


def test_plaintext_client_against_tls_port(tls_broker: ferrymq.Broker, certs: Certs) -> None:
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosedError, match="TLS"), \
            ferrymq.AdminClient(tls_broker.address, reconnect_timeout_s=1.0) as admin:
        admin.hello()
    assert time.monotonic() - t0 < 10
    # the broker is unharmed and still serves TLS clients
    assert round_trip(tls_broker.address, "after", tls=str(certs.ca)) == [b"over tls"]


def test_tls_client_against_plaintext_port(broker: ferrymq.Broker, certs: Certs) -> None:
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosedError, match="TLS handshake"), \
            ferrymq.AdminClient(broker.address, tls=str(certs.ca), reconnect_timeout_s=30) as a:
        a.hello()
    assert time.monotonic() - t0 < 5, "a TLS mismatch must not be retried"
    assert round_trip(broker.address, "plain") == [b"over tls"]


def test_untrusted_broker_certificate(tls_broker: ferrymq.Broker, certs: Certs) -> None:
    for tls in (str(certs.other_ca), True):
        with pytest.raises(ConnectionClosedError, match="certificate"), \
                ferrymq.AdminClient(tls_broker.address, tls=tls) as admin:
            admin.hello()


def test_client_certificates(tmp_path: Path, certs: Certs) -> None:
    with ferrymq.Broker(tmp_path / "data", tls_cert_file=str(certs.server_cert),
                        tls_key_file=str(certs.server_key), tls_ca_file=str(certs.ca),
                        tls_client_auth="required") as b:
        with pytest.raises(ConnectionClosedError), ferrymq.AdminClient(
                b.address, tls=str(certs.ca), reconnect_timeout_s=1.0) as admin:
            admin.hello()
        ctx = ssl.create_default_context(cafile=str(certs.ca))
        ctx.load_cert_chain(str(certs.client_cert), str(certs.client_key))
        assert round_trip(b.address, "mtls", tls=ctx) == [b"over tls"]


def test_bad_tls_config_stops_the_broker(tmp_path: Path, certs: Certs) -> None:
    with pytest.raises(ConfigError, match="tls_cert_file"):
        ferrymq.Broker(tmp_path / "d", tls_cert_file=str(certs.server_cert),
                       tls_key_file=str(certs.client_key)).start()  # key of another cert
    with pytest.raises(ConfigError, match="go together"):
        ferrymq.Broker(tmp_path / "d", tls_cert_file=str(certs.server_cert))
    with pytest.raises(ConfigError, match="tls_client_auth"):
        ferrymq.Broker(tmp_path / "d", tls_cert_file=str(certs.server_cert),
                       tls_key_file=str(certs.server_key), tls_client_auth="required")


def test_tls_with_auth_and_the_cli(tmp_path: Path, certs: Certs) -> None:
    users = write_users(tmp_path / "users.toml", make_user("root", "root-pw", admin=True))
    with ferrymq.Broker(tmp_path / "data", tls_cert_file=str(certs.server_cert),
                        tls_key_file=str(certs.server_key), users_file=str(users)) as b:
        env = {**os.environ, "FERRYMQ_SERVER": b.address, "FERRYMQ_USER": "root",
               "FERRYMQ_PASSWORD": "root-pw"}
        cli = [sys.executable, "-m", "ferrymq.admin.cli"]
        r = subprocess.run([*cli, "--tls-ca", str(certs.ca), "produce", "secure", "hi"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        r = subprocess.run([*cli, "--tls-ca", str(certs.ca), "consume", "secure", "-g", "g",
                            "--from", "earliest", "-n", "1", "--timeout", "10"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "hi" in r.stdout, r.stderr
        r = subprocess.run([*cli, "--connect-timeout", "1", "topic", "list"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "TLS" in r.stderr


def test_cli_errors_name_its_flags_not_python_options(tmp_path: Path, certs: Certs) -> None:
    """The CLI's errors name ``--user``/``--tls`` and their environment variables; the Python
    API's messages keep naming ``auth=``/``tls=``."""
    users = write_users(tmp_path / "users.toml", make_user("root", "root-pw", admin=True))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRYMQ_")}

    def cli_error(address: str, *args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "ferrymq.admin.cli", "--server", address,
                            "--connect-timeout", "1", *args, "topic", "list"],
                           env=env, capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
        assert r.returncode == 1, r.stderr
        assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("error: ")
        assert "auth=" not in r.stderr and "tls=" not in r.stderr, r.stderr
        return r.stderr

    with ferrymq.Broker(tmp_path / "auth", users_file=str(users)) as auth_on, \
            ferrymq.Broker(tmp_path / "plain") as plain, \
            ferrymq.Broker(tmp_path / "tls", tls_cert_file=str(certs.server_cert),
                           tls_key_file=str(certs.server_key)) as tls:
        err = cli_error(auth_on.address)
        assert "--user NAME with --password, or env FERRYMQ_USER and FERRYMQ_PASSWORD" in err
        err = cli_error(plain.address, "--user", "root", "--password", "root-pw")
        assert "connect without --user (and unset env FERRYMQ_USER)" in err
        err = cli_error(tls.address)
        assert "use --tls, or --tls-ca FILE to trust its CA (env FERRYMQ_TLS, " \
               "FERRYMQ_TLS_CA)" in err

        with pytest.raises(ferrymq.errors.AuthenticationRequiredError, match=r"auth=\(user, "), \
                ferrymq.AdminClient(auth_on.address) as admin:
            admin.list_topics()
        with pytest.raises(ferrymq.errors.AuthenticationFailedError,
                           match="connect without auth="), \
                ferrymq.AdminClient(plain.address, auth=("root", "root-pw")) as admin:
            admin.list_topics()
        with pytest.raises(ConnectionClosedError, match="pass tls="), \
                ferrymq.AdminClient(tls.address, reconnect_timeout_s=1.0) as admin:
            admin.hello()
