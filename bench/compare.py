#!/usr/bin/env python
"""Run the same three workloads against FerryMQ and its peers; print one table.

Workloads (identical for every system, one client process = this script, asyncio):

* produce: ``--messages`` messages of ``--size`` bytes, sent in batches of ``--batch`` with
  ``--inflight`` batches in flight (for NATS, which has no batch publish: ``publish_async`` with
  the same number of unacknowledged messages in flight); timed until every message is
  acknowledged.
* consume: pre-produce ``--messages`` (untimed), then time one consumer reading all of them from
  the start, touching every body.
* e2e: ``--rate`` msg/s for ``--duration`` s, one message per send call, while a consumer in the
  same process receives; latency = receive time - ``time.time_ns()`` written in the body.

Systems: FerryMQ (sync and async flush), RabbitMQ streams (``rstream``), NATS JetStream
(``nats-py``), Redis Streams (``redis-py``). Each server is started by this script bound to
127.0.0.1 with its data in a temporary directory, and stopped after its runs. A system whose
server or Python client is missing is skipped with the reason. Each number is the median of
``--runs`` runs.

Usage: ``.venv/bin/python bench/compare.py --runs 3 [--only ferrymq-async,redis] [--json F]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferrymq._launcher import BrokerProcess, free_port
from ferrymq.admin import bench as fb

Result = dict[str, Any]


def wait_port(port: int, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2):
                return True
        except OSError:
            time.sleep(0.1)
    return False


def stop_proc(proc: subprocess.Popen[bytes] | None, timeout_s: float = 30.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_BENCH_PID = os.getpid()


def die_with_parent() -> None:
    """``preexec_fn`` of the peers' servers: the kernel SIGKILLs the child when this bench
    process dies, however it dies (SIGKILL and ``timeout`` included: the ``finally`` blocks
    that stop the servers do not run then, and the servers run in sessions of their own)."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != _BENCH_PID:  # the bench died before the prctl
        os._exit(1)


