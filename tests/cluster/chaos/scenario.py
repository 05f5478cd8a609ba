"""One chaos run: a cluster, the workload, a shuffled plan of faults, the drain, the check.

Theory of operation
-------------------
:func:`run` starts a :class:`~.cluster.ChaosCluster` (3 brokers, RF3, ``min_insync`` 2,
``--flush sync``), creates the topic, starts the :class:`~.workload.Workload`, and then for each
fault of the plan (the counts of :class:`Plan`, in a seeded random order) waits until the
cluster is healthy (every broker back, every queue fully in sync: one fault at a time, which
RF3 with ``min_insync`` 2 must survive), injects the fault on the leader of a random queue
(a power loss hits a random broker), heals it and goes on. Then it stops the producers, waits
until healthy, drains, and checks the history (:func:`~.history.check`).

:class:`Figures` are what a run measured: the faults, the messages, the anomalies and, per
leader kill, the unavailability: the time from the SIGKILL until the first acknowledgement of
a send to a queue the victim led.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ferrymq.client import AsyncAdminClient

from .cluster import ChaosCluster
from .history import History, Report, check
from .workload import Workload

__all__ = ["Figures", "Plan", "run"]

log = logging.getLogger(__name__)
TOPIC = "chaos"
QUEUES = 3


@dataclass
class Plan:
    """How many faults of each kind a run injects."""

    kills: int = 5
    pauses: int = 2
    partitions: int = 2
    power_losses: int = 2
    clock_jumps: int = 1
    seed: int = 20

    def faults(self) -> list[str]:
        """The plan's faults in a seeded random order."""
        faults = (["kill"] * self.kills + ["pause"] * self.pauses
                  + ["partition"] * self.partitions + ["power_loss"] * self.power_losses
                  + ["clock_jump"] * self.clock_jumps)
        random.Random(self.seed).shuffle(faults)
        return faults


@dataclass
class Figures:
    """What a run measured (see the module docstring)."""

    plan: dict[str, int]
    faults_done: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    sent: int = 0
    acked: int = 0
    indeterminate: int = 0
    lost: int = 0
    duplicates: int = 0
    divergent: int = 0
    reordered: int = 0
    misplaced: int = 0
    unexpected: int = 0
    hw_back: int = 0
    unavailability_s: list[float] = field(default_factory=list)
    power_loss_bytes_cut: int = 0

    def percentiles(self) -> dict[str, float]:
        """p50, p99 and max of the unavailability after a leader kill, in seconds."""
        u = sorted(self.unavailability_s)
        if not u:
            return {}
        return {"p50": statistics.median(u), "p99": u[min(len(u) - 1, int(len(u) * 0.99))],
                "max": u[-1]}

    def write(self, path: Path) -> None:
        """Write the figures as JSON (with the percentiles)."""
        path.write_text(json.dumps({**asdict(self), "unavailability": self.percentiles()},
                                   indent=2) + "\n")


