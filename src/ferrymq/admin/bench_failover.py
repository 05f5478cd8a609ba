"""``ferrymq bench cluster failover --service S``: how long each stateful service is unavailable
after the broker that serves it is killed (issue 22's "failover time per service").

Theory of operation
-------------------
A :class:`FailoverService` names the queue whose leader serves it (a data queue for produce; the
group's ``%GROUPS%offsets`` queue for commits; ...) and one operation of it. The harness
(:func:`run_service_failover`) runs the operation at a fixed rate throughout (each started as its
own task when the service allows operations in parallel, one after the other otherwise),
records when each successful one started and ended, and ``kills`` times: waits until the
service's queue has three in-sync replicas, SIGKILLs its leader, and measures from the kill to
the end of the first successful operation *started after the kill* (the clients' refresh, the
lease's expiry, the controller's election and the new owner's rebuilding all count), or, for a
service whose operation is a wait (``delayed``), to what its ``resumed_after`` says; then it
restarts the killed broker and waits for it to be back in the ISR before the next kill.

Services (:data:`SERVICES`): ``produce`` (``acks="all"`` sends to a one-queue topic of three
replicas), ``commit`` (a pull consumer's offset commits of a growing offset: only the coordinator is in
their path) and ``delayed``
(delayed delivery: an operation waits for a delayed message whose copy was stored after it
began, which after a kill only the queue's new leader stores; :class:`DelayedService` also
reports the acknowledged delayed messages lost or delivered twice), and ``txn`` (a
transactional producer's one-message transactions into a three-queue topic: begin, send,
commit; the owner is the transaction coordinator, the leader of ``%TXN%state``) and
``delivery`` (a simple consumer's receive and ack of what a producer task keeps sending; the
owner is the group's coordinator, the leader of ``%RETRY%<group>``). More register themselves in
:data:`SERVICES`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ferrymq.admin.bench_measure import install_uvloop, percentile
from ferrymq.admin.bench_workloads import Replication, _create_topic
from ferrymq.client.admin import AsyncAdminClient
from ferrymq.client.consumer import AsyncPullConsumer
from ferrymq.client.message import Message
from ferrymq.client.producer import AsyncProducer
from ferrymq.client.simple import AsyncSimpleConsumer
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, TXN_TOPIC, coordinator_queue
from ferrymq.protocol.letters import RETRY_TOPIC_PREFIX
from ferrymq.protocol.schedule import SCHEDULED_ID

__all__ = ["SERVICES", "FailoverService", "describe_cluster", "queue_state", "run_service_failover",
           "wait_isr"]

RF3 = Replication(replicas=3, min_insync=2)
COMMIT_BACKLOG = 20_000
"""Messages the commit service's queue holds: the offsets it commits go round below it."""


async def _first_success(operate: Callable[[], Awaitable[None]], timeout_s: float,
                         what: str) -> None:
    """Run ``operate`` until it succeeds once (what a service's start waits for: the cluster
    creates the internal topic its first requests ask for), at most ``timeout_s``."""
    deadline = time.perf_counter() + timeout_s
    while True:
        with contextlib.suppress(Exception):
            await operate()
            return
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{what} within {timeout_s} s")
        await asyncio.sleep(0.1)


class FailoverService(Protocol):
    """One stateful service as the failover bench drives it."""

    name: str
    parallel: bool
    """Whether operations may overlap (each its own task)."""

    async def start(self, bootstrap: str, resume_timeout_s: float) -> None:
        """Create what it needs and connect."""
        ...

    def owner(self) -> tuple[str, int]:
        """The queue whose leader serves it (known after :meth:`start`)."""
        ...

    async def operate(self) -> None:
        """One operation; raises when it fails."""
        ...

    async def close(self) -> None:
        """Disconnect."""
        ...

    def figures(self) -> dict[str, Any]:
        """The service's own figures of the run, added to the result (after :meth:`close`)."""
        ...


