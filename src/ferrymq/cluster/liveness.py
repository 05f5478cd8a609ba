"""Noticing a dead broker before its lease runs out: the controller's probe.

Theory of operation
-------------------
A broker killed with ``kill -9`` (or that crashed) stops renewing its lease, and the cluster
moves its leaderships once the lease has run out: 2 to 3 s after the death with the default
``metadata_lease_ms`` of 3000 (renewed every second), plus etcd's own check of expired leases
(every 500 ms). The lease is the authority and must stay long enough for a live broker never to
lose it by a pause. But a dead broker's host still answers for it: a connection to a port no
process listens on is **refused** at once (a TCP reset), which a live broker's port never does,
and which a partition or a stalled process never causes (they time out).

So the controller connects to every other registered broker's address every
``dead_broker_probe_ms`` (250 ms; 0 turns the probe off), and every other broker connects to
the controller's (so the controller's death is noticed as fast: its seat goes with its lease,
and the next controller takes it then). A broker refused
:data:`REFUSALS` times in a row, at the same registration (its key's create revision: a
restarted broker is a new registration), has its lease **revoked** in the metadata store: its
key goes, the controller's watch sees the broker gone, and it moves the broker's leaderships
exactly as when the lease expires (NATS moves a stream's leader when its route to a server
drops; here the store stays the one place that decides). Anything else (connected, a timeout,
an unreachable network, a name that does not resolve) changes nothing: only the lease decides
then. A broker whose lease was revoked while it lives (it cannot be refused then, but a port
closing during a restart on the same address could be) finds out at its next renewal and
registers again (:mod:`ferrymq.cluster.node`).

"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from ferrymq.cluster.metadata.store import MetadataStore
from ferrymq.cluster.model import BrokerRecord, ControllerRecord, Keys
from ferrymq.errors import MetadataUnavailableError

log = logging.getLogger("ferrymq.cluster")

REFUSALS = 2
"""Refused connections in a row (one probe interval apart) before a broker counts as dead."""


async def refused(host: str, port: int, timeout_s: float) -> bool:
    """Whether a TCP connection to ``host:port`` is refused (no process listens there). A
    connection made, a timeout or any other error: False."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


class DeadBrokerProbe:
    """One broker's probe (see the module docstring): of every other broker while
    ``is_controller()``, else of the controller only. ``interval_s``: between two rounds."""

    def __init__(self, store: MetadataStore, keys: Keys, broker_id: int, interval_s: float,
                 is_controller: Callable[[], bool]) -> None:
        self.store = store
        self.keys = keys
        self.broker_id = broker_id
        self.interval_s = interval_s
        self.is_controller = is_controller
        self.refusals: dict[tuple[int, int], int] = {}
        """(broker id, create revision of its key) -> refused probes in a row."""
        self.revoked: list[int] = []
        """Brokers whose lease this probe revoked (newest last)."""

    async def run(self) -> None:
        """Probe every ``interval_s`` (cancel to stop)."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.round()
            except MetadataUnavailableError as exc:
                log.debug("dead-broker probe: metadata store unreachable (%s)", exc)

    async def round(self) -> None:
        """Probe the brokers this one watches once; revoke the lease of one refused
        :data:`REFUSALS` times in a row."""
        kvs, _ = await self.store.range(self.keys.brokers)
        watched: int | None = None  # None: all
        if not self.is_controller():
            ctl = await self.store.get(self.keys.controller)
            if ctl is None:
                self.refusals.clear()
                return
            watched = ControllerRecord.decode(ctl).broker_id
        targets = []
        for kv in kvs:
            rec = BrokerRecord.decode(kv)
            if rec.broker_id != self.broker_id and kv.lease and watched in (None, rec.broker_id):
                targets.append((rec, kv.create_revision, kv.lease))
        results = await asyncio.gather(*(refused(rec.host, rec.port, self.interval_s)
                                         for rec, _, _ in targets))
        seen = set()
        for (rec, created, lease), was_refused in zip(targets, results, strict=True):
            key = (rec.broker_id, created)
            seen.add(key)
            if not was_refused:
                self.refusals.pop(key, None)
                continue
            n = self.refusals[key] = self.refusals.get(key, 0) + 1
            if n < REFUSALS:
                continue
            current = await self.store.get(self.keys.broker(rec.broker_id))
            if current is None or current.create_revision != created:
                continue  # gone or registered again meanwhile
            log.warning("broker %d refused %d connections in a row at %s:%d (no process "
                        "listens there): revoking its lease so that its queues move now",
                        rec.broker_id, n, rec.host, rec.port)
            await self.store.revoke_lease(lease)
            self.revoked.append(rec.broker_id)
            self.refusals.pop(key, None)
        for key in list(self.refusals):
            if key not in seen:
                del self.refusals[key]