async def _first_ack_after(h: History, t: float, queues: list[int], *,
                           timeout_s: float) -> float | None:
    """When the first send invoked after ``t`` to one of ``queues`` was acknowledged (None:
    none within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = []
        for s in reversed(h.sends.values()):  # in the order invoked: the newest first
            if s.invoked <= t:
                break
            if s.outcome == "ok" and s.place is not None and s.place[0] in queues:
                done.append(s.completed)
        if done:
            return min(done)
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.05)


async def _inject(c: ChaosCluster, fault: str, rng: random.Random, h: History,
                  fig: Figures) -> None:
    queue = rng.randrange(QUEUES)
    leader = await c.leader_of(TOPIC, queue)
    d = await c.describe()
    led = [q.queue for q in d.queues if q.topic == TOPIC and q.leader == leader]
    lease_s = c.lease_ms / 1000
    if fault == "kill":
        h.fault(f"kill -9 broker {leader} (leader of {led})")
        t = time.monotonic()
        await asyncio.to_thread(c.kill9, leader)
        # sends resume once the cluster elected new leaders for its queues; only then is it
        # started again (it catches up and rejoins). A send counts if invoked after the kill:
        # an answer already on the wire when it died may arrive just after.
        first = await _first_ack_after(h, t, led, timeout_s=30)
        fig.unavailability_s.append(round(first - t, 3) if first is not None else float("inf"))
        if first is None:
            log.error("no acknowledged send on %s within 30 s of killing broker %d", led, leader)
        await asyncio.to_thread(c.restart, leader)
        h.fault(f"restarted broker {leader}")
    elif fault == "pause":
        h.fault(f"SIGSTOP broker {leader} (leader of {led})")
        await asyncio.to_thread(c.pause, leader)
        await asyncio.sleep(lease_s * 2 + 1)  # past its lease: the controller moves its queues
        await asyncio.to_thread(c.resume, leader)
        h.fault(f"SIGCONT broker {leader}")
    elif fault == "partition":
        h.fault(f"partition broker {leader} (leader of {led}) from clients, brokers and etcd")
        await asyncio.to_thread(c.partition, leader)
        await asyncio.sleep(lease_s * 2 + 2)
        await asyncio.to_thread(c.heal, leader)
        h.fault(f"healed broker {leader}")
    elif fault == "power_loss":
        victim = rng.choice(c.ids)
        h.fault(f"power loss of broker {victim}")
        cut = await asyncio.to_thread(c.power_loss, victim)
        fig.power_loss_bytes_cut += sum(cut.values())
        h.fault(f"broker {victim} restarted after power loss; cut {cut}")
    elif fault == "clock_jump":
        victim = rng.choice(c.ids)
        jump = rng.choice((-1, 1)) * 3_600_000
        h.fault(f"clock of broker {victim} jumps {jump} ms")
        await asyncio.to_thread(c.clock_jump, victim, jump)
        await asyncio.sleep(3)
        await asyncio.to_thread(c.clock_jump, victim, 0)
        h.fault(f"clock of broker {victim} back")
    else:
        raise ValueError(f"unknown fault {fault!r}")
    fig.faults_done[fault] = fig.faults_done.get(fault, 0) + 1


async def run(base_dir: Path, plan: Plan, *, figures_path: Path | None = None,
              settle_s: float = 1.0, producers: int = 2, keys_per_producer: int = 6,
              ) -> tuple[History, Report, Figures]:
    """One chaos run (see the module docstring); the figures also go to ``figures_path``."""
    h = History()
    fig = Figures(plan=asdict(plan))
    rng = random.Random(plan.seed)
    started = time.monotonic()
    c = ChaosCluster(base_dir)
    await asyncio.to_thread(c.start)
    try:
        async with AsyncAdminClient(c.bootstrap) as admin:
            await admin.create_topic(TOPIC, QUEUES, replicas=3, min_insync=2)
        await c.wait_healthy(TOPIC)
        await c.wait_topic_everywhere(TOPIC)
        w = Workload(h, c.bootstrap, TOPIC, QUEUES, producers=producers,
                     keys_per_producer=keys_per_producer)
        w.start()
        try:
            await asyncio.sleep(settle_s)
            for i, fault in enumerate(plan.faults()):
                await c.wait_healthy(TOPIC)
                log.warning("fault %d/%d: %s", i + 1, len(plan.faults()), fault)
                await _inject(c, fault, rng, h, fig)
                await asyncio.sleep(settle_s)
                if figures_path is not None:
                    _fill(fig, h, None, started)
                    fig.write(figures_path)
            await c.wait_healthy(TOPIC)
        finally:
            await w.stop()
        await w.drain()
        report = check(h)
        _fill(fig, h, report, started)
        if figures_path is not None:
            fig.write(figures_path)
        return h, report, fig
    except BaseException:
        _dump(base_dir, h)
        raise
    finally:
        await asyncio.to_thread(c.close)


def _fill(fig: Figures, h: History, report: Report | None, started: float) -> None:
    fig.duration_s = round(time.monotonic() - started, 1)
    fig.sent = len(h.sends)
    fig.acked = len(h.acked())
    fig.indeterminate = sum(1 for s in h.sends.values() if s.outcome not in ("", "ok"))
    if report is not None:
        fig.lost, fig.duplicates = len(report.lost), len(report.duplicates)
        fig.divergent, fig.reordered = len(report.divergent), len(report.reordered)
        fig.misplaced, fig.unexpected = len(report.misplaced), len(report.unexpected)
        fig.hw_back = len(report.hw_back)


def _dump(base_dir: Path, h: History) -> None:
    """Write the history next to the cluster's logs, for a failed run's post-mortem."""
    with open(base_dir / "history.json", "w", encoding="utf-8") as f:
        json.dump({"sends": [asdict(s) for s in h.sends.values()], "reads": h.reads,
                   "final": h.final, "faults": h.faults,
                   "hw": {f"{r}/{q}": v for (r, q), v in h.hw.items()}}, f)


def dump_history(base_dir: Path, h: History) -> Path:
    """Write the history to ``base_dir/history.json``; return the path."""
    _dump(base_dir, h)
    return base_dir / "history.json"
