"""Produce throughput without security, with authentication, with TLS, and with both.

Each configuration runs a fresh broker subprocess (``python -m ferrymq.broker``, uvloop, async
flush so the disk does not hide the difference) on a free port and the same client load: one
``AsyncProducer`` sending ``--messages`` messages of ``--size`` bytes in ``send_batch`` calls of
``--batch``, ``--inflight`` at a time. The connection and its handshake (HELLO, SCRAM, TLS) are
made before the clock starts: they cost once per connection, not per message. Reported per run:
msg/s, MB/s, and the broker's CPU seconds; results are appended as JSON lines to
``bench/results/security-<date>.jsonl``.

Usage::

    .venv/bin/python bench/security.py [--messages 300000] [--size 100] [--batch 500]
                                       [--inflight 8] [--repeat 3] [--flush async]

Also measured: the cost of one connection handshake with and without SCRAM / TLS (``--connects``
connections opened and closed in a row).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.security_helpers import make_certs, make_user, write_users  # noqa: E402

from ferrymq import AsyncAdminClient, AsyncProducer, Message  # noqa: E402
from ferrymq._launcher import BrokerProcess, free_port  # noqa: E402

USER = ("bench", "bench-secret-" + secrets.token_hex(4))


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_broker(work: Path, flush: str, auth: bool, tls: bool) -> BrokerProcess:
    extra: list[str] = []
    if auth:
        extra += ["--users-file", str(work / "users.toml")]
    if tls:
        extra += ["--tls-cert-file", str(work / "pki" / "server.pem"),
                  "--tls-key-file", str(work / "pki" / "server.key")]
    port = free_port()
    return BrokerProcess(work / f"data-{port}", port=port, flush=flush, extra=extra,
                         log_level="WARNING").start()


async def _produce(address: str, options: dict[str, Any], messages: int, size: int,
                   batch: int, inflight: int, topic: str) -> float:
    body = os.urandom(size)
    full = [Message(topic, body) for _ in range(batch)]
    async with AsyncProducer(address, client_id="bench-security", **options) as producer:
        await producer.send(Message(topic, body))  # connect, authenticate, metadata: untimed
        remaining = [messages // batch]

        async def worker() -> None:
            while remaining[0] > 0:
                remaining[0] -= 1
                await producer.send_batch(full)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(inflight)))
        return time.perf_counter() - t0


async def _connects(address: str, options: dict[str, Any], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        async with AsyncAdminClient(address, **options) as admin:
            await admin.hello()
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=300_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--connects", type=int, default=200)
    ap.add_argument("--flush", choices=["sync", "async"], default="async")
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    work = Path(tempfile.mkdtemp(prefix="ferrymq-bench-sec-"))
    certs = make_certs(work / "pki")
    write_users(work / "users.toml", make_user(*USER, admin=True))
    configs = {
        "plain": (False, False),
        "auth": (True, False),
        "tls": (False, True),
        "auth+tls": (True, True),
    }
    results: list[dict[str, Any]] = []
    stamp = time.strftime("%Y%m%d")
    out = ROOT / "bench" / "results" / f"security-{stamp}.jsonl"
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
            "cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "messages": args.messages, "size": args.size, "batch": args.batch,
            "inflight": args.inflight, "flush": args.flush}
    try:
        for rep in range(args.repeat):
            for name, (auth, tls) in configs.items():  # interleaved: drift hits all alike
                broker = _start_broker(work, args.flush, auth, tls)
                address = broker.address
                options: dict[str, Any] = {}
                if auth:
                    options["auth"] = USER
                if tls:
                    options["tls"] = str(certs.ca)
                try:
                    assert broker.pid is not None
                    cpu0 = _cpu_s(broker.pid)
                    secs = asyncio.run(_produce(address, options, args.messages, args.size,
                                                args.batch, args.inflight, f"t{rep}"))
                    cpu = _cpu_s(broker.pid) - cpu0
                    conn = asyncio.run(_connects(address, options, args.connects))
                finally:
                    broker.stop(30)
                n = args.messages // args.batch * args.batch
                row = {**meta, "config": name, "rep": rep, "seconds": secs,
                       "msg_per_s": n / secs, "mb_per_s": n * args.size / secs / 1e6,
                       "broker_cpu_s": cpu, "connect_ms": conn * 1000}
                results.append(row)
                print(f"{name:9s} rep {rep}: {row['msg_per_s']:10,.0f} msg/s "
                      f"{row['mb_per_s']:6.1f} MB/s  broker CPU {cpu:5.2f} s  "
                      f"connect {row['connect_ms']:.2f} ms", flush=True)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nmedians:")
    for name in configs:
        rows = [r for r in results if r["config"] == name]
        print(f"{name:9s} {statistics.median(r['msg_per_s'] for r in rows):10,.0f} msg/s  "
              f"connect {statistics.median(r['connect_ms'] for r in rows):.2f} ms")
    print(f"results appended to {out}")


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    match = re.search(r"model name\s*:\s*(.+)", text)
    return match.group(1) if match else platform.processor()


if __name__ == "__main__":
    main()