@dataclass
class ProduceService:
    """``acks="all"`` sends of ``size`` bytes to a one-queue topic of three replicas."""

    size: int = 100
    name: str = "produce"
    parallel: bool = True
    topic: str = ""
    producer: AsyncProducer | None = None

    async def start(self, bootstrap: str, resume_timeout_s: float) -> None:
        self.topic = await _create_topic(bootstrap, 1, prefix="bench-failover", replication=RF3)
        self.producer = AsyncProducer(bootstrap, client_id="ferrymq-bench-failover", acks="all",
                                      linger_ms=0, delivery_timeout_s=resume_timeout_s + 30)
        await self.producer.start()
        await self.operate()

    def owner(self) -> tuple[str, int]:
        return self.topic, 0

    async def operate(self) -> None:
        assert self.producer is not None
        await self.producer.send(Message(self.topic, os.urandom(self.size)))

    async def close(self) -> None:
        if self.producer is not None:
            await self.producer.close()

    def figures(self) -> dict[str, Any]:
        return {}


@dataclass
class CommitService:
    """A pull consumer of a group that commits a growing offset of a queue holding
    :data:`COMMIT_BACKLOG` messages (written first): a commit reaches only the group's
    coordinator, the leader of its ``%GROUPS%offsets`` queue (the data queues' leaders, which
    the kill may hit too, are not in its path). Between commits it polls, which rejoins when
    the group needs it."""

    name: str = "commit"
    parallel: bool = False
    group: str = field(default_factory=lambda: f"bench-commit-{os.getpid()}")
    topic: str = ""
    queues: int = 0
    committed: int = 0
    consumer: AsyncPullConsumer | None = None

    async def start(self, bootstrap: str, resume_timeout_s: float) -> None:
        self.topic = await _create_topic(bootstrap, 1, prefix="bench-commit", replication=RF3)
        async with AsyncProducer(bootstrap, acks="all") as producer:
            for _ in range(COMMIT_BACKLOG // 1000):
                await producer.send_batch([Message(self.topic, b"x")] * 1000)
        self.consumer = AsyncPullConsumer(bootstrap, group=self.group, auto_commit=False,
                                          auto_offset_reset="earliest",
                                          heartbeat_interval_s=0.2)
        await self.consumer.start()
        await self.consumer.subscribe(self.topic)
        # the group exists (and so does %GROUPS%offsets) once a commit worked
        await _first_success(self.operate, resume_timeout_s, f"group {self.group}: no commit")
        async with AsyncAdminClient(bootstrap) as admin:
            desc = await admin.cluster_describe()
        self.queues = sum(1 for q in desc.queues if q.topic == OFFSETS_TOPIC)

    def owner(self) -> tuple[str, int]:
        return OFFSETS_TOPIC, coordinator_queue(self.group, self.queues)

    async def operate(self) -> None:
        assert self.consumer is not None
        await self.consumer.poll(timeout=0.01, max_messages=1)
        self.committed = self.committed % COMMIT_BACKLOG + 1
        await self.consumer.commit({(self.topic, 0): self.committed})

    async def close(self) -> None:
        if self.consumer is not None:
            await self.consumer.close()

    def figures(self) -> dict[str, Any]:
        return {}


@dataclass
class _Feeder:
    """Sends ``make()`` every ``1 / rate`` s, each send its own task: a send stuck on a dead
    leader does not hold the next ones back (a keyless one goes to another queue). Counts the
    acknowledged (their ids) and the failed."""

    producer: AsyncProducer
    make: Callable[[], Message]
    rate: float
    acked: set[str] = field(default_factory=set)
    failed: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None
    _sends: set[asyncio.Task[None]] = field(default_factory=set)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _one(self) -> None:
        try:
            r = await self.producer.send(self.make())
        except Exception:  # noqa: BLE001 - a failed send is a figure
            self.failed += 1
            return
        self.acked.add(r.msg_id)

    async def _run(self) -> None:
        interval = 1.0 / self.rate
        nxt = time.perf_counter()
        while not self._stop.is_set():
            task = asyncio.get_running_loop().create_task(self._one())
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)
            nxt = max(nxt + interval, time.perf_counter() - 1.0)
            await asyncio.sleep(max(0.001, nxt - time.perf_counter()))

    async def stop(self, timeout_s: float) -> None:
        """Stop sending and wait (at most ``timeout_s``) for the sends in flight."""
        self._stop.set()
        if self._task is not None:
            await self._task
        if self._sends:
            await asyncio.wait(set(self._sends), timeout=timeout_s)


