"""First connection vs reconnection: a wrong address fails fast and says why; an outage after a
successful connection is retried within ``reconnect_timeout_s`` and logged once."""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ferrymq import (
    AdminClient,
    Broker,
    HalfMessageProducer,
    HalfState,
    Message,
    Producer,
    PullConsumer,
    ReceivedMessage,
)
from ferrymq.client._session import Session
from ferrymq.errors import ConnectionClosedError
from tests.helpers import free_port

pytestmark = pytest.mark.integration


def _admin(addr: str, **options: Any) -> None:
    with AdminClient(addr, **options) as admin:
        admin.list_topics()


def _txn_producer(addr: str, **options: Any) -> None:
    HalfMessageProducer(addr, "g", lambda msg: HalfState.COMMIT, **options).close()


CLIENTS: dict[str, Callable[..., object]] = {
    "Producer": Producer,
    "PullConsumer": PullConsumer,
    "AdminClient": _admin,
    "HalfMessageProducer": _txn_producer,
}


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_closed_port_fails_within_connect_timeout_naming_address_and_cause(client: str) -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosedError) as info:
        CLIENTS[client](f"127.0.0.1:{port}", connect_timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert str(info.value) == (f"cannot connect to 127.0.0.1:{port} (connection refused) "
                               "within 1 s (connect_timeout_s)")
    assert 0.9 <= elapsed < 3.0, elapsed


def test_the_default_connect_timeout_is_five_seconds() -> None:
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosedError, match="connection refused"):
        Producer(f"127.0.0.1:{free_port()}")  # the delivery timeout (120 s) played no part
    assert 4.5 <= time.monotonic() - t0 < 8.0


def test_every_address_tried_is_named_with_its_cause() -> None:
    p1, p2 = free_port(), free_port()
    with pytest.raises(ConnectionClosedError) as info:
        _admin(f"127.0.0.1:{p1},no-such-host.invalid:{p2}", connect_timeout_s=1.0)
    assert str(info.value) == (
        f"cannot connect to 127.0.0.1:{p1} (connection refused), no-such-host.invalid:{p2} "
        "(name not resolved) within 1 s (connect_timeout_s)")


def _client_records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "ferrymq.client" and r.levelno == level]


def test_an_outage_is_retried_within_reconnect_timeout_and_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="ferrymq.client")
    port = free_port()
    b = Broker(tmp_path / "d", port=port).start()
    # connect_timeout_s is short; reconnecting after a successful connection keeps its budget
    opts: dict[str, Any] = {"connect_timeout_s": 0.5, "reconnect_timeout_s": 30.0}
    p = Producer(b.address, **opts)
    c = PullConsumer(b.address, "g", auto_offset_reset="earliest", heartbeat_interval_s=0.2,
                     **opts)
    try:
        p.send_batch([Message("t", f"before{i}") for i in range(10)])
        c.subscribe("t")
        got: list[ReceivedMessage] = []
        deadline = time.monotonic() + 10
        while len(got) < 10 and time.monotonic() < deadline:
            got += c.poll(0.2)
        assert len(got) == 10
        c.commit()  # the restarted broker has forgotten the member: it rejoins from here
        caplog.clear()  # before the stop: the clients' threads log the loss as soon as it comes
        b.stop()
        # an outage several times connect_timeout_s long: the producer's sends and the
        # consumer's polls keep trying all along
        during = [p.send_async(Message("t", f"during{i}")) for i in range(5)]
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            assert c.poll(0.2) == []
        b = Broker(tmp_path / "d", port=port).start()
        assert all(f.result(30).offset >= 10 for f in during)
        deadline = time.monotonic() + 20
        got = []
        while len(got) < 5 and time.monotonic() < deadline:
            got += c.poll(0.2)
        assert sorted(m.body.decode() for m in got) == [f"during{i}" for i in range(5)]
    finally:
        p.close()
        c.close()
        b.stop()
    warnings = _client_records(caplog, logging.WARNING)
    infos = [m for m in _client_records(caplog, logging.INFO) if m.startswith("reconnected")]
    attempts = [m for m in _client_records(caplog, logging.DEBUG) if "failed: connection refused" in m]
    # two clients, one outage each: one warning and one "reconnected" line per client, however
    # many attempts it took
    assert len(warnings) == 2, warnings
    assert all(re.match(r"lost the connection to the broker \(.*\); reconnecting to "
                        rf"127\.0\.0\.1:{port} for up to reconnect_timeout_s=30 s", w)
               for w in warnings), warnings
    assert len(infos) == 2, infos
    assert all(re.fullmatch(rf"reconnected to 127\.0\.0\.1:{port} after \d+\.\d s", m)
               for m in infos), infos
    assert len(attempts) >= 4, attempts


def test_a_reconnect_that_runs_out_of_budget_names_reconnect_timeout(tmp_path: Path) -> None:
    port = free_port()
    b = Broker(tmp_path / "d", port=port).start()
    admin = AdminClient(b.address, connect_timeout_s=5.0, reconnect_timeout_s=1.0)
    try:
        admin.list_topics()
        b.stop()
        errors: list[ConnectionClosedError] = []

        def call() -> None:
            try:
                admin.list_topics()
            except ConnectionClosedError as exc:
                errors.append(exc)

        t0 = time.monotonic()
        th = threading.Thread(target=call)
        th.start()
        th.join(15)
        assert time.monotonic() - t0 < 4.0
        assert len(errors) == 1
        assert str(errors[0]) == (f"cannot reconnect to 127.0.0.1:{port} (connection refused) "
                                  "within 1 s (reconnect_timeout_s)")
    finally:
        admin.close()


def test_the_cli_names_its_flag_for_the_budget() -> None:
    port = free_port()
    res = subprocess.run(
        [sys.executable, "-m", "ferrymq.admin.cli", "--server", f"127.0.0.1:{port}",
         "--connect-timeout", "0.5", "topic", "list"],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert res.returncode == 1
    assert res.stderr == (f"error: cannot connect to 127.0.0.1:{port} (connection refused) "
                          "within 0.5 s (--connect-timeout)\n")


def test_a_cluster_clients_session_to_one_broker_gives_up_at_once_when_refused() -> None:
    # a leader that is down refuses its port: the cluster client asks the others who leads now
    # (a refresh) instead of retrying it for connect_timeout_s; the bootstrap session retries
    async def main() -> None:
        port = free_port()
        boot = Session(f"127.0.0.1:{port}", connect_timeout_s=1.0)
        leader = boot.for_broker("127.0.0.1", port)
        t0 = time.monotonic()
        with pytest.raises(ConnectionClosedError, match=r"\(connection refused\): that broker "
                                                         r"is down"):
            await leader.connection()
        assert time.monotonic() - t0 < 0.5
        t0 = time.monotonic()
        with pytest.raises(ConnectionClosedError, match="within 1 s"):
            await boot.connection()
        assert time.monotonic() - t0 >= 0.9
        await leader.close()
        await boot.close()

    asyncio.run(main())
