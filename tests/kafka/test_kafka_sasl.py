"""SASL SCRAM-SHA-256 and SCRAM-SHA-512 on the Kafka port against the broker's users file, and
the users' ACLs, with confluent-kafka (librdkafka) as the client."""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ferrymq import AdminClient, Broker
from tests.helpers import free_port, wait_for
from tests.security_helpers import make_user, write_users

confluent_kafka = pytest.importorskip("confluent_kafka")

pytestmark = pytest.mark.integration


@pytest.fixture
def sbroker(tmp_path: Path) -> Iterator[Broker]:
    users = write_users(
        tmp_path / "users.json",
        make_user("alice", "s3cret-alice", produce=("orders",), consume=("orders",),
                  groups=("billing",)),
        make_user("bob", "s3cret-bob", consume=("orders",)),
        make_user("carol", "s3cret-carol", produce=("orders",), sha512=False),
        make_user("root", "s3cret-root", admin=True),
    )
    b = Broker(tmp_path / "data", port=0, kafka_port=free_port(), users_file=str(users),
               auth_failure_delay_ms=100).start()
    b.server.topics.create("orders", 1, {}, 0)
    b.server.topics.create("secret", 1, {}, 0)
    try:
        yield b
    finally:
        b.stop()


def conf(b: Broker, user: str, password: str, **extra: Any) -> dict[str, Any]:
    assert b.server.kafka is not None
    return {"bootstrap.servers": "{}:{}".format(*b.server.kafka.address),
            "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256",
            "sasl.username": user, "sasl.password": password, **extra}


def produce(b: Broker, user: str, password: str, topic: str,
            mechanism: str = "SCRAM-SHA-256") -> list[Any]:
    errors: list[Any] = []
    p = confluent_kafka.Producer(conf(b, user, password, acks="all",
                                      **{"message.timeout.ms": 5000,
                                         "sasl.mechanism": mechanism}))
    p.produce(topic, b"hello", partition=0, on_delivery=lambda err, _m: errors.append(err))
    p.flush(15)
    return errors


def test_right_password_produces_and_consumes(sbroker: Broker) -> None:
    assert produce(sbroker, "alice", "s3cret-alice", "orders") == [None]
    c = confluent_kafka.Consumer(conf(sbroker, "alice", "s3cret-alice", **{
        "group.id": "billing", "auto.offset.reset": "earliest"}))
    c.subscribe(["orders"])
    deadline = time.monotonic() + 20
    msg = None
    while msg is None and time.monotonic() < deadline:
        msg = c.poll(0.5)
        if msg is not None and msg.error() is not None:
            msg = None
    c.close()
    assert msg is not None
    assert msg.value() == b"hello"