@dataclass
class DelayedService:
    """Delayed delivery: messages delayed by ``delay_s`` are sent at ``send_rate`` per second
    (``acks="all"``) to a one-queue topic of three replicas throughout, and a consumer reads
    the queue. An operation waits for the next delayed message whose copy was stored after the
    operation began (after a kill only the new leader stores copies), at most ``delay_s`` + 30
    s. :meth:`close` waits until every acknowledged one was delivered (or ``delay_s`` + the
    resume timeout passed); :meth:`figures` counts those lost and those with two copies."""

    delay_s: float = 2.0
    send_rate: float = 50.0
    name: str = "delayed"
    parallel: bool = False
    topic: str = ""
    feeder: _Feeder | None = None
    consumer: AsyncPullConsumer | None = None
    copies: dict[str, set[int]] = field(default_factory=dict)
    """Original id -> offsets of its copies received."""
    newest_stored_ms: int = -1
    """The latest append time of a copy received."""
    receipts: list[tuple[float, int]] = field(default_factory=list)
    """(perf_counter when received, append time in wall ms) of each copy."""
    resume_timeout_s: float = 60.0
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _reader: asyncio.Task[None] | None = None

    async def start(self, bootstrap: str, resume_timeout_s: float) -> None:
        self.resume_timeout_s = resume_timeout_s
        self.topic = await _create_topic(bootstrap, 1, prefix="bench-delayed", replication=RF3)
        producer = AsyncProducer(bootstrap, client_id="ferrymq-bench-delayed", acks="all",
                                 linger_ms=0, delivery_timeout_s=resume_timeout_s + 30)
        await producer.start()
        self.feeder = _Feeder(producer, lambda: Message(self.topic, b"d", delay=self.delay_s),
                              self.send_rate)
        self.consumer = AsyncPullConsumer(bootstrap, client_id="ferrymq-bench-delayed",
                                          auto_commit=False, auto_offset_reset="earliest")
        await self.consumer.start()
        await self.consumer.assign([(self.topic, 0)])
        self.feeder.start()
        self._reader = asyncio.get_running_loop().create_task(self._read())
        await self.operate()  # copies flow

    def owner(self) -> tuple[str, int]:
        return self.topic, 0

    async def _read(self) -> None:
        assert self.consumer is not None
        while True:
            with contextlib.suppress(Exception):  # the cluster is moving: poll again
                for msg in await self.consumer.poll(timeout=0.2):
                    original = msg.properties.get(SCHEDULED_ID)
                    if original is not None:
                        self.copies.setdefault(original, set()).add(msg.offset)
                        self.newest_stored_ms = max(self.newest_stored_ms, msg.stored_ms)
                        self.receipts.append((time.perf_counter(), msg.stored_ms))
                        self._arrived.set()
            await asyncio.sleep(0)

    async def operate(self) -> None:
        since = time.time_ns() // 1_000_000
        await asyncio.wait_for(self._arrivals(lambda: self.newest_stored_ms >= since),
                               self.delay_s + 30)

    def resumed_after(self, t_kill: float, kill_ms: int) -> float | None:
        """When (perf_counter) the first copy stored after the kill (wall ``kill_ms``) was
        received, if one was: an operation is a wait, so "the first operation started after
        the kill" would add the wait of the one in flight at the kill (up to ``delay_s``)."""
        got = [r for r, stored in self.receipts[-5000:] if stored >= kill_ms and r >= t_kill]
        return min(got) if got else None

    async def _arrivals(self, enough: Callable[[], bool]) -> None:
        """Wait for copies until ``enough()``."""
        while not enough():
            self._arrived.clear()
            await self._arrived.wait()

    async def close(self) -> None:
        acked: set[str] = set()
        if self.feeder is not None:
            await self.feeder.stop(self.resume_timeout_s)
            acked = self.feeder.acked
        with contextlib.suppress(TimeoutError):  # lost ones are counted by figures()
            await asyncio.wait_for(self._arrivals(lambda: not acked - set(self.copies)),
                                   self.delay_s + self.resume_timeout_s)
        await asyncio.sleep(1.0)  # and a little longer, to catch a second copy
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self.consumer is not None:
            await self.consumer.close()
        if self.feeder is not None:
            await self.feeder.producer.close()

    def figures(self) -> dict[str, Any]:
        twice = sorted((o, sorted(offs)) for o, offs in self.copies.items() if len(offs) > 1)
        acked = self.feeder.acked if self.feeder is not None else set()
        return {"delay_s": self.delay_s, "delayed_sent": len(acked),
                "delayed_failed_sends": self.feeder.failed if self.feeder is not None else 0,
                "delayed_lost": len(acked - set(self.copies)),
                "delayed_twice": len(twice), "delayed_twice_examples": twice[:5]}


