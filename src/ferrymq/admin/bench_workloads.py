"""The ``ferrymq bench`` workloads: produce, consume, push, end-to-end latency, delayed
messages.

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

Each ``run_*`` function runs one workload against the broker at an address and returns its
figures as a plain dict (so that ``bench/compare.py`` and ``bench/*.py`` can drive the same
workloads); :mod:`ferrymq.admin.bench` prints them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

from ferrymq.admin.bench_measure import CpuTime, install_uvloop, paced, percentile, rss_mb
from ferrymq.client.admin import AsyncAdminClient
from ferrymq.client.consumer import AsyncPullConsumer
from ferrymq.client.message import Message
from ferrymq.client.producer import AsyncProducer
from ferrymq.client.push import AsyncPushConsumer, ConsumeResult

_err = Console(stderr=True)


def _progress(total: float, label: str, enabled: bool) -> Progress:
    return Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), TaskProgressColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f}"), TimeRemainingColumn(),
        console=_err, transient=True, disable=not enabled,
    )


@dataclass(frozen=True)
class Replication:
    """How a bench topic is replicated and what its producers wait for (on a cluster)."""

    replicas: int | None = None
    """Copies of each queue (None: the brokers' ``default_replicas``)."""
    min_insync: int | None = None
    """In-sync replicas an ``acks="all"`` send needs (None: the brokers' default)."""
    acks: str = "all"
    """The producers' ``acks``: ``"all"`` or ``"leader"``."""


DEFAULT_REPLICATION = Replication()
"""The brokers' defaults and ``acks="all"`` (on a single broker: one copy)."""


async def _create_topic(address: str, queues: int, prefix: str = "bench",
                        replication: Replication = DEFAULT_REPLICATION) -> str:
    topic = f"{prefix}-{uuid.uuid4().hex[:8]}"
    async with AsyncAdminClient(address) as admin:
        await admin.create_topic(topic, queues, replicas=replication.replicas,
                                 min_insync=replication.min_insync)
        brokers = (await admin.cluster_describe()).brokers
    if len(brokers) > 1:
        await _wait_known(topic, queues, [b.address for b in brokers if b.alive])
    return topic


TOPIC_PROPAGATION_TIMEOUT_S = 30.0
"""How long a cluster bench waits for every broker to learn a topic it created."""


async def _wait_known(topic: str, queues: int, addresses: list[str]) -> None:
    """Wait until every broker at ``addresses`` knows ``topic`` with a leader for each queue.
    A create is answered once the metadata store holds the topic; the other brokers learn it
    by their watch a moment later, and a send reaching one of them first would be refused."""
    deadline = time.monotonic() + TOPIC_PROPAGATION_TIMEOUT_S
    for address in addresses:
        async with AsyncAdminClient(address) as admin:
            while True:
                desc = await admin.cluster_describe()
                led = [q for q in desc.queues if q.topic == topic and not q.offline]
                if len(led) == queues:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"broker {address} did not learn topic {topic!r} within "
                                       f"{TOPIC_PROPAGATION_TIMEOUT_S:.0f} s")
                await asyncio.sleep(0.02)


