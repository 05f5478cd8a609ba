"""The connector's blocking connection against a real broker (no Spark session): it reads the
broker as the asyncio clients do, through their shared connection core."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ferrymq import AdminClient, Broker
from ferrymq.errors import ConnectionClosedError, LeaderNotAvailableError, UnknownTopicError
from ferrymq.protocol import messages as m
from ferrymq.spark import _route, _wire
from ferrymq.spark._wire import BlockingConnection
from tests.security_helpers import RawClient


def test_a_refusal_at_admission_names_the_broker_reason(tmp_path: Path) -> None:
    """The broker answers a connection over its limit with one BUSY frame (correlation id 0)
    and closes it: the connector reports the broker's reason, not only a closed socket."""
    with Broker(tmp_path / "d", port=0, max_connections_per_ip=1) as b, RawClient(b.address) as held:
        assert held.call(m.PingRequest())[0] == 0
        conn = BlockingConnection(b.address, connect_timeout_s=2.0, request_timeout_s=2.0)
        with pytest.raises(ConnectionClosedError, match="max_connections_per_ip=1"):
            conn.connect()
        assert not conn.is_open


def test_an_answer_owed_by_a_closed_connection_fails_at_once(module_broker: Broker) -> None:
    """A request whose connection was closed and replaced is not waited for on the new one
    (it used to read until the request timeout); ids go on across the reconnect."""
    conn = BlockingConnection(module_broker.address, request_timeout_s=5.0).connect()
    try:
        corr = conn.send(m.PingRequest())
        conn.close()
        conn.request(m.PingRequest(), m.Empty)  # reconnects
        assert conn.send(m.PingRequest()) > corr + 1  # the new connection's HELLO came between
        start = time.monotonic()
        with pytest.raises(ConnectionClosedError, match="connection closed"):
            conn.receive(corr, m.Empty)
        assert time.monotonic() - start < 1.0
    finally:
        conn.close()


def test_pipelined_answers_reach_their_requests(module_broker: Broker) -> None:
    """Answers to requests sent ahead are kept until asked for, in any order."""
    conn = BlockingConnection(module_broker.address).connect()
    try:
        ping = conn.send(m.PingRequest())
        meta = conn.send(m.MetadataRequest(["wire-t"], True))
        assert conn.receive(meta, m.MetadataResponse).topics[0][0] == "wire-t"
        assert conn.receive(ping, m.Empty) == m.Empty()
    finally:
        conn.close()


def test_a_single_broker_routes_every_queue_over_its_one_connection(module_broker: Broker) -> None:
    """On a single broker (a cluster of one) the router adds one metadata request and no
    connection: every queue's leader is the broker of the bootstrap connection."""
    with AdminClient(module_broker.address) as admin:
        admin.create_topic("routed", 3)
    router = _route.router(module_broker.address)
    boot = _wire.connection(module_broker.address)
    assert all(router.connection("routed", q) is boot for q in range(3))
    assert router.refreshes == 1
    groups, unrouted = router.split([("routed", q, q) for q in range(4)])
    assert groups == {boot: [("routed", 0, 0), ("routed", 1, 1), ("routed", 2, 2)]}
    assert unrouted == [("routed", 3, 3)]  # the topic has no queue 3
    with pytest.raises(LeaderNotAvailableError, match="no live leader of routed/3"):
        router.request("routed", 3, m.ListOffsetsRequest([("routed", 3, -1)], 0),
                       m.ListOffsetsResponse, code=lambda r: int(r.results[0][2]),
                       timeout_s=0.3)
    with pytest.raises(UnknownTopicError, match="unknown topic 'missing'"):
        router.connection("missing", 0)
    _route.forget(module_broker.address)
    assert not boot.is_open