@dataclass
class TxnService:
    """One-message transactions (begin, send, commit) of a transactional producer into a
    three-queue topic: the commit reaches the transaction coordinator, the leader of
    ``%TXN%state``, and the markers every touched queue's leader."""

    size: int = 100
    name: str = "txn"
    parallel: bool = False
    topic: str = ""
    producer: AsyncProducer | None = None
    n: int = 0

    async def start(self, bootstrap: str, resume_timeout_s: float) -> None:
        self.topic = await _create_topic(bootstrap, 3, prefix="bench-txn", replication=RF3)
        self.producer = AsyncProducer(bootstrap, client_id="ferrymq-bench-txn-failover",
                                      transactional_id=f"bench-txn-{os.getpid()}", linger_ms=0,
                                      request_timeout_s=resume_timeout_s,
                                      delivery_timeout_s=resume_timeout_s)
        await self.producer.start()  # INIT_TXN: %TXN%state exists from here on
        await self.operate()

    def owner(self) -> tuple[str, int]:
        return TXN_TOPIC, 0

    async def operate(self) -> None:
        p = self.producer
        assert p is not None
        self.n += 1
        await p.begin()
        try:
            await p.send(Message(self.topic, os.urandom(self.size), sharding_key=str(self.n)))
            await p.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                await p.abort()
            raise

    async def close(self) -> None:
        if self.producer is not None:
            await self.producer.close()

    def figures(self) -> dict[str, Any]:
        return {}


@dataclass
class DeliveryService:
    """A simple consumer of a delivery group: an operation receives what is there and acks it.
    Receive and ack reach the group's coordinator, the leader of its retry queue
    ``%RETRY%<group>``. A producer task keeps sending keyless messages into the three-queue
    topic (``feed_rate`` per second) outside the measured operation: its own failover is the
    ``produce`` service's, and in the operation it measured a send stuck on a killed queue
    leader instead of the coordinator (a third of the kills took ~10 s that way)."""

    size: int = 100
    feed_rate: float = 50.0
    name: str = "delivery"
    parallel: bool = False
    group: str = field(default_factory=lambda: f"bench-delivery-{os.getpid()}")
    topic: str = ""
    consumer: AsyncSimpleConsumer | None = None
    feeder: _Feeder | None = None
    resume_timeout_s: float = 60.0
    received: int = 0

    async def start(self, bootstrap: str, resume_timeout_s: float) -> None:
        self.resume_timeout_s = resume_timeout_s
        self.topic = await _create_topic(bootstrap, 3, prefix="bench-delivery", replication=RF3)
        producer = AsyncProducer(bootstrap, acks="all", linger_ms=0,
                                 delivery_timeout_s=resume_timeout_s + 30)
        await producer.start()
        self.feeder = _Feeder(producer, lambda: Message(self.topic, os.urandom(self.size)),
                              self.feed_rate)
        self.consumer = AsyncSimpleConsumer(bootstrap, self.group, invisible_duration=30,
                                            await_duration=1.0, request_timeout_s=10)
        await self.consumer.start()
        await self.consumer.subscribe(self.topic)
        self.feeder.start()
        # the group exists (and so does its retry queue) once one went through
        await _first_success(self.operate, resume_timeout_s, f"group {self.group}: no receive")

    def owner(self) -> tuple[str, int]:
        return RETRY_TOPIC_PREFIX + self.group, 0

    async def operate(self) -> None:
        assert self.consumer is not None
        msgs = await self.consumer.receive(max_messages=64)
        if not msgs:
            raise RuntimeError("nothing received")
        await self.consumer.ack_batch(msgs)
        self.received += len(msgs)

    async def close(self) -> None:
        if self.feeder is not None:
            await self.feeder.stop(self.resume_timeout_s)
        if self.consumer is not None:
            await self.consumer.close()
        if self.feeder is not None:
            await self.feeder.producer.close()

    def figures(self) -> dict[str, Any]:
        f = self.feeder
        return {"feed_sent": len(f.acked) if f else 0, "feed_failed_sends": f.failed if f else 0,
                "received": self.received}


