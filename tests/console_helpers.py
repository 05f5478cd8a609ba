"""Helpers of the web console's tests (HTTP and browser): brokers with the console on, and
the data its pages show (a topic, a pull group with lag, a delivery group with dead letters)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ferrymq import AdminClient, Message, Producer, PullConsumer, SimpleConsumer
from ferrymq.broker.embedded import Broker
from tests.helpers import free_port, wait_for
from tests.security_helpers import make_user, write_users

ADMIN = ("root", "root-secret")
READER = ("reader", "reader-secret")
VIEWER = ("viewer", "viewer-secret")
"""A user without admin rights who may consume ``orders*`` and use group ``dg``."""


@contextmanager
def console_broker(tmp_path: Path, *, auth: bool = False, **config: Any) -> Iterator[Broker]:
    """A broker (wire on a free port) with its HTTP listener and console on another; with
    ``auth`` a users file of an admin (:data:`ADMIN`), a user without rights
    (:data:`READER`) and one with some (:data:`VIEWER`)."""
    if auth:
        users = write_users(tmp_path / "users.toml", make_user(*ADMIN, admin=True),
                            make_user(*READER),
                            make_user(*VIEWER, consume=("orders*",), groups=("dg",)))
        config["users_file"] = str(users)
    port = free_port()
    with Broker(tmp_path / "data", http_port=port, **config) as b:
        yield b


def http_url(b: Broker) -> str:
    """``http://host:port`` of ``b``'s HTTP listener."""
    assert b.server.http is not None
    host, port = b.server.http.address
    return f"http://{host}:{port}"


def admin_client(b: Broker, auth: tuple[str, str] | None = None) -> AdminClient:
    """A blocking admin client to ``b``'s wire port."""
    return AdminClient(b.address, auth=auth)


def produce(b: Broker, topic: str, n: int, *, queues: int = 2,
            auth: tuple[str, str] | None = None, key: str | None = None,
            create: bool = True) -> None:
    """Create ``topic`` (unless not ``create``) and send ``n`` messages to it (body ``m<i>``)."""
    if create:
        with admin_client(b, auth) as admin:
            admin.create_topic(topic, queues)
    with Producer(b.address, auth=auth) as p:
        for i in range(n):
            p.send(Message(topic, f"m{i}".encode(), keys=key or (), sharding_key=str(i)))


def consume_all(b: Broker, topic: str, group: str, consumed: int, *,
                auth: tuple[str, str] | None = None) -> None:
    """Consume the ``consumed`` messages of ``topic`` in pull group ``group`` and commit."""
    with PullConsumer(b.address, group, auto_offset_reset="earliest", auto_commit=False,
                      auth=auth) as c:
        c.subscribe(topic)
        got: list[Any] = []
        deadline = time.monotonic() + 10
        while len(got) < consumed and time.monotonic() < deadline:
            got.extend(c.poll(timeout=0.2))
        assert len(got) >= consumed
        c.commit()


def receive(sc: SimpleConsumer, n: int, *, timeout_s: float = 10.0) -> list[Any]:
    """Up to ``n`` messages leased by ``sc`` (several receives, at most ``timeout_s``)."""
    leased: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(leased) < n and time.monotonic() < deadline:
        leased.extend(sc.receive(n - len(leased), wait=0.3))
    return leased


def dead_letters(b: Broker, topic: str, group: str, n: int, *,
                 auth: tuple[str, str] | None = None) -> None:
    """Make ``n`` dead letters in delivery group ``group``: its member nacks ``n`` messages of
    ``topic`` with no retry left."""
    with SimpleConsumer(b.address, group, max_reconsume=0, auth=auth) as sc:
        sc.subscribe(topic)
        leased = receive(sc, n)
        assert len(leased) == n
        for msg in leased:
            sc.nack(msg, reason="bad payload")
    with admin_client(b, auth) as admin:
        wait_for(lambda: admin.describe_delivery(group).dlq_size == n)
