"""``ferrymq bench``: produce, consume and end-to-end latency benchmarks.

Every subcommand either starts its own broker (a subprocess on a free port of 127.0.0.1 with a
temporary data directory, stopped and deleted afterwards: :class:`ferrymq.testing.BrokerProcess`,
the tests' launcher) or, with ``--server HOST:PORT``, uses a
running one. When the bench owns the broker (or ``--broker-pid`` names it) it also reports the
broker's CPU time (``/proc/<pid>/stat`` utime+stime, before and after the timed part) and its
resident memory (``/proc/<pid>/status`` VmRSS) at the end.

* ``produce``: one producer (this process, asyncio) calls ``send_batch`` with ``--inflight``
  batches of ``--batch`` messages in flight at once.
* ``consume``: produce ``--messages`` first (untimed), then time one pull consumer reading them
  all back from the start (``assign`` every queue, offsets from the earliest, no commits),
  touching ``msg.body`` of each message.
* ``push``: produce ``--messages`` first (untimed), then time one push consumer (this process,
  asyncio, a no-op ``async def`` handler returning SUCCESS) from its start until every message
  was handled *and* its ack answered (per-message acks, batched on the wire); then, for the
  ack-overhead figure, time a pull consumer reading the same messages (as ``consume`` does).
* ``delayed``: schedule N delayed messages (``deliver_at``), some or all due within a window
  after scheduling ends; a pull consumer reads the copies; lateness = receive time minus due
  time (p50/p99/max), the broker's RSS with N pending.
* ``e2e``: a producer sends single messages at ``--rate`` per second (``send_nowait`` on a timer,
  no linger) while a consumer in the same process long-polls; the latency of a message is its
  receive time minus the ``time.time_ns()`` the producer wrote into its first 8 body bytes (one
  clock, one process). ``--pacing sleep`` (the default) sleeps between sends (at least 1 ms, the
  event loop's timer resolution: 2 messages per wake-up at 2,000 msg/s); ``--pacing spin`` never
  sleeps, as the bench of sessions 1-7 did without meaning to: the process stays on its CPU,
  which shortens its reaction to answers but takes a core from the broker.

The functions :func:`run_produce`, :func:`run_consume`, :func:`run_push` and :func:`run_e2e`
return plain dicts so that ``bench/compare.py`` can drive the same workloads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table

from ferrymq._launcher import BrokerProcess
from ferrymq.client.admin import AsyncAdminClient
from ferrymq.client.consumer import AsyncPullConsumer
from ferrymq.client.message import Message
from ferrymq.client.producer import AsyncProducer
from ferrymq.client.push import AsyncPushConsumer, ConsumeResult

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_err = Console(stderr=True)


# -- broker process ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchedBroker:
    """The broker a bench runs against."""

    address: str
    pid: int | None
    """Its process id (None: unknown, an external broker without ``--broker-pid``)."""
    started_by: str
    """``module``: the bench started it (``python -m ferrymq.broker``); ``external``."""


def cpu_seconds(pid: int | None) -> float | None:
    """utime+stime of a process in seconds (None: unknown)."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    parts = stat[stat.rindex(")") + 2 :].split()
    return (int(parts[11]) + int(parts[12])) / _CLK_TCK  # fields 14 and 15 of stat(5)


def rss_mb(pid: int | None) -> float | None:
    """Resident set size of a process in MiB (VmRSS)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@contextlib.contextmanager
def broker_for(server: str | None, flush: str,
               broker_pid: int | None = None) -> Iterator[BenchedBroker]:
    """The broker to benchmark: ``server`` if given, else a fresh subprocess (stopped
    gracefully afterwards, its data deleted)."""
    if server:
        yield BenchedBroker(server, broker_pid, "external")
        return
    b = BrokerProcess(flush=flush, new_session=True).start()
    try:
        yield BenchedBroker(b.address, b.pid, "module")
    finally:
        b.stop()


# -- helpers -----------------------------------------------------------------------------------


def install_uvloop() -> None:
    """Use uvloop for the bench's own event loop when it is installed."""
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _progress(total: float, label: str, enabled: bool) -> Progress:
    return Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), TaskProgressColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f}"), TimeRemainingColumn(),
        console=_err, transient=True, disable=not enabled,
    )