SERVICES: dict[str, Callable[[int], FailoverService]] = {
    "produce": lambda size: ProduceService(size=size),
    "commit": lambda size: CommitService(),
    "delayed": lambda size: DelayedService(),
    "txn": lambda size: TxnService(size=size),
    "delivery": lambda size: DeliveryService(size=size),
}
"""The services :func:`run_service_failover` knows, by name (called with the message size)."""


async def describe_cluster(bootstrap: str) -> Any:
    """The cluster as a live broker of ``bootstrap`` sees it (a fresh client each time: the
    admin client stays with the broker it bootstrapped through, which may be the killed one)."""
    async with AsyncAdminClient(bootstrap, connect_timeout_s=2.0, reconnect_timeout_s=2.0,
                                request_timeout_s=5.0) as admin:
        return await admin.cluster_describe()


async def queue_state(bootstrap: str, topic: str, queue: int, *,
                      timeout_s: float = 120.0) -> Any:
    """The queue's state (leader, ISR) as a live broker of ``bootstrap`` sees it (retried
    until one answers, at most ``timeout_s``: a bench whose brokers are all gone fails, it does
    not hang)."""
    deadline = time.perf_counter() + timeout_s
    last: BaseException | None = None
    while time.perf_counter() < deadline:
        try:
            desc = await describe_cluster(bootstrap)
        except Exception as exc:  # noqa: BLE001 - a broker down: ask again
            last = exc
        else:
            for q in desc.queues:
                if q.topic == topic and q.queue == queue:
                    return q
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{topic}/{queue}: no broker of {bootstrap} described it within "
                       f"{timeout_s:.0f} s (last error: {last!r})")