def test_wrong_password_is_refused_and_logged(sbroker: Broker,
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ferrymq.broker")
    [err] = produce(sbroker, "alice", "wrong", "orders")
    assert err is not None
    assert err.code() in (confluent_kafka.KafkaError._MSG_TIMED_OUT,
                          confluent_kafka.KafkaError._AUTHENTICATION,
                          confluent_kafka.KafkaError.SASL_AUTHENTICATION_FAILED)
    assert any("authentication failed" in r.getMessage() for r in caplog.records)
    assert sbroker.server.topics.queue("orders", 0).log.end_offset == 0
    assert sbroker.server.auth is not None
    assert sbroker.server.auth.failures >= 1


def test_scram_sha_512_with_the_right_and_a_wrong_password(
        sbroker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ferrymq.broker")
    assert produce(sbroker, "alice", "s3cret-alice", "orders", "SCRAM-SHA-512") == [None]
    [err] = produce(sbroker, "alice", "s3cret-bob", "orders", "SCRAM-SHA-512")
    assert err is not None
    assert any("authentication failed" in r.getMessage() for r in caplog.records)
    assert sbroker.server.topics.queue("orders", 0).log.end_offset == 1


def test_a_user_without_a_sha_512_credential_is_refused_it_and_the_log_says_why(
        sbroker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ferrymq.broker")
    [err] = produce(sbroker, "carol", "s3cret-carol", "orders", "SCRAM-SHA-512")
    assert err is not None
    assert any("no SCRAM-SHA-512 credential" in r.getMessage() for r in caplog.records)
    assert produce(sbroker, "carol", "s3cret-carol", "orders") == [None]  # SHA-256 still works
    # an unknown user's failure does not say so (nor which users exist)
    caplog.clear()
    [err] = produce(sbroker, "nobody", "pw", "orders", "SCRAM-SHA-512")
    assert err is not None
    failures = [r.getMessage() for r in caplog.records if "authentication failed" in
                r.getMessage()]
    assert failures
    assert not any("credential" in m for m in failures)


def test_a_user_added_over_the_wire_logs_in_with_scram_sha_512(sbroker: Broker) -> None:
    with AdminClient(sbroker.address, auth=("root", "s3cret-root")) as admin:
        assert admin.add_user("dave", "s3cret-dave", produce=("orders",))
    assert produce(sbroker, "dave", "s3cret-dave", "orders", "SCRAM-SHA-512") == [None]
    assert produce(sbroker, "dave", "s3cret-dave", "orders") == [None]


def test_acls_apply_to_kafka_clients(sbroker: Broker) -> None:
    [err] = produce(sbroker, "alice", "s3cret-alice", "secret")  # no produce right on it
    assert err is not None
    assert err.code() == confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED
    [err] = produce(sbroker, "bob", "s3cret-bob", "orders")  # bob may only consume
    assert err is not None
    assert err.code() == confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert sbroker.server.topics.queue("orders", 0).log.end_offset == 0


def test_requests_before_authentication_close_the_connection(sbroker: Broker) -> None:
    assert sbroker.server.kafka is not None
    with socket.create_connection(sbroker.server.kafka.address, timeout=10) as s:
        header = struct.pack(">hhih", 3, 4, 1, 1) + b"x"  # Metadata v4, no SASL first
        s.sendall(struct.pack(">i", len(header) + 5) + header + b"\xff\xff\xff\xff\x01")
        assert s.recv(100) == b""


def test_sasl_over_tls_with_the_native_ports_certificate(tmp_path: Path) -> None:
    from tests.security_helpers import make_certs

    certs = make_certs(tmp_path / "pki")
    users = write_users(tmp_path / "users.json",
                        make_user("alice", "s3cret-alice", produce=("orders",),
                                  consume=("orders",)))
    b = Broker(tmp_path / "data", port=0, kafka_port=free_port(), users_file=str(users),
               tls_cert_file=str(certs.server_cert), tls_key_file=str(certs.server_key)).start()
    try:
        tls = {"security.protocol": "SASL_SSL", "ssl.ca.location": str(certs.ca)}
        errors: list[Any] = []
        p = confluent_kafka.Producer({**conf(b, "alice", "s3cret-alice"), **tls,
                                      "message.timeout.ms": 10_000})
        p.produce("orders", b"over tls", on_delivery=lambda err, _m: errors.append(err))
        p.flush(20)
        assert errors == [None]
        # a plaintext Kafka client gets nowhere
        plain: list[Any] = []
        p = confluent_kafka.Producer({**conf(b, "alice", "s3cret-alice"),
                                      "message.timeout.ms": 3000})
        p.produce("orders", b"in clear", on_delivery=lambda err, _m: plain.append(err))
        p.flush(10)
        assert plain[0] is not None
        assert sum(qs.log.end_offset for qs in b.server.topics.get("orders").queues) == 1
    finally:
        b.stop()


def test_a_user_removed_from_the_users_file_is_cut_off(sbroker: Broker, tmp_path: Path) -> None:
    from ferrymq.broker.auth import update_users_file

    assert produce(sbroker, "alice", "s3cret-alice", "orders") == [None]
    p = confluent_kafka.Producer(conf(sbroker, "bob", "s3cret-bob"))
    p.list_topics(timeout=10)
    kafka = sbroker.server.kafka
    assert kafka is not None
    # bob's connection is open and authenticated: librdkafka 2.x may have had the answer on its
    # bootstrap connection, closed that, and be authenticating its connection to broker 0
    wait_for(lambda: any(c.principal == "bob" for c in kafka.connections))
    update_users_file(tmp_path / "users.json", {"bob": None})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            c.principal == "bob" for c in sbroker.server.kafka.connections):
        time.sleep(0.1)
    assert not any(c.principal == "bob" for c in sbroker.server.kafka.connections)


def test_produce_quota_throttles_a_kafka_producer(tmp_path: Path) -> None:
    users = write_users(tmp_path / "u.json",
                        make_user("slow", "pw-slow", produce=("q",), produce_bytes_per_s=100_000),
                        make_user("fast", "pw-fast", produce=("q",)))
    b = Broker(tmp_path / "d", port=0, kafka_port=free_port(), users_file=str(users),
               flush="async").start()
    try:
        b.server.topics.create("q", 1, {}, 0)
        timings = {}
        for user, pw in (("fast", "pw-fast"), ("slow", "pw-slow")):
            p = confluent_kafka.Producer(conf(b, user, pw, acks="all", **{"linger.ms": 0}))
            p.list_topics(timeout=10)  # connected and authenticated before the clock starts
            t0 = time.monotonic()
            for _ in range(10):  # 10 x 30 KB = 300 KB, one request each; the bucket: 100 KB
                p.produce("q", b"y" * 30_000, partition=0)
                assert p.flush(30) == 0
            timings[user] = time.monotonic() - t0
        assert timings["fast"] < 1.5, timings
        assert timings["slow"] >= 1.5, timings  # (300 - 100 - 30) KB at 100 KB/s, at least
    finally:
        b.stop()


def test_a_connection_that_does_not_authenticate_is_closed(tmp_path: Path) -> None:
    users = write_users(tmp_path / "u.json", make_user("alice", "pw", produce=("q",)))
    b = Broker(tmp_path / "d", port=0, kafka_port=free_port(), users_file=str(users),
               auth_timeout_ms=300).start()
    try:
        assert b.server.kafka is not None
        with socket.create_connection(b.server.kafka.address, timeout=10) as s:
            t0 = time.monotonic()
            assert s.recv(100) == b""  # closed, nothing sent
            assert time.monotonic() - t0 < 5
    finally:
        b.stop()