TIMER_RESOLUTION_S = 0.001
"""libuv's timers count whole milliseconds: uvloop runs a shorter ``asyncio.sleep`` as a
zero-delay timer, so a rate loop sleeping ``1 / rate`` (0.5 ms at 2,000 msg/s) spins and burns a
whole core, which on a 2-core machine is taken from the broker under test."""


async def paced(rate: float, total: int, send_one: Callable[[int], Any], *,
                spin: bool = False) -> float:
    """Call ``send_one(i)`` for i in 0..total-1 at ``rate`` per second (a coroutine result is
    awaited); the seconds taken. The loop wakes when the next message is due, at most every
    :data:`TIMER_RESOLUTION_S`, and sends every message due by then (2 per wake-up at 2,000
    msg/s), so latency measurements do not compete with a spinning sender for the CPU.
    ``spin``: yield to the event loop between checks instead of sleeping (a busy loop)."""
    sent = 0
    t0 = time.perf_counter()
    while sent < total:
        due = min(total, int((time.perf_counter() - t0) * rate) + 1)
        while sent < due:
            r = send_one(sent)
            if asyncio.iscoroutine(r):
                await r
            sent += 1
        if spin:
            await asyncio.sleep(0)
            continue
        wait = sent / rate - (time.perf_counter() - t0)
        await asyncio.sleep(max(wait, TIMER_RESOLUTION_S))
    return time.perf_counter() - t0


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, math.ceil(p / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


async def _create_topic(address: str, queues: int, prefix: str = "bench") -> str:
    topic = f"{prefix}-{uuid.uuid4().hex[:8]}"
    async with AsyncAdminClient(address) as admin:
        await admin.create_topic(topic, queues)
    return topic


@dataclass
class _Cpu:
    pid: int | None
    start: float | None = None
    used: float | None = None
    samples: list[float] = field(default_factory=list)

    def begin(self) -> None:
        self.start = cpu_seconds(self.pid)

    def end(self) -> None:
        now = cpu_seconds(self.pid)
        if now is not None and self.start is not None:
            self.used = now - self.start


def _body(size: int) -> bytes:
    return (os.urandom(16) * (size // 16 + 1))[:size]


# -- produce -----------------------------------------------------------------------------------


async def _produce(address: str, topic: str, messages: int, size: int, batch: int,
                   inflight: int, label: str, show: bool) -> float:
    """Send ``messages`` in ``send_batch`` calls, ``inflight`` at a time; return seconds."""
    body = _body(size)
    full = [Message(topic, body) for _ in range(batch)]
    n_batches, rest = divmod(messages, batch)
    sizes = [batch] * n_batches + ([rest] if rest else [])
    async with AsyncProducer(address, client_id="ferrymq-bench") as producer:
        await producer.send(Message(topic, body))  # connection and metadata, untimed
        it = iter(sizes)
        with _progress(messages, label, show) as prog:
            task = prog.add_task(label, total=messages)

            async def worker() -> None:
                for n in it:
                    await producer.send_batch(full if n == batch else full[:n])
                    prog.advance(task, n)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(inflight)))
            elapsed = time.perf_counter() - t0
    return elapsed


def run_produce(address: str, *, messages: int = 1_000_000, size: int = 100, batch: int = 1000,
                queues: int = 4, inflight: int = 8, broker_pid: int | None = None,
                show_progress: bool = True) -> dict[str, Any]:
    """Time ``messages`` batched sends; results as a dict."""
    install_uvloop()

    async def main() -> dict[str, Any]:
        topic = await _create_topic(address, queues)
        cpu = _Cpu(broker_pid)
        cpu.begin()
        elapsed = await _produce(address, topic, messages, size, batch, inflight, "produce",
                                 show_progress)
        cpu.end()
        res = _throughput("produce", messages, size, elapsed, cpu, broker_pid,
                          batch=batch, queues=queues, inflight=inflight)
        res["topic"] = topic
        return res

    return asyncio.run(main())


def _throughput(workload: str, messages: int, size: int, elapsed: float, cpu: _Cpu,
                broker_pid: int | None, **params: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "workload": workload, "messages": messages, "size": size, **params,
        "seconds": elapsed, "msg_per_s": messages / elapsed,
        "mb_per_s": messages * size / elapsed / 1e6,
        "broker_cpu_s": cpu.used,
        "msgs_per_broker_cpu_s": (messages / cpu.used) if cpu.used else None,
        "broker_rss_mb": rss_mb(broker_pid),
    }
    return out


# -- consume -----------------------------------------------------------------------------------


def run_consume(address: str, *, messages: int = 1_000_000, size: int = 100, batch: int = 1000,
                queues: int = 4, inflight: int = 8, broker_pid: int | None = None,
                show_progress: bool = True, max_poll: int = 10_000) -> dict[str, Any]:
    """Produce ``messages`` (untimed), then time one consumer reading them all."""
    install_uvloop()

    async def main() -> dict[str, Any]:
        topic = await _create_topic(address, queues)
        await _produce(address, topic, messages, size, batch, inflight, "pre-produce",
                       show_progress)
        total = messages + 1  # the untimed warm-up message of _produce
        cpu = _Cpu(broker_pid)
        consumer = AsyncPullConsumer(address, group=f"bench-{uuid.uuid4().hex[:6]}",
                                     auto_commit=False, auto_offset_reset="earliest")
        async with consumer:
            await consumer.assign([(topic, q) for q in range(queues)])
            got = 0
            nbytes = 0
            with _progress(total, "consume", show_progress) as prog:
                task = prog.add_task("consume", total=total)
                cpu.begin()
                t0 = time.perf_counter()
                while got < total:
                    batch_msgs = await consumer.poll(timeout=10.0, max_messages=max_poll)
                    if not batch_msgs:
                        raise RuntimeError(f"consumer stalled at {got} of {total} messages")
                    for msg in batch_msgs:
                        nbytes += len(msg.body)
                    got += len(batch_msgs)
                    prog.advance(task, len(batch_msgs))
                elapsed = time.perf_counter() - t0
                cpu.end()
        res = _throughput("consume", got, size, elapsed, cpu, broker_pid, queues=queues)
        res["body_bytes"] = nbytes
        return res

    return asyncio.run(main())


# -- push --------------------------------------------------------------------------------------


async def _pull_all(address: str, topic: str, queues: int, total: int, label: str,
                    show: bool, max_poll: int = 10_000) -> float:
    """Read ``total`` messages of ``topic`` from the start with a pull consumer; seconds."""
    consumer = AsyncPullConsumer(address, group=f"bench-{uuid.uuid4().hex[:6]}",
                                 auto_commit=False, auto_offset_reset="earliest")
    async with consumer:
        await consumer.assign([(topic, q) for q in range(queues)])
        got = 0
        with _progress(total, label, show) as prog:
            task = prog.add_task(label, total=total)
            t0 = time.perf_counter()
            while got < total:
                msgs = await consumer.poll(timeout=10.0, max_messages=max_poll)
                if not msgs:
                    raise RuntimeError(f"pull consumer stalled at {got} of {total} messages")
                for msg in msgs:
                    _ = msg.body
                got += len(msgs)
                prog.advance(task, len(msgs))
            return time.perf_counter() - t0


def run_push(address: str, *, messages: int = 1_000_000, size: int = 100, batch: int = 1000,
             queues: int = 4, inflight: int = 8, broker_pid: int | None = None,
             show_progress: bool = True, concurrency: int = 16, prefetch: int = 2048,
             compare_pull: bool = True) -> dict[str, Any]:
    """Produce ``messages`` (untimed), then time a push consumer handling and acking them all
    (and, with ``compare_pull``, a pull consumer reading them)."""
    install_uvloop()

    async def main() -> dict[str, Any]:
        topic = await _create_topic(address, queues)
        await _produce(address, topic, messages, size, batch, inflight, "pre-produce",
                       show_progress)
        total = messages + 1  # the untimed warm-up message of _produce
        cpu = _Cpu(broker_pid)
        handled = 0
        nbytes = 0
        done = asyncio.Event()

        async def handler(msg: Any) -> ConsumeResult:
            nonlocal handled, nbytes
            nbytes += len(msg.body)
            handled += 1
            if handled >= total:
                done.set()
            return ConsumeResult.SUCCESS

        group = f"bench-push-{uuid.uuid4().hex[:6]}"
        consumer = AsyncPushConsumer(address, group, concurrency=concurrency,
                                     prefetch=prefetch, client_id="ferrymq-bench-push")
        consumer.subscribe(topic, "*", handler)
        with _progress(total, "push", show_progress) as prog:
            task = prog.add_task("push", total=total)
            cpu.begin()
            t0 = time.perf_counter()
            await consumer.start()
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.25)
                prog.update(task, completed=handled)
                if time.perf_counter() - t0 > 60 + total / 1000:
                    raise RuntimeError(f"push consumer stalled at {handled} of {total}")
            handled_s = time.perf_counter() - t0
            while consumer.stats["acked"] < total:
                await asyncio.sleep(0.001)
                if time.perf_counter() - t0 > 60 + total / 1000:
                    raise RuntimeError(f"acks stalled at {consumer.stats['acked']} of {total}")
            elapsed = time.perf_counter() - t0
            cpu.end()
        stats = dict(consumer.stats)
        await consumer.close()
        res = _throughput("push", total, size, elapsed, cpu, broker_pid, queues=queues,
                          concurrency=concurrency, prefetch=prefetch)
        res["handled_s"] = handled_s
        res["body_bytes"] = nbytes
        res["consumer_stats"] = stats
        if compare_pull:
            pull_s = await _pull_all(address, topic, queues, total, "pull", show_progress)
            res["pull_msg_per_s"] = total / pull_s
            res["push_vs_pull"] = pull_s / elapsed
        return res

    return asyncio.run(main())


