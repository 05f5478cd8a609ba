"""The broker's HTTP listener over real sockets: /healthz, /readyz, /metrics, 404/405, its limits,
readiness flipping, metrics against what the admin API reports, and a subprocess broker."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ferrymq import AdminClient, Message, Producer, PullConsumer, SimpleConsumer
from ferrymq.broker.config import load
from ferrymq.broker.embedded import Broker
from ferrymq.errors import ConfigError
from ferrymq.ops.metrics import METRICS
from tests.helpers import BrokerProcess, FakeStatm, free_port, wait_for

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def get(port: int, path: str, method: str = "GET", headers: dict[str, str] | None = None,
        data: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request: status, headers, body (errors included)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def raw(port: int, request: bytes, timeout: float = 10) -> bytes:
    """Send raw bytes, return everything the server answers until it closes or is quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and b"Connection: close" not in out:
                    break
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def scrape(port: int) -> tuple[Samples, dict[str, str]]:
    """The samples of /metrics by (name, labels) and each family's type."""
    status, headers, body = get(port, "/metrics")
    assert status == 200, body
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples: Samples = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(body.decode()):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, types


def value(samples: Samples, name: str, **labels: Any) -> float:
    return samples[(name, frozenset((k, str(v)) for k, v in labels.items()))]


def end_offsets(samples: Samples, topic: str) -> float:
    """The sum of ``topic``'s queue end offsets."""
    return sum(v for (n, lb), v in samples.items()
               if n == "ferrymq_queue_end_offset" and ("topic", topic) in lb)


def exposed_name(fam: str, kind: str) -> str:
    """The METRICS name of a parsed family (the parser drops a counter's ``_total``)."""
    return f"{fam}_total" if kind == "counter" else fam


@pytest.fixture
def http_broker(tmp_path: Path) -> Any:
    port = free_port()
    with Broker(tmp_path / "data", http_port=port) as b:
        b.http_port = port  # type: ignore[attr-defined]
        yield b


def test_health_ready_and_metrics_answer(http_broker: Any) -> None:
    port = http_broker.http_port
    assert http_broker.server.http.address == ("127.0.0.1", port)
    assert get(port, "/healthz")[::2] == (200, b"ok\n")
    status, headers, body = get(port, "/readyz")
    assert (status, json.loads(body)) == (200, {"ready": True, "reasons": []})
    assert headers["Content-Type"].startswith("application/json")
    samples, _ = scrape(port)
    assert value(samples, "ferrymq_ready") == 1
    status, _, body = get(port, "/healthz", method="HEAD")
    assert (status, body) == (200, b"")


def test_unknown_path_is_404_and_wrong_method_405(http_broker: Any) -> None:
    port = http_broker.http_port
    status, _, body = get(port, "/nope")
    assert status == 404 and b"no such path: /nope" in body
    for method in ("POST", "PUT", "DELETE"):
        status, headers, body = get(port, "/metrics", method=method, data=b"")
        assert status == 405, method
        assert headers["Allow"] == "GET, HEAD"


