"""A cluster of real processes with every fault the chaos tests inject, each a small method.

Theory of operation
-------------------
:class:`ChaosCluster` wraps a :class:`~ferrymq.testing.ClusterProcess` (one etcd, N broker
subprocesses, ``--flush sync``) and puts a :class:`~.proxy.FaultProxy` on every link that a
partition may cut: broker ``i`` advertises its own proxy (so clients and the other brokers'
follower fetches reach it only through that proxy) and reaches etcd through an etcd proxy of
its own. Each broker also runs with two fault hooks (:class:`~ferrymq.testing.Faults`): a
clock file (its wall clock = the system's plus the ms in that file) and an fsync journal (the
size each of its files had when an fsync that completed began).

The faults:

- :meth:`kill9` / :meth:`restart`: SIGKILL, and start again on the same port and files;
- :meth:`pause` / :meth:`resume`: SIGSTOP and SIGCONT (a leader paused past its lease comes
  back a zombie: it must not acknowledge what the new leader does not hold);
- :meth:`partition` / :meth:`heal`: blackhole the broker's own proxy and its etcd proxy:
  nobody reaches it (clients, followers fetching from it) and it reaches no etcd; what it
  fetches as a follower of other queues still flows (an asymmetric partition);
- :meth:`power_loss`: SIGKILL, then every segment file (``<20 digits>.log``) cut back to the
  size its last completed fsync covered (0 when none did), as the page cache would be lost;
  what the files held beyond it is gone (a real power loss may also keep some of it: this is
  the harsher case), then start again;
- :meth:`clock_jump`: move the broker's wall clock by some ms (the monotonic clock is
  untouched, as with an NTP step).

The methods block (process starts wait until the broker listens): an asyncio caller runs them
with ``asyncio.to_thread``. :meth:`describe` and :meth:`wait_healthy` are coroutines.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Mapping
from pathlib import Path

from ferrymq.client import AsyncAdminClient
from ferrymq.client._admin_results import ClusterDescription
from ferrymq.testing import ClusterProcess, Faults

from .proxy import FaultProxy, ProxyThread

__all__ = ["ChaosCluster"]

SEGMENT_RE = re.compile(r"^\d{20}\.log$")


class ChaosCluster:
    """``brokers`` brokers and one etcd, every link through a fault proxy (see the module)."""

    def __init__(self, base_dir: Path, *, brokers: int = 3, lease_ms: int = 2000,
                 replica_lag_ms: int = 2000, env: Mapping[str, str] | None = None) -> None:
        self.base_dir = base_dir
        self.lease_ms = lease_ms
        self.proxies = ProxyThread()
        self.cluster = ClusterProcess(
            brokers, base_dir, flush="sync", log_level="INFO",
            env={"FERRYMQ_METADATA_LEASE_MS": str(lease_ms),
                 "FERRYMQ_REPLICA_LAG_MS": str(replica_lag_ms), **(env or {})})
        self.broker_proxy: dict[int, FaultProxy] = {}
        self.etcd_proxy: dict[int, FaultProxy] = {}
        self.journals: dict[int, Path] = {}
        self.clocks: dict[int, Path] = {}

    @property
    def ids(self) -> list[int]:
        """The brokers' ids."""
        return sorted(self.cluster.brokers)

    @property
    def bootstrap(self) -> str:
        """What clients take: every broker's proxy."""
        return ",".join(self.broker_proxy[i].address for i in self.ids)

    def start(self) -> ChaosCluster:
        """Start the proxies, etcd and the brokers."""
        self.proxies.__enter__()
        for i, b in self.cluster.brokers.items():
            self.broker_proxy[i] = self.proxies.proxy(b.address)
            self.etcd_proxy[i] = self.proxies.proxy(self.cluster.etcd.client_url.split("//")[-1])
            self.cluster.route(i, advertised_address=self.broker_proxy[i].address,
                               metadata_url=f"etcd://{self.etcd_proxy[i].address}")
            home = b.data_dir.parent
            home.mkdir(parents=True, exist_ok=True)
            self.journals[i] = home / "fsyncs"
            self.clocks[i] = home / "clock-offset"
            self.clocks[i].write_text("0")
            b.faults = Faults(fsync_journal=str(self.journals[i]), clock_file=str(self.clocks[i]))
        self.cluster.start()
        return self

    def close(self) -> None:
        """SIGKILL everything (SIGCONT first: a stopped process cannot die until resumed)."""
        for b in self.cluster.brokers.values():
            if b.running() and b.pid is not None:
                os.kill(b.pid, signal.SIGCONT)
        self.cluster.kill()
        self.proxies.__exit__()

    def __enter__(self) -> ChaosCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- looking ----------------------------------------------------------------------------

    async def describe(self) -> ClusterDescription:
        """The cluster as a live broker describes it."""
        async with AsyncAdminClient(self.bootstrap, request_timeout_s=3,
                                    connect_timeout_s=3) as admin:
            return await asyncio.wait_for(admin.cluster_describe(), 10)

    async def leader_of(self, topic: str, queue: int) -> int:
        """The leader of ``topic``/``queue`` now (-1: none)."""
        d = await self.describe()
        return next(q.leader for q in d.queues if (q.topic, q.queue) == (topic, queue))

    async def wait_topic_everywhere(self, topic: str, timeout: float = 30.0) -> None:
        """Wait until every broker lists ``topic`` (their views follow etcd's by watch).

        Raises:
            AssertionError: not within ``timeout`` s.
        """
        deadline = time.monotonic() + timeout
        for i in self.ids:
            while True:
                async with AsyncAdminClient(self.broker_proxy[i].address) as admin:
                    if topic in {t.name for t in await admin.list_topics()}:
                        break
                if time.monotonic() > deadline:
                    raise AssertionError(f"broker {i} does not know topic {topic!r} after "
                                         f"{timeout} s")
                await asyncio.sleep(0.05)

    async def wait_healthy(self, topic: str, timeout: float = 60.0) -> ClusterDescription:
        """Wait until every broker is alive and registered, and every queue of ``topic`` has a
        live leader and all its replicas in sync.

        Raises:
            AssertionError: not within ``timeout`` s (with the last description).
        """
        deadline = time.monotonic() + timeout
        last: object = None
        while True:
            try:
                d = await self.describe()
                last = d
                alive = {b.broker_id for b in d.brokers if b.alive}
                queues = [q for q in d.queues if q.topic == topic]
                if (alive == set(self.ids) and queues
                        and all(not q.offline and len(q.isr) == len(q.replicas)
                                for q in queues)):
                    return d
            except Exception as exc:  # a broker may be down: ask again
                last = exc
            if time.monotonic() > deadline:
                raise AssertionError(f"the cluster did not heal within {timeout} s: {last!r}")
            await asyncio.sleep(0.2)

    # --- faults -----------------------------------------------------------------------------

    def kill9(self, broker_id: int) -> None:
        """SIGKILL a broker."""
        self.cluster.kill9(broker_id)

    def restart(self, broker_id: int) -> None:
        """Start a killed broker again on its port and files."""
        self.cluster.restart(broker_id, timeout=60)

    def pause(self, broker_id: int) -> None:
        """SIGSTOP a broker."""
        pid = self.cluster.broker(broker_id).pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)

    def resume(self, broker_id: int) -> None:
        """SIGCONT a paused broker."""
        pid = self.cluster.broker(broker_id).pid
        assert pid is not None
        os.kill(pid, signal.SIGCONT)

    def partition(self, broker_id: int) -> None:
        """Cut a broker off: no one reaches it, it reaches no etcd (see the module)."""
        self.proxies.set_mode(self.broker_proxy[broker_id], "blackhole")
        self.proxies.set_mode(self.etcd_proxy[broker_id], "blackhole")

    def heal(self, broker_id: int) -> None:
        """End a :meth:`partition`."""
        self.proxies.set_mode(self.broker_proxy[broker_id], "forward")
        self.proxies.set_mode(self.etcd_proxy[broker_id], "forward")

    def power_loss(self, broker_id: int) -> dict[str, int]:
        """SIGKILL a broker, cut its segments back to what fsyncs made durable, start it
        again; return the bytes each cut file lost."""
        self.kill9(broker_id)
        cut = self.truncate_to_fsynced(broker_id)
        self.restart(broker_id)
        return cut

    def truncate_to_fsynced(self, broker_id: int) -> dict[str, int]:
        """Cut the (stopped) broker's segment files back to their last journaled fsync; the
        journal then says what the files hold. Returns the bytes each cut file lost."""
        journal = self.journals[broker_id]
        durable: dict[str, int] = {}
        if journal.exists():
            for line in journal.read_text().splitlines():
                path, _, size = line.rpartition("\t")
                if path:
                    durable[path] = int(size)
        cut: dict[str, int] = {}
        kept: dict[str, int] = {}
        for seg in self.cluster.broker(broker_id).data_dir.rglob("*.log"):
            if not SEGMENT_RE.match(seg.name):
                continue
            size = seg.stat().st_size
            keep = min(size, durable.get(str(seg), 0))
            if keep < size:
                os.truncate(seg, keep)
                cut[str(seg)] = size - keep
            kept[str(seg)] = keep
        journal.write_text("".join(f"{p}\t{n}\n" for p, n in kept.items()))
        return cut

    def clock_jump(self, broker_id: int, offset_ms: int) -> None:
        """Set the broker's wall clock to the system's plus ``offset_ms`` (0: back to true)."""
        self.clocks[broker_id].write_text(str(offset_ms))