# -- end to end --------------------------------------------------------------------------------


def run_e2e(address: str, *, rate: float = 2000.0, duration: float = 10.0, size: int = 100,
            queues: int = 4, warmup: float = 1.0, broker_pid: int | None = None,
            show_progress: bool = True, pacing: str = "sleep") -> dict[str, Any]:
    """Send at ``rate`` msg/s for ``duration`` s while consuming; latency percentiles."""
    install_uvloop()
    size = max(size, 8)

    async def main() -> dict[str, Any]:
        topic = await _create_topic(address, queues)
        pad = _body(size - 8)
        latencies_ns: list[int] = []
        split_ms: list[tuple[float, float]] = []  # (born -> stored, stored -> received)
        warm_until_ns = 0
        received = 0
        sent = 0
        errors: list[str] = []
        stop = asyncio.Event()
        consumer = AsyncPullConsumer(address, group=f"bench-{uuid.uuid4().hex[:6]}",
                                     auto_commit=False, auto_offset_reset="latest")
        producer = AsyncProducer(address, client_id="ferrymq-bench-e2e", linger_ms=0)
        async with consumer, producer:
            await consumer.assign([(topic, q) for q in range(queues)])
            await consumer.poll(timeout=0.2)  # resolve positions to the (empty) end
            await producer.send(Message(topic, time.time_ns().to_bytes(8, "big") + pad))

            async def consume() -> None:
                nonlocal received
                while not stop.is_set() or received < sent + 1:
                    msgs = await consumer.poll(timeout=0.2, max_messages=10_000)
                    now = time.time_ns()
                    for msg in msgs:
                        born = int.from_bytes(msg.body[:8], "big")
                        if born >= warm_until_ns:
                            latencies_ns.append(now - born)
                            split_ms.append((msg.stored_ms - born / 1e6, now / 1e6 - msg.stored_ms))
                    received += len(msgs)
                    if stop.is_set() and not msgs:
                        break

            def on_done(fut: asyncio.Future[Any]) -> None:
                if not fut.cancelled() and fut.exception() is not None and len(errors) < 10:
                    errors.append(repr(fut.exception()))

            ctask = asyncio.get_running_loop().create_task(consume())
            cpu = _Cpu(broker_pid)
            cpu.begin()
            warm_until_ns = time.time_ns() + int(warmup * 1e9)
            total = int(rate * duration)
            with _progress(total, "e2e", show_progress) as prog:
                task = prog.add_task("e2e", total=total)

                def send_one(i: int) -> None:
                    nonlocal sent
                    fut = producer.send_nowait(
                        Message(topic, time.time_ns().to_bytes(8, "big") + pad))
                    if fut is not None:
                        fut.add_done_callback(on_done)
                    sent += 1
                    if i % 200 == 0:
                        prog.update(task, completed=i)

                send_elapsed = await paced(rate, total, send_one, spin=pacing == "spin")
                await producer.flush()
            stop.set()
            try:
                await asyncio.wait_for(ctask, 10.0)
            except TimeoutError:
                ctask.cancel()
            cpu.end()
        lat_ms = sorted(x / 1e6 for x in latencies_ns)
        stored = sorted(x for x, _ in split_ms)
        received_ = sorted(y for _, y in split_ms)
        return {
            "workload": "e2e", "rate": rate, "duration": duration, "size": size,
            "pacing": pacing,
            "queues": queues, "sent": sent, "received": received - 1,
            "achieved_rate": sent / send_elapsed, "measured": len(lat_ms),
            "p50_ms": percentile(lat_ms, 50), "p90_ms": percentile(lat_ms, 90),
            "p99_ms": percentile(lat_ms, 99), "p999_ms": percentile(lat_ms, 99.9),
            "max_ms": lat_ms[-1] if lat_ms else float("nan"),
            "p50_born_to_stored_ms": percentile(stored, 50),
            "p99_born_to_stored_ms": percentile(stored, 99),
            "p50_stored_to_received_ms": percentile(received_, 50),
            "p99_stored_to_received_ms": percentile(received_, 99),
            "broker_cpu_s": cpu.used, "broker_rss_mb": rss_mb(broker_pid),
            "errors": errors,
        }

    return asyncio.run(main())