def body_for(size: int) -> bytes:
    return (os.urandom(16) * (size // 16 + 1))[:size]


def pct(values: list[float], p: float) -> float:
    return fb.percentile(sorted(values), p)


class Skip(Exception):
    """The system cannot run here (reason in the message)."""


class System:
    name = "?"
    durability = "?"
    pid: int | None = None

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def produce(self, n: int, size: int, batch: int, inflight: int) -> float:
        raise NotImplementedError

    def consume(self, n: int, size: int, batch: int, inflight: int) -> float:
        raise NotImplementedError

    def e2e(self, rate: float, duration: float, size: int) -> tuple[float, float]:
        raise NotImplementedError


async def _rate_loop(rate: float, duration: float, send: Callable[[bytes], Any],
                     pad: bytes) -> tuple[int, float]:
    """Call ``send(body)`` ``rate`` times a second for ``duration`` s; (sent, seconds). Paced
    as ``ferrymq bench e2e`` is (:func:`ferrymq.admin.bench.paced`: no spinning sender)."""
    total = int(rate * duration)
    seconds = await fb.paced(rate, total,
                             lambda _i: send(time.time_ns().to_bytes(8, "big") + pad))
    return total, seconds


def _latencies(samples: list[tuple[int, int]], warm_ns: int) -> tuple[float, float]:
    lat = [(recv - born) / 1e6 for born, recv in samples if born >= warm_ns]
    return pct(lat, 50), pct(lat, 99)


# -- FerryMQ -----------------------------------------------------------------------------------


class FerryMQ(System):
    def __init__(self, flush: str, queues: int) -> None:
        self.flush = flush
        self.queues = queues
        self.name = f"FerryMQ ({flush} flush)"
        self.durability = (
            "ack after fsync (group commit)" if flush == "sync"
            else "ack after write(2); fsync every 200 ms"
        )
        self.broker: BrokerProcess | None = None

    def start(self) -> None:
        self.broker = BrokerProcess(flush=self.flush, new_session=True).start()
        self.pid = self.broker.pid

    def stop(self) -> None:
        if self.broker is not None:
            self.broker.stop()

    @property
    def address(self) -> str:
        assert self.broker is not None
        return self.broker.address

    def produce(self, n: int, size: int, batch: int, inflight: int) -> float:
        r = fb.run_produce(self.address, messages=n, size=size, batch=batch, queues=self.queues,
                           inflight=inflight, show_progress=False)
        return float(r["msg_per_s"])

    def consume(self, n: int, size: int, batch: int, inflight: int) -> float:
        r = fb.run_consume(self.address, messages=n, size=size, batch=batch, queues=self.queues,
                           inflight=inflight, show_progress=False)
        return float(r["msg_per_s"])

    def e2e(self, rate: float, duration: float, size: int) -> tuple[float, float]:
        r = fb.run_e2e(self.address, rate=rate, duration=duration, size=size,
                       queues=self.queues, show_progress=False)
        return float(r["p50_ms"]), float(r["p99_ms"])


# -- Redis Streams -----------------------------------------------------------------------------


class RedisStreams(System):
    name = "Redis Streams (redis-py)"
    durability = "AOF, appendfsync everysec: ack after write(2), fsync once a second"

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir: str | None = None
        self.port = 0

    def start(self) -> None:
        try:
            import redis  # noqa: F401
        except ImportError as exc:
            raise Skip(f"redis-py not installed: {exc}") from None
        exe = shutil.which("redis-server")
        if exe is None:
            raise Skip("redis-server not found (apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix="bench-redis-")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [exe, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", self.dir,
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
             "--daemonize", "no", "--logfile", os.path.join(self.dir, "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        if not wait_port(self.port, self.proc, 15):
            raise Skip("redis-server did not start")
        self.pid = self.proc.pid

    def stop(self) -> None:
        stop_proc(self.proc)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _client(self) -> Any:
        import redis.asyncio as aioredis

        pool = aioredis.BlockingConnectionPool(host="127.0.0.1", port=self.port,
                                               max_connections=64, timeout=60)
        return aioredis.Redis(connection_pool=pool)

    async def _produce(self, r: Any, stream: str, n: int, size: int, batch: int,
                       inflight: int) -> float:
        body = body_for(size)
        sizes = [batch] * (n // batch) + ([n % batch] if n % batch else [])
        it = iter(sizes)

        async def worker() -> None:
            for k in it:
                pipe = r.pipeline(transaction=False)
                for _ in range(k):
                    pipe.xadd(stream, {"d": body})
                await pipe.execute()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(inflight)))
        return time.perf_counter() - t0

    def produce(self, n: int, size: int, batch: int, inflight: int) -> float:
        async def main() -> float:
            r = self._client()
            try:
                return n / await self._produce(r, f"p-{uuid.uuid4().hex[:6]}", n, size, batch,
                                               inflight)
            finally:
                await r.aclose()

        return asyncio.run(main())

    def consume(self, n: int, size: int, batch: int, inflight: int) -> float:
        async def main() -> float:
            r = self._client()
            stream = f"c-{uuid.uuid4().hex[:6]}"
            try:
                await self._produce(r, stream, n, size, batch, inflight)
                got = 0
                last = b"0-0"
                t0 = time.perf_counter()
                while got < n:
                    resp = await r.xread({stream: last}, count=10_000)
                    entries = resp[0][1]
                    for eid, fields in entries:
                        len(fields[b"d"])
                        last = eid
                    got += len(entries)
                return got / (time.perf_counter() - t0)
            finally:
                await r.aclose()

        return asyncio.run(main())

    def e2e(self, rate: float, duration: float, size: int) -> tuple[float, float]:
        async def main() -> tuple[float, float]:
            prod, cons = self._client(), self._client()
            stream = f"e-{uuid.uuid4().hex[:6]}"
            samples: list[tuple[int, int]] = []
            done = asyncio.Event()
            await prod.xadd(stream, {"d": b"\0" * 8})

            async def consumer() -> None:
                last = b"$"
                while not done.is_set():
                    resp = await cons.xread({stream: last}, block=200, count=10_000)
                    now = time.time_ns()
                    for _, entries in resp or []:
                        for eid, fields in entries:
                            samples.append((int.from_bytes(fields[b"d"][:8], "big"), now))
                            last = eid

            ctask = asyncio.create_task(consumer())
            await asyncio.sleep(0.3)
            warm = time.time_ns() + 1_000_000_000
            pending: set[asyncio.Task[Any]] = set()

            def send(body: bytes) -> None:
                t = asyncio.ensure_future(prod.xadd(stream, {"d": body}))
                pending.add(t)
                t.add_done_callback(pending.discard)

            await _rate_loop(rate, duration, send, body_for(max(size - 8, 0)))
            await asyncio.gather(*pending)
            await asyncio.sleep(0.5)
            done.set()
            await ctask
            await prod.aclose()
            await cons.aclose()
            return _latencies(samples, warm)

        return asyncio.run(main())


# -- NATS JetStream ----------------------------------------------------------------------------


class NatsJetStream(System):
    name = "NATS JetStream (nats-py)"
    durability = ("file store; ack after write to the store (page cache); fsync on the "
                  "store's sync interval (2 min default)")

    replicas = 1

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir: str | None = None
        self.port = 0

    def start(self) -> None:
        try:
            import nats  # noqa: F401
        except ImportError as exc:
            raise Skip(f"nats-py not installed: {exc}") from None
        exe = shutil.which("nats-server")
        if exe is None:
            raise Skip("nats-server not found (apt-get install nats-server)")
        self.dir = tempfile.mkdtemp(prefix="bench-nats-")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [exe, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", self.dir],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, "nats.log"), "wb"),  # noqa: SIM115
            start_new_session=True, preexec_fn=die_with_parent)
        if not wait_port(self.port, self.proc, 15):
            raise Skip("nats-server did not start")
        self.pid = self.proc.pid

    def stop(self) -> None:
        stop_proc(self.proc)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    async def _connect(self) -> tuple[Any, Any]:
        import nats

        nc = await nats.connect(f"nats://127.0.0.1:{self.port}")
        return nc, nc.jetstream(publish_async_max_pending=100_000)

    async def _stream(self, js: Any) -> str:
        name = f"S{uuid.uuid4().hex[:8]}"
        await js.add_stream(name=name, subjects=[f"{name}.x"], num_replicas=self.replicas)
        return name

    async def _produce(self, js: Any, subject: str, n: int, size: int, window: int) -> float:
        body = body_for(size)
        sem = asyncio.Semaphore(window)

        def release(_: Any) -> None:
            sem.release()

        futs = []
        t0 = time.perf_counter()
        for _ in range(n):
            await sem.acquire()
            f = await js.publish_async(subject, body)
            f.add_done_callback(release)
            futs.append(f)
        await asyncio.gather(*futs)
        return time.perf_counter() - t0

    def produce(self, n: int, size: int, batch: int, inflight: int) -> float:
        async def main() -> float:
            nc, js = await self._connect()
            try:
                s = await self._stream(js)
                return n / await self._produce(js, f"{s}.x", n, size, batch * inflight)
            finally:
                await nc.close()

        return asyncio.run(main())

    def consume(self, n: int, size: int, batch: int, inflight: int) -> float:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        async def main() -> float:
            nc, js = await self._connect()
            try:
                s = await self._stream(js)
                await self._produce(js, f"{s}.x", n, size, batch * inflight)
                sub = await js.pull_subscribe(
                    f"{s}.x", durable=None, stream=s,
                    config=ConsumerConfig(ack_policy=AckPolicy.NONE,
                                          deliver_policy=DeliverPolicy.ALL))
                got = 0
                t0 = time.perf_counter()
                while got < n:
                    msgs = await sub.fetch(batch=min(10_000, n - got), timeout=10)
                    for msg in msgs:
                        len(msg.data)
                    got += len(msgs)
                return got / (time.perf_counter() - t0)
            finally:
                await nc.close()

        return asyncio.run(main())

    def e2e(self, rate: float, duration: float, size: int) -> tuple[float, float]:
        from nats.js.api import DeliverPolicy

        async def main() -> tuple[float, float]:
            nc, js = await self._connect()
            samples: list[tuple[int, int]] = []
            try:
                s = await self._stream(js)

                async def cb(msg: Any) -> None:
                    samples.append((int.from_bytes(msg.data[:8], "big"), time.time_ns()))

                await js.subscribe(f"{s}.x", cb=cb, ordered_consumer=True,
                                   deliver_policy=DeliverPolicy.NEW)
                await asyncio.sleep(0.3)
                warm = time.time_ns() + 1_000_000_000
                futs: list[Any] = []

                async def send(body: bytes) -> None:
                    futs.append(await js.publish_async(f"{s}.x", body))

                await _rate_loop(rate, duration, send, body_for(max(size - 8, 0)))
                await asyncio.gather(*futs)
                await asyncio.sleep(0.5)
                return _latencies(samples, warm)
            finally:
                await nc.close()

        return asyncio.run(main())


class NatsJetStreamCluster(NatsJetStream):
    """Three nats-server processes on loopback with cluster routes and JetStream, streams of
    ``replicas`` (R3: a publish is acknowledged once a quorum of the stream's Raft group
    stored it). The client connects to every server and publishes wherever it is connected; the
    stream leader may be another server."""

    durability = ("file store, R3 (ack after a Raft quorum stored it, page cache); fsync on "
                  "the store's sync interval (2 min; nats-server 2.9 has no setting for it: "
                  "`sync_interval` and its `always` came with 2.10)")

    def __init__(self, replicas: int = 3, servers: int = 3) -> None:
        super().__init__()
        self.replicas = replicas
        self.servers = servers
        self.name = f"NATS JetStream R{replicas} ({servers} servers)"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ports: list[int] = []
        self.pids: list[int] = []

    def start(self) -> None:
        try:
            import nats  # noqa: F401
        except ImportError as exc:
            raise Skip(f"nats-py not installed: {exc}") from None
        exe = shutil.which("nats-server")
        if exe is None:
            raise Skip("nats-server not found (apt-get install nats-server)")
        self.dir = tempfile.mkdtemp(prefix="bench-nats-cluster-")
        self.ports = [free_port() for _ in range(self.servers)]
        routes = [free_port() for _ in range(self.servers)]
        for i in range(self.servers):
            d = os.path.join(self.dir, f"n{i}")
            os.makedirs(d)
            others = ",".join(f"nats://127.0.0.1:{p}" for j, p in enumerate(routes) if j != i)
            self.procs.append(subprocess.Popen(
                [exe, "-a", "127.0.0.1", "-p", str(self.ports[i]), "-js", "-sd", d,
                 "--server_name", f"n{i}", "--cluster_name", "bench",
                 "--cluster", f"nats://127.0.0.1:{routes[i]}", "--routes", others],
                stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(d, "nats.log"), "wb"),  # noqa: SIM115
                start_new_session=True, preexec_fn=die_with_parent))
        for port, proc in zip(self.ports, self.procs, strict=True):
            if not wait_port(port, proc, 15):
                self.stop()
                raise Skip("nats-server did not start")
        self.pids = [p.pid for p in self.procs]
        self.pid = self.pids[0]
        self.port = self.ports[0]
        asyncio.run(self._wait_meta_leader())

    async def _wait_meta_leader(self, timeout_s: float = 30.0) -> None:
        """JetStream in a cluster answers once its meta group has a leader: try a stream."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                nc, js = await self._connect()
                try:
                    name = await self._stream(js)
                    await js.delete_stream(name)
                    return
                finally:
                    await nc.close()
            except Exception as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    raise Skip(f"JetStream cluster did not form: {exc!r}") from None
                await asyncio.sleep(0.5)

    async def _connect(self) -> tuple[Any, Any]:
        import nats

        nc = await nats.connect([f"nats://127.0.0.1:{p}" for p in self.ports])
        return nc, nc.jetstream(publish_async_max_pending=100_000)

    def cpu_seconds(self) -> float:
        """CPU seconds of every server so far."""
        return sum(fb.cpu_seconds(pid) or 0.0 for pid in self.pids)

    def stop(self) -> None:
        for proc in self.procs:
            stop_proc(proc)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


# -- RabbitMQ streams --------------------------------------------------------------------------


class RabbitStreams(System):
    name = "RabbitMQ streams (rstream)"
    durability = ("stream segment files: confirm after the chunk is written (page cache); "
                  "streams never fsync explicitly (they rely on replication; 1 node here)")

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir: str | None = None
        self.port = 0
        self.env: dict[str, str] = {}
        self.epmd_was_running = False

    def start(self) -> None:
        try:
            import rstream  # noqa: F401
        except ImportError as exc:
            raise Skip(f"rstream not installed: {exc}") from None
        exe = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
        if not exe.exists():
            raise Skip("rabbitmq-server not found (apt-get install rabbitmq-server)")
        self.epmd_was_running = subprocess.run(
            ["pgrep", "-x", "epmd"], capture_output=True).returncode == 0
        d = tempfile.mkdtemp(prefix="bench-rabbit-")
        self.dir = d
        self.port = free_port()
        amqp, dist = free_port(), free_port()
        Path(d, "enabled_plugins").write_text("[rabbitmq_stream].\n")
        Path(d, "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{amqp}\n"
            f"stream.listeners.tcp.1 = 127.0.0.1:{self.port}\n"
            f"stream.advertised_host = 127.0.0.1\n"
            f"stream.advertised_port = {self.port}\n"
        )
        self.env = {
            **os.environ, "HOME": d, "RABBITMQ_NODENAME": f"bench{os.getpid()}@localhost",
            "RABBITMQ_MNESIA_BASE": f"{d}/mnesia", "RABBITMQ_LOG_BASE": f"{d}/log",
            "RABBITMQ_ENABLED_PLUGINS_FILE": f"{d}/enabled_plugins",
            "RABBITMQ_CONFIG_FILE": f"{d}/rabbitmq", "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(amqp), "RABBITMQ_DIST_PORT": str(dist),
            "ERL_EPMD_ADDRESS": "127.0.0.1", "RABBITMQ_PID_FILE": f"{d}/rabbit.pid",
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }
        self.proc = subprocess.Popen(
            [str(exe)], env=self.env, cwd=d, stdout=open(f"{d}/stdout.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT, start_new_session=True)
        if not wait_port(self.port, self.proc, 90):
            tail = Path(f"{d}/stdout.log").read_text(errors="replace")[-800:]
            self.stop()
            raise Skip(f"rabbitmq did not open its stream port: {tail}")
        pidf = Path(f"{d}/rabbit.pid")
        with contextlib.suppress(OSError, ValueError):
            self.pid = int(pidf.read_text().strip())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            subprocess.run(["/usr/lib/rabbitmq/bin/rabbitmqctl", "stop"], env=self.env,
                           capture_output=True, timeout=60, check=False)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self.epmd_was_running:
            subprocess.run(["epmd", "-kill"], capture_output=True, check=False,
                           env={**os.environ, "ERL_EPMD_ADDRESS": "127.0.0.1"})
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _producer(self) -> Any:
        from rstream import Producer

        return Producer("127.0.0.1", self.port, username="guest", password="guest")

    def _consumer(self) -> Any:
        from rstream import Consumer

        return Consumer("127.0.0.1", self.port, username="guest", password="guest")

    async def _produce(self, p: Any, stream: str, n: int, size: int, batch: int,
                       inflight: int) -> float:
        body = body_for(size)
        confirmed = 0
        all_done = asyncio.Event()
        errors: list[str] = []

        def on_confirm(status: Any) -> None:
            nonlocal confirmed
            if not status.is_confirmed and len(errors) < 5:
                errors.append(str(status))
            confirmed += 1
            if confirmed >= n:
                all_done.set()

        sizes = [batch] * (n // batch) + ([n % batch] if n % batch else [])
        msgs = [body] * batch
        # in-flight window: at most inflight*batch unconfirmed messages
        sent = 0
        t0 = time.perf_counter()
        for k in sizes:
            while sent - confirmed > inflight * batch:
                await asyncio.sleep(0.0005)
            await p.send_batch(stream, msgs[:k], on_publish_confirm=on_confirm)
            sent += k
        await asyncio.wait_for(all_done.wait(), 120)
        if errors:
            raise RuntimeError(f"rstream publish errors: {errors}")
        return time.perf_counter() - t0

    def produce(self, n: int, size: int, batch: int, inflight: int) -> float:
        async def main() -> float:
            async with self._producer() as p:
                s = f"p-{uuid.uuid4().hex[:6]}"
                await p.create_stream(s)
                return n / await self._produce(p, s, n, size, batch, inflight)

        return asyncio.run(main())

    def consume(self, n: int, size: int, batch: int, inflight: int) -> float:
        from rstream import ConsumerOffsetSpecification, OffsetType

        async def main() -> float:
            s = f"c-{uuid.uuid4().hex[:6]}"
            async with self._producer() as p:
                await p.create_stream(s)
                await self._produce(p, s, n, size, batch, inflight)
            got = 0
            done = asyncio.Event()

            async def cb(msg: Any, ctx: Any) -> None:
                nonlocal got
                len(msg)
                got += 1
                if got >= n:
                    done.set()

            async with self._consumer() as c:
                t0 = time.perf_counter()
                await c.subscribe(s, cb, offset_specification=ConsumerOffsetSpecification(
                    OffsetType.FIRST, None))
                runner = asyncio.create_task(c.run())
                await asyncio.wait_for(done.wait(), 300)
                elapsed = time.perf_counter() - t0
                runner.cancel()
            return got / elapsed

        return asyncio.run(main())

    def e2e(self, rate: float, duration: float, size: int) -> tuple[float, float]:
        from rstream import ConsumerOffsetSpecification, OffsetType

        async def main() -> tuple[float, float]:
            s = f"e-{uuid.uuid4().hex[:6]}"
            samples: list[tuple[int, int]] = []

            async def cb(msg: Any, ctx: Any) -> None:
                samples.append((int.from_bytes(bytes(msg)[:8], "big"), time.time_ns()))

            async with self._producer() as p, self._consumer() as c:
                await p.create_stream(s)
                await c.subscribe(s, cb, offset_specification=ConsumerOffsetSpecification(
                    OffsetType.NEXT, None))
                runner = asyncio.create_task(c.run())
                await asyncio.sleep(0.3)
                warm = time.time_ns() + 1_000_000_000

                async def send(body: bytes) -> None:
                    await p.send_batch(s, [body])

                await _rate_loop(rate, duration, send, body_for(max(size - 8, 0)))
                await asyncio.sleep(0.5)
                runner.cancel()
            return _latencies(samples, warm)

        return asyncio.run(main())


# -- driver ------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def run_system(sysm: System, args: argparse.Namespace) -> Result:
    out: Result = {"system": sysm.name, "durability": sysm.durability}
    try:
        sysm.start()
    except Skip as exc:
        out["skipped"] = str(exc)
        print(f"SKIP {sysm.name}: {exc}", file=sys.stderr)
        return out
    try:
        prod: list[float] = []
        cons: list[float] = []
        p50: list[float] = []
        p99: list[float] = []
        cpu0 = fb.cpu_seconds(sysm.pid)
        for i in range(args.runs):
            steps: list[tuple[str, Callable[[], Any]]] = [
                ("produce", lambda: prod.append(sysm.produce(args.messages, args.size,
                                                             args.batch, args.inflight))),
                ("consume", lambda: cons.append(sysm.consume(args.messages, args.size,
                                                             args.batch, args.inflight))),
                ("e2e", lambda: _e2e(sysm, args, p50, p99)),
            ]
            for label, step in steps:
                if label not in args.workloads:
                    continue
                t = time.perf_counter()
                try:
                    step()
                except Exception as exc:
                    out.setdefault("errors", []).append(f"run {i + 1} {label}: {exc!r}")
                    print(f"  {sysm.name} {label} failed: {exc!r}", file=sys.stderr)
                    continue
                print(f"  {sysm.name} run {i + 1} {label} done in "
                      f"{time.perf_counter() - t:.1f}s: prod={prod[-1:]} cons={cons[-1:]} "
                      f"p50={p50[-1:]} p99={p99[-1:]}", file=sys.stderr)
        cpu1 = fb.cpu_seconds(sysm.pid)
        out.update(produce_runs=prod, consume_runs=cons, p50_runs=p50, p99_runs=p99,
                   produce=_median(prod), consume=_median(cons), p50_ms=_median(p50),
                   p99_ms=_median(p99), server_rss_mb=fb.rss_mb(sysm.pid),
                   server_cpu_s=None if cpu0 is None or cpu1 is None else cpu1 - cpu0)
    finally:
        sysm.stop()
    return out


def _e2e(sysm: System, args: argparse.Namespace, p50: list[float], p99: list[float]) -> None:
    a, b = sysm.e2e(args.rate, args.duration, args.size)
    p50.append(a)
    p99.append(b)


def _fmt(v: Any, digits: int = 0) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return f"{v:,.{digits}f}"


def render(results: list[Result], args: argparse.Namespace) -> str:
    lines = [
        f"{args.size}-byte messages; produce/consume: {args.messages:,} messages, batch "
        f"{args.batch}, {args.inflight} in flight; e2e: {args.rate:,.0f} msg/s for "
        f"{args.duration:g} s; median of {args.runs} run(s)",
        "",
        "| system | produce msg/s | consume msg/s | e2e p50 ms | e2e p99 ms | durability |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['system']} | skipped | | | | {r['skipped']} |")
            continue
        lines.append(
            f"| {r['system']} | {_fmt(r['produce'])} | {_fmt(r['consume'])} | "
            f"{_fmt(r['p50_ms'], 2)} | {_fmt(r['p99_ms'], 2)} | {r['durability']} |")
    return "\n".join(lines)


SYSTEMS: dict[str, Callable[[argparse.Namespace], System]] = {
    "ferrymq-sync": lambda a: FerryMQ("sync", a.queues),
    "ferrymq-async": lambda a: FerryMQ("async", a.queues),
    "rabbitmq": lambda a: RabbitStreams(),
    "nats": lambda a: NatsJetStream(),
    "nats-r3": lambda a: NatsJetStreamCluster(),
    "redis": lambda a: RedisStreams(),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--messages", type=int, default=500_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--queues", type=int, default=4)
    ap.add_argument("--rate", type=float, default=2000.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--only", default=",".join(SYSTEMS), help="comma-separated: " +
                    ", ".join(SYSTEMS))
    ap.add_argument("--workloads", default="produce,consume,e2e")
    ap.add_argument("--json", default=None, help="also write the raw results to this file")
    args = ap.parse_args(argv)
    args.workloads = set(args.workloads.split(","))
    fb.install_uvloop()
    print(f"# {platform.node()} {os.cpu_count()} cpus, Python {platform.python_version()}, "
          f"load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    results = []
    for key in args.only.split(","):
        sysm = SYSTEMS[key.strip()](args)
        print(f"== {sysm.name}", file=sys.stderr)
        results.append(run_system(sysm, args))
    table = render(results, args)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: (sorted(v) if isinstance(v, set)
                                                            else v)
                                                        for k, v in vars(args).items()},
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

