"""Model test of the cluster's control logic: the controller, the leaders' ISR changes and topic
creation, racing over one memory metadata store on a fake clock. No sockets, no broker.

Rules: brokers register (a new incarnation each time), crash (they stop renewing; the lease
runs out as the clock ticks) or stop (the lease revoked); controllers campaign, reconcile, move
preferred leaders and resign; a controller whose seat went away without its noticing (a zombie)
tries to write; leaders, with views of their queue that may be stale, shrink and grow the ISR;
topics are created (some allowing unclean elections).

Every successful write to a queue key is checked as it happens (the store is wrapped):

* the ISR is never empty and within the replicas; the leader is ``NO_LEADER`` or in the ISR;
* the leader epoch never goes back and goes up at every leader change;
* a controller's write succeeds only while it holds the seat: one broker per controller epoch,
  epochs in order; a controller never adds ISR members (except an unclean election);
* a leader's write keeps the leader and the epoch, and adds only live brokers.

After every step: the structural rules above over every queue; every leader is live or died
since the controller last reconciled; and once the seated controller has reconciled with nothing
changed since, every queue with a live ISR member has a live leader and no dead ISR member.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ferrymq.cluster.controller import Controller, is_unclean
from ferrymq.cluster.isr import change_isr
from ferrymq.cluster.metadata.memory import MemoryMetadataStore
from ferrymq.cluster.metadata.store import Check, KeyValue, Put
from ferrymq.cluster.model import NO_LEADER, ControllerRecord, Keys, QueueRecord, TopicRecord
from ferrymq.cluster.topics import create_topic, load_topics
from ferrymq.errors import (
    InvalidReplicationFactorError,
    NotControllerError,
    TopicAlreadyExistsError,
)
from ferrymq.testing import FakeClock
from tests.cluster.support import LEASE_TTL_S, YieldingStore, register

KEYS = Keys("m")
BROKERS = (1, 2, 3, 4)
CONTROLLERS = (1, 2, 3)
TOPICS = ("a", "b")
T = TypeVar("T")


class Audited(YieldingStore):
    """The store as one writer sees it: each successful write to a queue key is checked
    against the record it replaced (see the module docstring)."""

    def __init__(self, inner: MemoryMetadataStore, model: ControlModel, writer: str) -> None:
        super().__init__(inner)
        self.model = model
        self.writer = writer

    async def commit(self, checks: Sequence[Check], puts: Sequence[Put] = (),
                     deletes: Sequence[str] = ()) -> int | None:
        before = {p.key: self.inner._kvs.get(p.key) for p in puts}
        seat = self.inner._kvs.get(KEYS.controller)
        alive = self.model.registered()
        rev = await super().commit(checks, puts, deletes)
        if rev is not None:
            for p in puts:
                if p.key.startswith(KEYS.queues):
                    old = before[p.key]
                    self.model.audit(self.writer, p.key,
                                     QueueRecord.decode(old) if old is not None else None,
                                     QueueRecord.decode(self.inner._kvs[p.key]), seat, alive)
        return rev


class ControlModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock()
        self.store = MemoryMetadataStore(clock=self.clock.monotonic)
        self.leases: dict[int, int] = {}
        self.up: set[int] = set()
        self.controllers = {
            b: Controller(Audited(self.store, self, f"controller {b}"), KEYS, b,
                          lease_ttl_s=LEASE_TTL_S, clock=self.clock.monotonic,
                          lease_of=lambda b=b: self.leases[b])
            for b in CONTROLLERS}
        self.leader_stores = {b: Audited(self.store, self, f"leader {b}") for b in BROKERS}
        self.views: dict[tuple[int, str, int], QueueRecord] = {}
        self.writes_by_epoch: dict[int, set[int]] = {}
        self.last_write_epoch = 0
        self.last_campaign_epoch = 0
        self.settled = False
        self.died_since_reconcile: set[int] = set()
        self.unclean: dict[str, bool] = {}

    def teardown(self) -> None:
        self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def brokers(self) -> dict[int, KeyValue]:
        return {int(k[len(KEYS.brokers):]): kv for k, kv in self.store._kvs.items()
                if k.startswith(KEYS.brokers)}

    def registered(self) -> set[int]:
        return set(self.brokers())

    def _unregistered(self, brokers: set[int]) -> None:
        for b in brokers:
            self.leases.pop(b, None)
        if brokers:
            self.died_since_reconcile |= brokers
            self.settled = False

    # --- the audit of every write ------------------------------------------------------------

    def audit(self, writer: str, key: str, old: QueueRecord | None, new: QueueRecord,
              seat: Any, alive: set[int]) -> None:
        where = f"{writer} wrote {key}: {old} -> {new}"
        assert new.isr, where
        assert set(new.isr) <= set(new.replicas), where
        assert new.leader == NO_LEADER or new.leader in new.isr, where
        if old is None:
            return
        assert new.replicas == old.replicas, where
        if new.leader != old.leader:
            event("leader change " + ("to none" if new.leader == NO_LEADER else
                                      "from none" if old.leader == NO_LEADER else "moved"))
        assert new.leader_epoch >= old.leader_epoch, where
        if new.leader != old.leader:
            assert new.leader_epoch > old.leader_epoch, where
        kind, _, b = writer.partition(" ")
        if kind == "controller":
            assert seat is not None, where + " without a seat"
            held = ControllerRecord.decode(seat)
            assert held.broker_id == int(b), where + f" while {held} holds the seat"
            assert held.epoch >= self.last_write_epoch, where + " after a newer controller"
            self.last_write_epoch = held.epoch
            self.writes_by_epoch.setdefault(held.epoch, set()).add(held.broker_id)
            topic, _ = KEYS.parse_queue(key)
            if not self.unclean.get(topic, False):
                assert set(new.isr) <= set(old.isr), where + ": the ISR grew"
        else:
            assert (new.leader, new.leader_epoch) == (old.leader, old.leader_epoch), where
            assert old.leader == int(b), where + " by a broker that does not lead"
            assert set(new.isr) - set(old.isr) <= alive, where + ": a dead member added"

    @initialize(brokers=st.sets(st.sampled_from(BROKERS), min_size=2).filter(
                    lambda bs: bool(bs & set(CONTROLLERS))),
                queues=st.integers(1, 3), replicas=st.integers(1, 3), unclean=st.booleans())
    def cluster(self, brokers: set[int], queues: int, replicas: int, unclean: bool) -> None:
        for b in sorted(brokers):
            self.start_broker(b)
        self.create("a", queues, replicas, unclean, 0)
        self.controller_runs(min(brokers & set(CONTROLLERS)))

    # --- brokers -------------------------------------------------------------------------------

    @rule(data=st.data())
    def restart_a_broker(self, data: st.DataObject) -> None:
        """A broker that is down starts (a new incarnation)."""
        down = [b for b in BROKERS if b not in self.registered()]
        if down:
            self.start_broker(data.draw(st.sampled_from(down)))

    def start_broker(self, b: int) -> None:
        if b in self.registered():
            return
        self.leases[b] = self.run(register(self.store, KEYS, b))
        self.up.add(b)
        self.settled = False

    @rule(b=st.sampled_from(BROKERS))
    def crash_broker(self, b: int) -> None:
        """It stops renewing (its lease runs out as the clock ticks); a zombie until then."""
        self.up.discard(b)

    @rule(b=st.sampled_from(BROKERS))
    def kill_broker(self, b: int) -> None:
        """kill -9: it stops renewing and time passes until its lease is gone."""
        self.up.discard(b)
        self.tick(2.5)
        self.tick(2.5)

    @rule(b=st.sampled_from(BROKERS))
    def stop_broker(self, b: int) -> None:
        if b in self.leases:
            self.up.discard(b)
            self.run(self.store.revoke_lease(self.leases[b]))
            self._unregistered({b})

    @rule(seconds=st.sampled_from([1.0, 2.5]))
    def tick(self, seconds: float) -> None:
        """Time passes (less than a TTL): live brokers renew, crashed ones' leases run out."""
        self.clock.advance(seconds)
        before = self.registered()
        self.store.expire_leases()
        for b in sorted(self.up):
            self.run(self.store.keep_alive(self.leases[b]))
        self._unregistered(before - self.registered())

    # --- topics --------------------------------------------------------------------------------

    @rule(name=st.sampled_from(TOPICS), queues=st.integers(1, 3), replicas=st.integers(1, 3),
          unclean=st.booleans(), start=st.integers(0, 3))
    def create(self, name: str, queues: int, replicas: int, unclean: bool, start: int) -> None:
        config = {"unclean_leader_election": "true"} if unclean else {}
        exists = KEYS.topic(name) in self.store._kvs
        try:
            t = self.run(create_topic(self.store, KEYS, name, queues, replicas, 1, config,
                                      0, start=start))
        except TopicAlreadyExistsError:
            assert exists
            return
        except InvalidReplicationFactorError:
            assert replicas > len(self.registered())
            return
        assert not exists and replicas <= len(self.registered())
        self.unclean[name] = is_unclean(t)

    # --- controllers ---------------------------------------------------------------------------

    def seat(self) -> ControllerRecord | None:
        kv = self.store._kvs.get(KEYS.controller)
        return None if kv is None else ControllerRecord.decode(kv)

    @rule(c=st.sampled_from(CONTROLLERS))
    def campaign(self, c: int) -> None:
        if c not in self.registered():
            return
        before = self.seat()
        won = self.run(self.controllers[c].campaign())
        after = self.seat()
        assert after is not None
        assert won == (after.broker_id == c)
        if after != before:
            assert after.epoch > self.last_campaign_epoch
            self.last_campaign_epoch = after.epoch
            self.settled = False

    @rule(c=st.sampled_from(CONTROLLERS))
    def controller_runs(self, c: int) -> None:
        """What :meth:`Controller.run` does: campaign, and serve if elected."""
        self.campaign(c)
        if self.controllers[c].active:
            self.reconcile(c)

    @rule(c=st.sampled_from(CONTROLLERS))
    def reconcile(self, c: int) -> None:
        ctl = self.controllers[c]
        held = self.seat()
        incarnations = {b: kv.create_revision for b, kv in self.brokers().items()}
        _, before = self.queues()
        try:
            self.run(ctl.reconcile())
        except NotControllerError:
            assert held is None or held.broker_id != c or held.epoch != ctl.epoch
            assert not ctl.active
            return
        assert held is not None and held.broker_id == c
        _, after = self.queues()
        for tq, old in before.items():
            for b in old.isr:
                if incarnations.get(b, 0) < old.version:
                    continue
                # b restarted since it was put in the ISR: it lost its memory, so it is out
                # of the ISR now, or (the last member) leads again at a new epoch
                new = after[tq]
                assert b not in new.isr or new.leader_epoch > old.leader_epoch, (b, old, new)
        self.settled = True
        self.died_since_reconcile = set()
        event("reconciled")

    @rule(c=st.sampled_from(CONTROLLERS), data=st.data())
    def zombie_write(self, c: int, data: st.DataObject) -> None:
        """A controller that lost its seat without noticing decides on a fresh record: only
        the check of its seat stops the write."""
        ctl = self.controllers[c]
        kv = self.store._kvs.get(KEYS.controller)
        if not ctl.active or (kv is not None and kv.mod_revision == ctl.seat):
            return
        queues = sorted(k for k in self.store._kvs if k.startswith(KEYS.queues))
        if not queues:
            return
        key = data.draw(st.sampled_from(queues))
        topic, q = KEYS.parse_queue(key)
        record = QueueRecord.decode(self.store._kvs[key])
        revision = self.store.revision
        try:
            self.run(ctl._update(topic, q, record, lambda r: r.with_leader(NO_LEADER)))
        except NotControllerError:
            pass
        else:
            raise AssertionError("a zombie controller's write did not fail")
        event("zombie controller fenced")
        assert self.store.revision == revision and not ctl.active

    @rule(c=st.sampled_from(CONTROLLERS))
    def preferred_leaders(self, c: int) -> None:
        try:
            self.run(self.controllers[c].elect_preferred_leaders())
        except NotControllerError:
            assert not self.controllers[c].active

    @rule(c=st.sampled_from(CONTROLLERS))
    def resign(self, c: int) -> None:
        ctl = self.controllers[c]
        was = self.seat()
        self.run(ctl.resign())
        if was is not None and was.broker_id == c and was.epoch == ctl.epoch:
            assert self.seat() is None
            self.settled = False

    # --- leaders -------------------------------------------------------------------------------

    def queue_keys(self) -> list[str]:
        return sorted(k for k in self.store._kvs if k.startswith(KEYS.queues))

    @rule(b=st.sampled_from(BROKERS), data=st.data())
    def leader_reads(self, b: int, data: st.DataObject) -> None:
        """Broker ``b`` learns a queue's record (its view may go stale after)."""
        keys = self.queue_keys()
        if keys:
            key = data.draw(st.sampled_from(keys))
            self.views[(b, *KEYS.parse_queue(key))] = QueueRecord.decode(self.store._kvs[key])

    def _isr_change(self, data: st.DataObject, grow: bool, reread: bool, near: int | None = None,
                    ) -> tuple[int, str, int, QueueRecord, list[int]] | None:
        """An ISR change some leader would make by the record it last read (or reads first):
        (leader, topic, queue, its view, the new ISR), or None. ``near``: preferably of a queue
        whose view has that broker in the ISR."""
        if reread:
            for (b, topic, q) in list(self.views):
                kv = self.store._kvs.get(KEYS.queue(topic, q))
                if kv is not None:
                    self.views[(b, topic, q)] = QueueRecord.decode(kv)
            for key in self.queue_keys():
                r = QueueRecord.decode(self.store._kvs[key])
                if r.leader != NO_LEADER:
                    self.views[(r.leader, *KEYS.parse_queue(key))] = r
        mine = sorted((k, v) for k, v in self.views.items() if v.leader == k[0])
        mine = [(k, v) for k, v in mine if near in v.isr] or mine
        if not mine:
            return None
        (b, topic, q), view = data.draw(st.sampled_from(mine))
        if grow:
            outside = [r for r in view.replicas if r not in view.isr]
            if not outside:
                return None
            return b, topic, q, view, [*view.isr, data.draw(st.sampled_from(outside))]
        followers = [r for r in view.isr if r != b]
        if not followers:
            return None
        drop = data.draw(st.sampled_from(followers))
        return b, topic, q, view, [r for r in view.isr if r != drop]

    def _isr_changed(self, b: int, topic: str, q: int, written: QueueRecord | None) -> None:
        event(f"leader ISR change: {'stale' if written is None else 'written'}")
        if written is None:
            del self.views[(b, topic, q)]  # the leader re-reads (and steps down if replaced)
        else:
            self.views[(b, topic, q)] = written

    @rule(data=st.data(), grow=st.booleans(), reread=st.booleans())
    def leader_changes_isr(self, data: st.DataObject, grow: bool, reread: bool) -> None:
        """A leader (live or a zombie) changes the ISR by the record it last read (or reads
        it first)."""
        change = self._isr_change(data, grow, reread)
        if change is None:
            return
        b, topic, q, view, new_isr = change
        current = self.store._kvs.get(KEYS.queue(topic, q))
        fresh = current is not None and current.mod_revision == view.version
        written = self.run(change_isr(self.leader_stores[b], KEYS, topic, q, view, new_isr))
        assert written is None or fresh or written is view
        self._isr_changed(b, topic, q, written)

    @rule(c=st.sampled_from(CONTROLLERS), data=st.data(), grow=st.booleans(),
          reread=st.booleans(), delay=st.integers(-3, 3),
          kill=st.none() | st.sampled_from(BROKERS))
    def controller_races_a_leader(self, c: int, data: st.DataObject, grow: bool, reread: bool,
                                  delay: int, kill: int | None) -> None:
        """A controller's reconcile and a leader's ISR change run at once, interleaved at every
        store call (the leader starting ``delay`` yields later; < 0: the controller starting
        ``-delay`` yields later), just after broker ``kill`` died
        (so the controller has something to do)."""
        ctl = self.controllers[c]
        if kill is not None and kill != c:
            self.kill_broker(kill)
        change = self._isr_change(data, grow, reread, kill)
        if change is None or not ctl.active:
            return
        b, topic, q, view, new_isr = change

        async def leader() -> QueueRecord | None:
            for _ in range(delay):
                await asyncio.sleep(0)
            return await change_isr(self.leader_stores[b], KEYS, topic, q, view, new_isr)

        async def controller() -> bool:
            for _ in range(-delay):
                await asyncio.sleep(0)
            try:
                await ctl.reconcile()
            except NotControllerError:
                return False
            return True

        async def both() -> tuple[bool, QueueRecord | None]:
            return await asyncio.gather(controller(), leader())

        store = ctl.store
        assert isinstance(store, Audited)
        lost = store.failed_commits
        served, written = self.run(both())
        self._isr_changed(b, topic, q, written)
        if served and store.failed_commits > lost:
            event("controller decided again after losing a CAS to a leader")
        if served:
            self.settled = True
            self.died_since_reconcile = set()

    # --- invariants ----------------------------------------------------------------------------

    def queues(self) -> tuple[dict[str, TopicRecord], dict[tuple[str, int], QueueRecord]]:
        topics, queues, _ = self.run(load_topics(self.store, KEYS))
        return topics, queues

    @invariant()
    def queue_records_are_well_formed(self) -> None:
        alive = self.registered()
        _, queues = self.queues()
        for tq, r in queues.items():
            assert r.isr and set(r.isr) <= set(r.replicas), (tq, r)
            assert r.leader == NO_LEADER or r.leader in r.isr, (tq, r)
            assert (r.leader == NO_LEADER or r.leader in alive
                    or r.leader in self.died_since_reconcile), (tq, r, alive)

    @invariant()
    def one_controller_per_epoch(self) -> None:
        assert all(len(bs) == 1 for bs in self.writes_by_epoch.values()), self.writes_by_epoch

    @invariant()
    def after_a_reconcile_every_queue_with_a_live_isr_member_is_led(self) -> None:
        if not self.settled:
            return
        alive = self.registered()
        _, queues = self.queues()
        for (name, q), r in queues.items():
            if r.leader == NO_LEADER:
                assert not set(r.isr) & alive, (name, q, r, alive)
                if self.unclean.get(name, False):
                    assert not set(r.replicas) & alive, (name, q, r, alive)
            else:
                assert r.leader in alive and set(r.isr) <= alive, (name, q, r, alive)


ControlModel.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_control_model = ControlModel.TestCase