# -- delayed messages --------------------------------------------------------------------------


def run_delayed(address: str, *, messages: int = 10_000, measure: int | None = None,
                window: float = 10.0, lead: float = 2.0, far_hours: float = 10.0,
                size: int = 100, batch: int = 1000, queues: int = 4, inflight: int = 8,
                shuffle: bool = False, broker_pid: int | None = None,
                show_progress: bool = True) -> dict[str, Any]:
    """Schedule ``messages`` delayed messages, then time their delivery.

    ``measure`` of them (default: all) are due spread evenly over ``window`` seconds starting
    ``lead`` seconds after the last one was stored; the rest are due ``far_hours`` later (spread
    over an hour: pending on disk while the measured ones fire). Due times are absolute
    (``deliver_at``), assigned in send order (``shuffle``: in random order). A pull consumer
    reads the copies; the lateness of a message is its receive time (wall clock, this process)
    minus its due time (``%SCHEDULED_DUE``); the broker-side lateness is the copy's append time
    minus the due time.
    """
    install_uvloop()
    import datetime as _dt
    import random

    from ferrymq.protocol.schedule import SCHEDULED_DUE

    measure = messages if measure is None else min(measure, messages)

    async def main() -> dict[str, Any]:
        topic = await _create_topic(address, queues, prefix="bench-delayed")
        body = _body(size)
        rss_samples: list[float] = []
        stop_sampling = asyncio.Event()

        async def sample() -> None:
            while not stop_sampling.is_set():
                v = rss_mb(broker_pid)
                if v is not None:
                    rss_samples.append(v)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop_sampling.wait(), 0.5)

        sampler = asyncio.get_running_loop().create_task(sample())
        wall_vs_mono0 = time.time() - time.monotonic()  # a wall-clock step shows up as a change
        # produce: due times are fixed once the send phase's length is known (estimated, then
        # every due time is at least `lead` s after the last send: checked below)
        est_s = 5.0 + messages / 40_000
        t0_ms = time.time_ns() // 1_000_000
        first_due = t0_ms + int((est_s + lead) * 1000)
        step = window * 1000 / max(measure, 1)
        dues = [first_due + int(i * step) for i in range(measure)]
        far0 = first_due + int(far_hours * 3_600_000)
        far = messages - measure
        dues += [far0 + int(i * 3_600_000 / max(far, 1)) for i in range(far)]
        if shuffle:
            random.Random(7).shuffle(dues)
        utc = _dt.UTC
        cpu = _Cpu(broker_pid)
        cpu.begin()
        async with AsyncProducer(address, client_id="ferrymq-bench-delayed") as producer:
            it = iter(range(0, messages, batch))
            with _progress(messages, "schedule", show_progress) as prog:
                task = prog.add_task("schedule", total=messages)

                async def worker() -> None:
                    for start in it:
                        msgs = [Message(topic, body, deliver_at=_dt.datetime.fromtimestamp(
                            d / 1000, utc)) for d in dues[start : start + batch]]
                        await producer.send_batch(msgs)
                        prog.advance(task, len(msgs))

                t_send = time.perf_counter()
                await asyncio.gather(*(worker() for _ in range(inflight)))
                send_s = time.perf_counter() - t_send
        cpu.end()
        sent_ms = time.time_ns() // 1_000_000
        if sent_ms > first_due - 500:
            raise RuntimeError(f"scheduling took {send_s:.1f} s, longer than estimated "
                               f"({est_s:.1f} s): raise --lead")
        await asyncio.sleep(0.5)
        rss_pending = rss_mb(broker_pid)
        async with AsyncAdminClient(address) as admin:
            pending = (await admin.describe_topic(topic)).scheduled_pending
        lateness: list[float] = []
        broker_lateness: list[float] = []
        early = 0
        seen: set[str] = set()
        dup = 0
        consumer = AsyncPullConsumer(address, group=f"bench-{uuid.uuid4().hex[:6]}",
                                     auto_commit=False, auto_offset_reset="earliest")
        cpu_fire = _Cpu(broker_pid)
        async with consumer:
            await consumer.assign([(topic, q) for q in range(queues)])
            cpu_fire.begin()
            deadline = time.monotonic() + (first_due - sent_ms) / 1000 + window + 30
            with _progress(measure, "deliver", show_progress) as prog:
                task = prog.add_task("deliver", total=measure)
                while len(seen) < measure and time.monotonic() < deadline:
                    msgs = await consumer.poll(timeout=0.5, max_messages=10_000)
                    now = time.time_ns() / 1e6
                    for msg in msgs:
                        props = msg.properties
                        due = int(props[SCHEDULED_DUE])
                        mid = props["%SCHEDULED_ID"]
                        if mid in seen:
                            dup += 1
                            continue
                        seen.add(mid)
                        lateness.append(now - due)
                        broker_lateness.append(msg.stored_ms - due)
                        if now < due or msg.stored_ms < due:
                            early += 1
                    prog.advance(task, len(msgs))
            cpu_fire.end()
        stop_sampling.set()
        await sampler
        lat = sorted(lateness)
        blat = sorted(broker_lateness)
        wall_step_ms = (time.time() - time.monotonic() - wall_vs_mono0) * 1000
        return {
            "workload": "delayed", "messages": messages, "measured": measure,
            "window_s": window, "shuffle": shuffle, "size": size, "queues": queues,
            "schedule_s": send_s, "schedule_msg_per_s": messages / send_s,
            "pending_after_scheduling": pending,
            "delivered": len(seen), "lost": measure - len(seen), "duplicates": dup,
            "early": early, "wall_clock_step_ms": wall_step_ms,
            "min_ms": lat[0] if lat else float("nan"), "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99),
            "max_ms": lat[-1] if lat else float("nan"),
            "broker_min_ms": blat[0] if blat else float("nan"),
            "broker_p50_ms": percentile(blat, 50), "broker_p99_ms": percentile(blat, 99),
            "broker_max_ms": blat[-1] if blat else float("nan"),
            "broker_cpu_s_scheduling": cpu.used, "broker_cpu_s_delivering": cpu_fire.used,
            "broker_rss_mb_pending": rss_pending,
            "broker_rss_mb_max": max(rss_samples) if rss_samples else None,
        }

    return asyncio.run(main())