def test_limits_refuse_oversized_requests_and_the_wire_still_serves(tmp_path: Path) -> None:
    port = free_port()
    with Broker(tmp_path / "data", http_port=port, http_max_header_bytes=1024,
                http_max_body_bytes=100, http_max_connections=3,
                http_idle_timeout_ms=2000) as b:
        # a header field over http_max_header_bytes: refused, nothing served
        big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4096 + b"\r\n\r\n"
        assert raw(port, big).split(b" ", 2)[1] in (b"400", b"431")
        # a request line over it
        assert raw(port, b"GET /" + b"a" * 4096 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
                   ).split(b" ", 2)[1] in (b"400", b"414")
        # a body over http_max_body_bytes: 413 by its Content-Length, connection closed
        resp = raw(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
        assert resp.startswith(b"HTTP/1.1 413"), resp
        assert b"http_max_body_bytes=100" in resp
        # a body without a length: 411
        resp = raw(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                         b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        assert resp.startswith(b"HTTP/1.1 411"), resp
        # http_max_connections: the fourth connection gets a 503 and is closed
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        try:
            wait_for(lambda: len(b.server.http._web.connections) >= 3)  # type: ignore[union-attr]
            resp = raw(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert resp.startswith(b"HTTP/1.1 503"), resp
            assert b"too many connections" in resp
            # the idle ones are closed after http_idle_timeout_ms
            held[0].settimeout(5)
            held[0].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert held[0].recv(4096).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert held[0].recv(4096) == b""  # closed by the server
            assert time.monotonic() - t0 < 4.5
        finally:
            for s in held:
                s.close()
        wait_for(lambda: get(port, "/healthz")[0] == 200)
        assert b.server.http.refused >= 1  # type: ignore[union-attr]
        # the broker's wire protocol is unaffected
        with Producer(b.address) as p:
            p.send(Message("after", b"still serving"))
        samples, _ = scrape(port)
        assert end_offsets(samples, "after") == 1


def test_http_port_taken_fails_the_start_and_creates_nothing(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"cannot listen for HTTP on 127.0.0.1:{port}: "
                                              r"address already in use"):
            Broker(tmp_path / "never" / "data", http_port=port).start()
    assert not (tmp_path / "never").exists()


def test_http_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"http_port must be 0\.\.65535"):
        load(overrides={"http_port": 70000})
    with pytest.raises(ConfigError, match="http_port and port must differ"):
        load(overrides={"http_port": 9876})
    with pytest.raises(ConfigError, match="http_max_body_bytes must be > 0"):
        load(overrides={"http_max_body_bytes": 0})
    assert load().http_port == 9877
    assert load(overrides={"http_port": 0}).http_port == 0


def test_embedded_and_subprocess_test_brokers_keep_http_off(tmp_path: Path) -> None:
    with Broker(tmp_path / "data") as b:
        assert b.server.http is None
    assert "--http-port" in BrokerProcess(tmp_path / "d2").argv()


def test_readyz_flips_on_a_memory_watermark_and_on_shutdown(tmp_path: Path) -> None:
    port = free_port()
    b = Broker(tmp_path / "data", http_port=port, memory_high_watermark_bytes=1,
               shutdown_timeout_ms=5000).start()
    try:
        def not_ready() -> bool:
            status, _, body = get(port, "/readyz")
            return status == 503 and any("memory_high_watermark_bytes=1" in r
                                         for r in json.loads(body)["reasons"])
        wait_for(not_ready)  # any RSS is above one byte
        samples, _ = scrape(port)
        assert value(samples, "ferrymq_memory_watermark_tripped") == 1
        assert value(samples, "ferrymq_ready") == 0
        assert value(samples, "ferrymq_resident_memory_bytes") > 1_000_000
    finally:
        b.stop()


def test_readyz_is_503_while_the_broker_drains(tmp_path: Path) -> None:
    """A graceful stop waits for requests in flight (here a delivery long poll); meanwhile
    /readyz says "shutting down" so a load balancer takes the broker out."""
    port = free_port()
    b = Broker(tmp_path / "data", http_port=port, shutdown_timeout_ms=3000).start()
    loop = b._loop
    assert loop is not None
    with SimpleConsumer(b.address, "drained", reconnect_timeout_s=1) as sc:
        sc.subscribe("quiet")
        t = threading.Thread(target=lambda: sc.receive(1, wait=20), daemon=True)
        t.start()
        wait_for(lambda: any(c.pending for c in b.server.connections))
        stopping = asyncio.run_coroutine_threadsafe(b.server.stop(), loop)
        status, _, body = get(port, "/readyz")
        assert status == 503, body
        assert json.loads(body) == {"ready": False, "reasons": ["shutting down"]}
        assert get(port, "/healthz")[0] == 200
        stopping.result(timeout=30)
        t.join(timeout=30)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


def test_metrics_match_the_admin_api(http_broker: Any) -> None:
    port = http_broker.http_port
    addr = http_broker.address
    with AdminClient(addr) as admin:
        admin.create_topic("orders", 2)
        with Producer(addr) as p:
            for i in range(20):
                p.send(Message("orders", b"x" * 50, sharding_key=str(i)))
            p.send(Message("orders", b"later", delay=600))
        with PullConsumer(addr, "pg", auto_offset_reset="earliest", auto_commit=False) as c:
            c.subscribe("orders")
            got: list[Any] = []
            deadline = time.monotonic() + 10
            while len(got) < 20 and time.monotonic() < deadline:
                got.extend(c.poll(timeout=0.2))
            c.commit()
        with Producer(addr) as p:
            for i in range(5):
                p.send(Message("orders", b"y", sharding_key=str(i)))
        time.sleep(1.1)  # the unconsumed messages are at least this old
        with SimpleConsumer(addr, "dg", invisible_duration=60) as sc:
            sc.subscribe("orders")
            leased: list[Any] = []
            deadline = time.monotonic() + 10
            while len(leased) < 3 and time.monotonic() < deadline:
                leased.extend(sc.receive(3 - len(leased), wait=0.3))
            samples, types = scrape(port)
            topic = admin.describe_topic("orders")
            group = admin.describe_group("pg")
            delivery = admin.describe_delivery("dg")
    for q in topic.queues:
        lb = {"topic": "orders", "queue": q.queue}
        assert value(samples, "ferrymq_queue_end_offset", **lb) == q.end_offset
        assert value(samples, "ferrymq_queue_start_offset", **lb) == q.first_offset
        assert value(samples, "ferrymq_queue_size_bytes", **lb) == q.size_bytes
        assert value(samples, "ferrymq_queue_segments", **lb) == q.segments
    assert value(samples, "ferrymq_delayed_messages_pending") == topic.scheduled_pending == 1
    lag_total = 0
    for o in group.offsets:
        lb = {"group": "pg", "topic": o.topic, "queue": o.queue}
        assert value(samples, "ferrymq_consumer_group_committed_offset", **lb) == o.committed
        assert value(samples, "ferrymq_consumer_group_lag_messages", **lb) == o.lag
        age = value(samples, "ferrymq_consumer_group_lag_seconds", **lb)
        assert (age >= 1.0) if o.lag else (age == 0)
        lag_total += o.lag
    assert lag_total == 5  # also with no member online
    assert value(samples, "ferrymq_consumer_group_members", group="pg") == 0
    assert len(leased) == 3
    assert value(samples, "ferrymq_delivery_group_in_flight", group="dg") == sum(
        q.in_flight for q in delivery.queues) + delivery.retry_in_flight == 3
    assert value(samples, "ferrymq_delivery_group_dlq_depth", group="dg") == delivery.dlq_size
    assert value(samples, "ferrymq_delivery_group_retry_backlog", group="dg") == \
        delivery.retry_pending
    assert value(samples, "ferrymq_delivery_group_members", group="dg") == 1
    oldest = max(q.oldest_age_ms for q in delivery.queues) / 1000
    assert abs(value(samples, "ferrymq_delivery_group_oldest_unacked_seconds", group="dg")
               - oldest) < 2
    assert value(samples, "ferrymq_requests_total", api="produce") >= 2
    assert value(samples, "ferrymq_request_bytes_total", api="produce") > 20 * 50
    assert value(samples, "ferrymq_requests_total", api="fetch") >= 1
    assert value(samples, "ferrymq_request_duration_seconds_count", api="produce") == \
        value(samples, "ferrymq_requests_total", api="produce")
    assert value(samples, "ferrymq_flush_round_files_count") >= 1
    assert value(samples, "ferrymq_connections", state="active") >= 2  # admin + simple
    assert value(samples, "ferrymq_open_transactions") == 0
    assert value(samples, "ferrymq_disk_watermark_tripped") == 0
    # exactly what METRICS (so docs/metrics.md) lists, but the cluster's
    exposed = {exposed_name(n, t) for n, t in types.items()}
    assert exposed == {s.name for s in METRICS if not s.cluster}
    assert {exposed_name(n, t): t for n, t in types.items()} == {
        s.name: s.kind for s in METRICS if not s.cluster}
    # no message body in any label
    assert not any("x" * 50 in v for (_, lb) in samples for _, v in lb)


def test_a_subprocess_broker_serves_http_and_flips_readiness(tmp_path: Path) -> None:
    port = free_port()
    statm = FakeStatm(tmp_path / "statm", 50 * 1024 * 1024)
    with BrokerProcess(tmp_path / "data", extra=["--http-port", str(port)],
                       env={"FERRYMQ_MEMORY_HIGH_WATERMARK_BYTES": str(200 * 1024 * 1024)},
                       faults=statm.faults) as bp:
        assert get(port, "/healthz")[0] == 200
        wait_for(lambda: get(port, "/readyz")[0] == 200)
        statm.set_rss(300 * 1024 * 1024)
        wait_for(lambda: get(port, "/readyz")[0] == 503)
        assert "memory_high_watermark_bytes" in json.loads(get(port, "/readyz")[2])["reasons"][0]
        samples, _ = scrape(port)
        assert value(samples, "ferrymq_resident_memory_bytes") == 300 * 1024 * 1024
        statm.set_rss(50 * 1024 * 1024)
        wait_for(lambda: get(port, "/readyz")[0] == 200)
        with Producer(bp.address) as p:
            p.send(Message("sub", b"hi"))
        samples, _ = scrape(port)
        assert end_offsets(samples, "sub") == 1
        bp.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


def test_silent_and_slow_clients_are_closed_after_the_idle_timeout(tmp_path: Path) -> None:
    """A connection that sends nothing, or a request's headers never finished (slowloris),
    holds a slot of http_max_connections only until http_idle_timeout_ms."""
    port = free_port()
    with Broker(tmp_path / "data", http_port=port, http_idle_timeout_ms=1000):
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)
        slow = socket.create_connection(("127.0.0.1", port), timeout=5)
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Half: ")
        t0 = time.monotonic()
        with silent, slow:
            assert silent.recv(100) == b""
            assert slow.recv(100) == b""
        assert time.monotonic() - t0 < 4
        assert get(port, "/healthz")[0] == 200