def _body(size: int) -> bytes:
    return (os.urandom(16) * (size // 16 + 1))[:size]


# -- produce -----------------------------------------------------------------------------------


WARM_SENDS_PER_QUEUE = 64
"""Most untimed sends per queue :func:`_warm_queues` makes to reach every queue."""


async def _warm_queues(producer: AsyncProducer, topic: str, body: bytes, queues: int) -> None:
    """One acknowledged send into every queue of ``topic``, untimed: the connections, the
    leaders' metadata and, on a fresh replicated topic, the followers' first copy (truncation
    by epoch, then a fetch) happen before the clock starts. Timing a short run from a cold
    topic measured that start-up as much as the throughput (issue 20's RF3/RF1 ratio moved
    from 24 % to 50 % between two runs of 200,000 messages)."""
    seen: set[int] = set()
    for i in range(WARM_SENDS_PER_QUEUE * queues):
        if len(seen) >= queues:
            return
        seen.add((await producer.send(Message(topic, body, sharding_key=f"warm-{i}"))).queue)


async def _produce(address: str, topic: str, messages: int, size: int, batch: int,
                   inflight: int, label: str, show: bool, acks: str = "all",
                   queues: int = 1) -> float:
    """Send ``messages`` in ``send_batch`` calls, ``inflight`` at a time; return seconds. First,
    untimed, one send into each of ``queues`` queues (:func:`_warm_queues`; with 1, exactly one
    message, which :func:`_filled_topic` counts)."""
    body = _body(size)
    full = [Message(topic, body) for _ in range(batch)]
    n_batches, rest = divmod(messages, batch)
    sizes = [batch] * n_batches + ([rest] if rest else [])
    async with AsyncProducer(address, client_id="ferrymq-bench", acks=acks) as producer:
        await _warm_queues(producer, topic, body, queues)  # untimed
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
                show_progress: bool = True,
                replication: Replication = DEFAULT_REPLICATION) -> dict[str, Any]:
    """Time ``messages`` batched sends; results as a dict."""
    install_uvloop()

    async def main() -> dict[str, Any]:
        topic = await _create_topic(address, queues, replication=replication)
        cpu = CpuTime(broker_pid)
        cpu.begin()
        elapsed = await _produce(address, topic, messages, size, batch, inflight, "produce",
                                 show_progress, replication.acks, queues=queues)
        cpu.end()
        res = _throughput("produce", messages, size, elapsed, cpu, broker_pid,
                          batch=batch, queues=queues, inflight=inflight)
        res["topic"] = topic
        return res

    return asyncio.run(main())


def _throughput(workload: str, messages: int, size: int, elapsed: float, cpu: CpuTime,
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


async def _filled_topic(address: str, queues: int, messages: int, size: int, batch: int,
                        inflight: int, show: bool,
                        replication: Replication = DEFAULT_REPLICATION) -> tuple[str, int]:
    """A new topic holding ``messages`` (produced untimed); its name and how many messages it
    holds (one more: :func:`_produce`'s warm-up message)."""
    topic = await _create_topic(address, queues, replication=replication)
    await _produce(address, topic, messages, size, batch, inflight, "pre-produce", show,
                   replication.acks)
    return topic, messages + 1


def run_consume(address: str, *, messages: int = 1_000_000, size: int = 100, batch: int = 1000,
                queues: int = 4, inflight: int = 8, broker_pid: int | None = None,
                show_progress: bool = True, max_poll: int = 10_000,
                replication: Replication = DEFAULT_REPLICATION,
                topic: str | None = None) -> dict[str, Any]:
    """Produce ``messages`` (untimed), then time one consumer reading them all. ``topic``: read
    that topic instead, which :func:`run_produce` filled with ``messages`` (and its warm-up
    message)."""
    install_uvloop()

    async def main() -> dict[str, Any]:
        if topic is None:
            name, total = await _filled_topic(address, queues, messages, size, batch, inflight,
                                              show_progress, replication)
        else:
            name, total = topic, messages + 1
        cpu = CpuTime(broker_pid)
        elapsed, nbytes = await _pull_all(address, name, queues, total, "consume",
                                          show_progress, max_poll, cpu)
        res = _throughput("consume", total, size, elapsed, cpu, broker_pid, queues=queues)
        res["body_bytes"] = nbytes
        res["topic"] = name
        return res

    return asyncio.run(main())


# -- push --------------------------------------------------------------------------------------


async def _pull_all(address: str, topic: str, queues: int, total: int, label: str,
                    show: bool, max_poll: int = 10_000,
                    cpu: CpuTime | None = None) -> tuple[float, int]:
    """Read ``total`` messages of ``topic`` from the start with a pull consumer (``assign``
    every queue, no commits), touching every body; the seconds taken and the body bytes read.
    ``cpu`` counts the broker's CPU time over the timed part."""
    consumer = AsyncPullConsumer(address, group=f"bench-{uuid.uuid4().hex[:6]}",
                                 auto_commit=False, auto_offset_reset="earliest")
    async with consumer:
        await consumer.assign([(topic, q) for q in range(queues)])
        got = 0
        nbytes = 0
        with _progress(total, label, show) as prog:
            task = prog.add_task(label, total=total)
            if cpu is not None:
                cpu.begin()
            t0 = time.perf_counter()
            while got < total:
                msgs = await consumer.poll(timeout=10.0, max_messages=max_poll)
                if not msgs:
                    raise RuntimeError(f"{label}: pull consumer stalled at {got} of {total} "
                                       "messages")
                for msg in msgs:
                    nbytes += len(msg.body)
                got += len(msgs)
                prog.advance(task, len(msgs))
            elapsed = time.perf_counter() - t0
            if cpu is not None:
                cpu.end()
            return elapsed, nbytes


def run_push(address: str, *, messages: int = 1_000_000, size: int = 100, batch: int = 1000,
             queues: int = 4, inflight: int = 8, broker_pid: int | None = None,
             show_progress: bool = True, concurrency: int = 16, prefetch: int = 2048,
             compare_pull: bool = True,
             replication: Replication = DEFAULT_REPLICATION) -> dict[str, Any]:
    """Produce ``messages`` (untimed), then time a push consumer handling and acking them all
    (and, with ``compare_pull``, a pull consumer reading them)."""
    install_uvloop()

    async def main() -> dict[str, Any]:
        topic, total = await _filled_topic(address, queues, messages, size, batch, inflight,
                                           show_progress, replication)
        cpu = CpuTime(broker_pid)
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
            pull_s, _ = await _pull_all(address, topic, queues, total, "pull", show_progress)
            res["pull_msg_per_s"] = total / pull_s
            res["push_vs_pull"] = pull_s / elapsed
        return res

    return asyncio.run(main())


# -- end to end --------------------------------------------------------------------------------


def run_e2e(address: str, *, rate: float = 2000.0, duration: float = 10.0, size: int = 100,
            queues: int = 4, warmup: float = 1.0, broker_pid: int | None = None,
            show_progress: bool = True, pacing: str = "sleep",
            replication: Replication = DEFAULT_REPLICATION) -> dict[str, Any]:
    """Send at ``rate`` msg/s for ``duration`` s while consuming; latency percentiles."""
    install_uvloop()
    size = max(size, 8)

    async def main() -> dict[str, Any]:
        topic = await _create_topic(address, queues, replication=replication)
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
        producer = AsyncProducer(address, client_id="ferrymq-bench-e2e", linger_ms=0,
                                 acks=replication.acks)
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
            cpu = CpuTime(broker_pid)
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
        cpu = CpuTime(broker_pid)
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
        cpu_fire = CpuTime(broker_pid)
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