# -- output ------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(result))
        return
    table = Table(title=f"ferrymq bench {result['workload']}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in result.items():
        if k == "errors" and not v:
            continue
        table.add_row(k, _fmt(v))
    Console().print(table)


def _common(f: Any) -> Any:
    opts = [
        click.option("--server", default=None, metavar="HOST:PORT",
                     help="Use this broker (default: start one on a free port, stop it after)."),
        click.option("--flush", type=click.Choice(["sync", "async"]), default="async",
                     show_default=True, help="Flush mode of the broker the bench starts."),
        click.option("--broker-pid", type=int, default=None,
                     help="PID of the --server broker, for CPU and RSS figures."),
        click.option("--size", type=int, default=100, show_default=True,
                     help="Message body bytes."),
        click.option("--queues", type=int, default=4, show_default=True,
                     help="Queues of the bench topic."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _run_with_broker(server: str | None, flush: str, broker_pid: int | None,
                     fn: Any, **kwargs: Any) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    with broker_for(server, flush, broker_pid) as b:
        res: dict[str, Any] = fn(b.address, broker_pid=b.pid, **kwargs)
        res["flush"] = flush if server is None else "(external)"
        res["broker_rss_end_mb"] = rss_mb(b.pid)
        res["broker_started_by"] = b.started_by
        res["loadavg_1m_before"] = load_before
        res["loadavg_1m_after"] = os.getloadavg()[0]
        return res


@click.group()
def bench() -> None:
    """Measure produce, consume, push-consume and end-to-end latency against a broker."""


@bench.command()
@_common
@click.option("--messages", type=int, default=1_000_000, show_default=True)
@click.option("--batch", type=int, default=1000, show_default=True,
              help="Messages per send_batch call.")
@click.option("--inflight", type=int, default=8, show_default=True,
              help="Concurrent send_batch calls.")
def produce(server: str | None, flush: str, broker_pid: int | None, size: int, queues: int,
            as_json: bool, messages: int, batch: int, inflight: int) -> None:
    """Batched produce throughput (msg/s, MB/s, messages per broker CPU-second)."""
    res = _run_with_broker(server, flush, broker_pid, run_produce, messages=messages, size=size,
                           batch=batch, queues=queues, inflight=inflight,
                           show_progress=not as_json)
    _emit(res, as_json)


@bench.command()
@_common
@click.option("--messages", type=int, default=1_000_000, show_default=True)
@click.option("--batch", type=int, default=1000, show_default=True,
              help="Messages per send_batch call while pre-producing.")
@click.option("--inflight", type=int, default=8, show_default=True)
def consume(server: str | None, flush: str, broker_pid: int | None, size: int, queues: int,
            as_json: bool, messages: int, batch: int, inflight: int) -> None:
    """Consume throughput from disk: pre-produce, then read everything back."""
    res = _run_with_broker(server, flush, broker_pid, run_consume, messages=messages, size=size,
                           batch=batch, queues=queues, inflight=inflight,
                           show_progress=not as_json)
    _emit(res, as_json)


@bench.command()
@_common
@click.option("--messages", type=int, default=1_000_000, show_default=True)
@click.option("--batch", type=int, default=1000, show_default=True,
              help="Messages per send_batch call while pre-producing.")
@click.option("--inflight", type=int, default=8, show_default=True)
@click.option("--concurrency", type=int, default=16, show_default=True,
              help="Handlers running at once.")
@click.option("--prefetch", type=int, default=2048, show_default=True,
              help="Messages buffered ahead of the handlers.")
@click.option("--compare-pull/--no-compare-pull", default=True, show_default=True,
              help="Also time a pull consumer reading the same messages (ack overhead).")
def push(server: str | None, flush: str, broker_pid: int | None, size: int, queues: int,
         as_json: bool, messages: int, batch: int, inflight: int, concurrency: int,
         prefetch: int, compare_pull: bool) -> None:
    """Push consumer throughput: no-op handler, every message acked (acks batched on the wire)."""
    res = _run_with_broker(server, flush, broker_pid, run_push, messages=messages, size=size,
                           batch=batch, queues=queues, inflight=inflight,
                           concurrency=concurrency, prefetch=prefetch, compare_pull=compare_pull,
                           show_progress=not as_json)
    _emit(res, as_json)


@bench.command()
@_common
@click.option("--rate", type=float, default=2000.0, show_default=True, help="Messages per second.")
@click.option("--duration", type=float, default=10.0, show_default=True, help="Seconds of sending.")
@click.option("--warmup", type=float, default=1.0, show_default=True,
              help="Seconds at the start left out of the percentiles.")
@click.option("--pacing", type=click.Choice(["sleep", "spin"]), default="sleep",
              show_default=True,
              help="Between sends, sleep (>= 1 ms) or spin (a busy loop that keeps a CPU).")
def e2e(server: str | None, flush: str, broker_pid: int | None, size: int, queues: int,
        as_json: bool, rate: float, duration: float, warmup: float, pacing: str) -> None:
    """End-to-end latency at a fixed rate (p50/p90/p99/max)."""
    res = _run_with_broker(server, flush, broker_pid, run_e2e, rate=rate, duration=duration,
                           size=size, queues=queues, warmup=warmup, show_progress=not as_json,
                           pacing=pacing)
    _emit(res, as_json)


@bench.command()
@_common
@click.option("--messages", type=int, default=10_000, show_default=True,
              help="Scheduled messages pending at once.")
@click.option("--measure", type=int, default=None,
              help="How many of them come due in the window (default: all); the rest are due "
                   "--far-hours later and stay pending on disk.")
@click.option("--window", type=float, default=10.0, show_default=True,
              help="Seconds over which the measured messages come due.")
@click.option("--lead", type=float, default=2.0, show_default=True,
              help="Seconds between the end of scheduling and the first due time.")
@click.option("--far-hours", type=float, default=10.0, show_default=True)
@click.option("--shuffle", is_flag=True,
              help="Due times in random order (not in send order).")
@click.option("--batch", type=int, default=1000, show_default=True)
def delayed(server: str | None, flush: str, broker_pid: int | None, size: int, queues: int,
            as_json: bool, messages: int, measure: int | None, window: float, lead: float,
            far_hours: float, shuffle: bool, batch: int) -> None:
    """Delayed-message lateness (receive time - due time, p50/p99/max) with N pending, and the
    broker's RSS."""
    res = _run_with_broker(server, flush, broker_pid, run_delayed, messages=messages,
                           measure=measure, window=window, lead=lead, far_hours=far_hours,
                           size=size, queues=queues, batch=batch, shuffle=shuffle,
                           show_progress=not as_json)
    _emit(res, as_json)


if __name__ == "__main__":
    bench()