async def wait_isr(bootstrap: str, topic: str, queue: int, size: int, timeout_s: float,
                    member: int | None = None) -> Any:
    """The queue's state once its ISR has ``size`` members (and ``member``, if given)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        q = await queue_state(bootstrap, topic, queue)
        if len(q.isr) >= size and (member is None or member in q.isr) and not q.offline:
            return q
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{topic}/{queue}: ISR {q.isr} (leader {q.leader}) did not reach "
                               f"{size} members{'' if member is None else f' with {member}'} "
                               f"within {timeout_s:.0f} s")
        await asyncio.sleep(0.05)


def run_service_failover(bench: Any, service: str = "produce", *, kills: int = 20,
                         rate: float = 500.0, size: int = 100, rejoin_timeout_s: float = 120.0,
                         resume_timeout_s: float = 60.0, settle_s: float = 1.0,
                         on_kill: Callable[[dict[str, Any]], None] | None = None
                         ) -> dict[str, Any]:
    """SIGKILL the broker serving ``service`` ``kills`` times while its operation runs at
    ``rate`` per second; the unavailability of each kill (kill → end of the first successful
    operation started after it) and its percentiles. ``bench`` is a
    :class:`~ferrymq.admin.bench_cluster.BenchCluster`."""
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}: one of {', '.join(SERVICES)}")
    install_uvloop()
    cluster = bench.cluster
    bootstrap = cluster.bootstrap

    async def main() -> dict[str, Any]:
        svc = SERVICES[service](size)
        await svc.start(bootstrap, resume_timeout_s)
        done: list[tuple[float, float]] = []  # (start, end) of each success, perf_counter
        failed: list[str] = []
        stop = asyncio.Event()
        pending: set[asyncio.Task[Any]] = set()

        async def one() -> None:
            t = time.perf_counter()
            try:  # an operation that never ends fails at the resume timeout (no bench hangs)
                await asyncio.wait_for(svc.operate(), resume_timeout_s)
            except Exception as exc:  # noqa: BLE001 - a failed operation is a figure
                failed.append(repr(exc))
                return
            done.append((t, time.perf_counter()))

        async def driver() -> None:
            interval = 1.0 / rate
            nxt = time.perf_counter()
            while not stop.is_set():
                if svc.parallel:
                    task = asyncio.get_running_loop().create_task(one())
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                else:
                    await one()
                nxt = max(nxt + interval, time.perf_counter() - 1.0)
                await asyncio.sleep(max(0.001, nxt - time.perf_counter()))

        topic, queue = svc.owner()
        kills_out: list[dict[str, Any]] = []
        dtask = asyncio.get_running_loop().create_task(driver())
        try:
            for i in range(kills):
                q = await wait_isr(bootstrap, topic, queue, 3, rejoin_timeout_s)
                desc = await describe_cluster(bootstrap)
                victim = q.leader
                await asyncio.sleep(settle_s)
                t_kill, kill_ms = time.perf_counter(), time.time_ns() // 1_000_000
                cluster.kill9(victim)
                resumed = None
                own = getattr(svc, "resumed_after", None)  # a service that measures it itself
                while time.perf_counter() - t_kill < resume_timeout_s:
                    if own is not None:
                        resumed = own(t_kill, kill_ms)
                    else:
                        after = [e for s, e in done[-2000:] if s >= t_kill]
                        resumed = min(after) if after else None
                    if resumed is not None:
                        break
                    await asyncio.sleep(0.005)
                if resumed is None:
                    raise RuntimeError(f"kill {i + 1}: no {service} operation succeeded within "
                                       f"{resume_timeout_s:.0f} s of killing broker {victim}")
                new = await queue_state(bootstrap, topic, queue)
                isr_after = list(new.isr)
                t_restart = time.perf_counter()
                await asyncio.to_thread(cluster.restart, victim, 60.0)
                t_up = time.perf_counter()
                await wait_isr(bootstrap, topic, queue, 3, rejoin_timeout_s, member=victim)
                t_isr = time.perf_counter()
                row = {"kill": i + 1, "victim": victim, "new_leader": new.leader,
                       "isr_after_kill": isr_after,
                       "victim_was_controller": victim == desc.controller,
                       "unavailable_s": resumed - t_kill, "restart_s": t_up - t_restart,
                       "rejoin_isr_s": t_isr - t_up, "failed_ops": len(failed)}
                kills_out.append(row)
                if on_kill is not None:
                    on_kill(row)
        finally:
            stop.set()
            await dtask
            if pending:
                await asyncio.wait(set(pending), timeout=resume_timeout_s)
            await svc.close()
        figures = svc.figures()
        un = sorted(k["unavailable_s"] for k in kills_out)
        return {
            "workload": "failover", "service": service, "kills": len(kills_out), "rate": rate,
            "size": size,
            "unavailable_p50_s": percentile(un, 50), "unavailable_p99_s": percentile(un, 99),
            "unavailable_max_s": un[-1] if un else float("nan"),
            "unavailable_min_s": un[0] if un else float("nan"),
            "succeeded": len(done), "failed_ops": len(failed), "failures": failed[:5],
            "kills_detail": kills_out, **figures,
        }

    return asyncio.run(main())
