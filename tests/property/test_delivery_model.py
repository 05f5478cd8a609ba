"""Model test of a delivery group's state machine over its pure objects: no socket, no broker,
no log. ``DeliveryGroup`` with its cursors (``SourceCursor`` or ``OrderlyCursor``, and the
``RetryCursor``) is driven the way the broker's collaborators drive it (receiving.py, settling.py,
moves.py, lifecycle.py, the manager's tick), with the queue, the retry queue, the scheduler and
the dead-letter queue as lists.

Rules: produce, a member joins, leaves (its leases go back uncounted) or is evicted (counted),
RECEIVE (due retry letters first, then the queue: FIFO, or the heads of sharding keys), ACK
(also with receipts that are no longer current), NACK, CHANGE_INVISIBLE, time passes (leases
expire, the scheduler makes due retry letters visible, orderly backoffs end), and a restart
(the group read back from its snapshot, as recovery.py does, without its members).

Invariants: a message is never leased twice at once (to two members, or twice to one); an acked
message is never delivered again; a delivery carries the attempts that failed so far, and a
failure dead-letters the message exactly when they exceed max_reconsume (else it is retried: in
place in an orderly queue, through the retry queue otherwise); every message is in exactly one
place (waiting in its queue, leased, in the retry queue or the scheduler, acked, or
dead-lettered); every lease and member count agrees with the cursors; orderly: per sharding key at
most one message in flight, its key's head, delivered only after every earlier message of its
key finished (send order).
At the end one member drains the group: every message ends acked or dead-lettered.
"""

from __future__ import annotations

from collections import Counter

import msgpack
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ferrymq.broker.delivery.group import (
    DEFAULT_MAX_RECONSUME,
    DEFAULT_RETRY_DELAYS_MS,
    DeliveryGroup,
    DeliveryMember,
    FailureOutcome,
    split_receipts,
)
from ferrymq.broker.delivery.orderly import Failure, OrderlyCursor
from ferrymq.broker.delivery.replay import Replay, snapshot
from ferrymq.broker.delivery.state import Lease, SourceCursor
from ferrymq.protocol.letters import Letter

TOPIC = "t"
KEY = (TOPIC, 0)
KEYS = ["", "a", "b", "c"]  # "": no sharding key
MEMBERS = ["m0", "m1", "m2"]
LADDER = [10, 30, 0]  # ms; 0: a retry due at once
ORDERLY_RETRY_MS = 20
MAX_RETRY_LOADED = 4  # letters the retry cursor reads ahead of receivers
MAX_ORDERLY_HELD = 3  # messages one queue holds back behind busy keys


class DeliveryModel(RuleBasedStateMachine):
    """One delivery group over one queue, its retry queue and its dead-letter queue."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1_000  # monotonic ms (wall ms too: the model's clock has one time)
        self.next_lease = 1
        self.source: list[str] = []  # sharding key per offset; a message's id is its offset
        self.retry_log: list[Letter] = []  # the retry queue's visible letters, by offset
        self.scheduled: list[tuple[int, Letter]] = []  # (due, letter): the scheduler's
        self.dead: list[Letter] = []
        self.acked: set[int] = set()
        self.attempts: Counter[int] = Counter()  # failed attempts that count, per message
        self.receipts: list[tuple[tuple[str, int], int, int]] = []  # every (key, offset, lease id)
        self.g = DeliveryGroup("g", list(DEFAULT_RETRY_DELAYS_MS), DEFAULT_MAX_RECONSUME)

    @initialize(orderly=st.booleans(), max_reconsume=st.integers(0, 3))
    def create_group(self, orderly: bool, max_reconsume: int) -> None:
        g = self.g
        g.set_policy(LADDER, max_reconsume, -2, orderly, False)
        g.sources[KEY] = g.new_cursor(TOPIC, 0, 0)

    # -- what the broker does, on the pure objects ------------------------------------------------

    @property
    def retry_key(self) -> tuple[str, int]:
        return (self.g.retry_topic, 0)

    def origin(self, key: tuple[str, int], offset: int) -> int:
        """The message (its source offset) at ``offset`` of queue ``key``."""
        return offset if key == KEY else self.retry_log[offset].offset

    def new_lease(self, member: str, key: tuple[str, int], deadline: int, reconsume: int) -> Lease:
        lease = Lease(self.next_lease, member, key, deadline, reconsume)
        self.next_lease += 1
        return lease

    def delivered(self, key: tuple[str, int], offsets: list[int], lease: Lease) -> None:
        """Checks at the moment of a delivery."""
        assert lease.reconsume <= self.g.max_reconsume, "delivered after its last attempt"
        for o in offsets:
            msg = self.origin(key, o)
            assert lease.reconsume == self.attempts[msg], f"message {msg}: attempts miscounted"
            assert msg not in self.acked, f"message {msg} delivered again after its ack"
            assert all(d.offset != msg for d in self.dead), f"dead message {msg} delivered"
            if self.g.orderly and key == KEY and self.source[msg]:
                k = self.source[msg]
                earlier = [e for e in range(msg) if self.source[e] == k]
                unfinished = [e for e in earlier if e not in self.acked
                              and all(d.offset != e for d in self.dead)]
                assert not unfinished, f"key {k!r}: {msg} delivered before {unfinished}"
            self.receipts.append((key, o, lease.lease_id))

    def receive(self, member: str, room: int, invisible: int) -> None:
        """RECEIVE as receiving.py does it: due retry letters first, then the queue."""
        g = self.g
        deadline = self.now + invisible
        rc = g.retry
        while rc.next < len(self.retry_log) and len(rc.ready) < MAX_RETRY_LOADED:
            o = rc.next
            rc.passed(o, o, plain=True)
            if o in rc.done:
                rc.done.discard(o)
            elif o in rc.leased:
                rc.track(o)
            else:
                rc.add(o, self.retry_log[o])
        rc.advance_floor()
        for off in list(rc.ready)[:room]:
            lease = self.new_lease(member, self.retry_key, deadline, rc.ready[off].reconsume)
            g.grant_letter(off, lease)
            self.delivered(self.retry_key, [off], lease)
            room -= 1
        cur = g.sources[KEY]
        if isinstance(cur, SourceCursor):
            offsets = list(range(cur.next, min(len(self.source), cur.next + max(room, 0))))
            if offsets:
                lease = self.new_lease(member, KEY, deadline, 0)
                g.grant(cur, offsets, lease)
                self.delivered(KEY, offsets, lease)
                cur.skip_to(offsets[-1] + 1)
            return
        assert isinstance(cur, OrderlyCursor)
        ready = cur.take_ready(self.now)
        if len(ready) > max(room, 0):
            cur.unready(ready[max(room, 0):])
            del ready[max(room, 0):]
        taken: dict[int, list[int]] = {}
        for off in ready:
            f = cur.failures.get(off)
            taken.setdefault(f.reconsume if f is not None else 0, []).append(off)
        n = len(ready)
        fresh = taken.setdefault(0, [])
        while cur.next < len(self.source) and n < room and cur.held_count < MAX_ORDERLY_HELD:
            o = cur.next
            if cur.examine(o, self.source[o]):
                fresh.append(o)
                n += 1
        for reconsume, offs in taken.items():
            if offs:
                lease = self.new_lease(member, KEY, deadline, reconsume)
                g.grant(cur, offs, lease)
                self.delivered(KEY, offs, lease)
        cur.advance_floor()

    def ack(self, key: tuple[str, int], offsets: list[int], lease_id: int) -> list[int]:
        """ACK as settling.py does it; the offsets acked."""
        g = self.g
        cursor = g.cursor(key)
        assert cursor is not None
        done, refused, held = split_receipts(cursor, offsets, lease_id)
        assert sorted(done + refused) == sorted(offsets)
        if held is not None:
            self.acked.update(self.origin(key, o) for o in done)
            g.settle(cursor, done, held)
        return done

    def fail(self, key: tuple[str, int], offset: int, lease: Lease, *, counts: bool,
             delay_ms: int, reason: str) -> None:
        """A failed delivery, as moves.py moves it (a letter's copy written at once)."""
        g = self.g
        reconsume = lease.reconsume + (1 if counts else 0)
        outcome = g.failure_outcome(key, reconsume, dead=False)
        msg = self.origin(key, offset)
        self.attempts[msg] += counts
        exhausted = self.attempts[msg] > g.max_reconsume
        assert (outcome is FailureOutcome.DEAD) == exhausted, f"{msg}: {outcome} after " \
            f"{self.attempts[msg]} attempts, max_reconsume {g.max_reconsume}"
        assert (outcome is FailureOutcome.IN_PLACE) == (g.orderly and key == KEY
                                                        and not exhausted), outcome
        if outcome is FailureOutcome.IN_PLACE:
            cur = g.sources[key]
            assert isinstance(cur, OrderlyCursor)
            delay = ORDERLY_RETRY_MS if delay_ms < 0 else delay_ms
            old = cur.failures.get(offset)
            f = Failure(reconsume, self.now + delay,
                        old.since_wall if old is not None else self.now, reason)
            g.fail_in_place(cur, offset, f, self.now)
            return
        letter = Letter(TOPIC, 0, msg, str(msg), reconsume, self.now, reason)
        if outcome is FailureOutcome.DEAD:
            self.dead.append(letter._replace(dead_wall=self.now))
        else:
            due = self.now + (g.retry_delay_ms(reconsume) if delay_ms < 0 else delay_ms)
            if due > self.now:
                self.scheduled.append((due, letter._replace(due_wall=due)))
            else:
                self.retry_log.append(letter)
        g.finish(key, offset)
        g.advance_floor(key)

    def fail_lease(self, lease: Lease, *, counts: bool, reason: str) -> None:
        for off in sorted(lease.offsets):
            self.fail(lease.key, off, lease, counts=counts, delay_ms=0, reason=reason)

    def member_gone(self, member: str, *, counts: bool) -> None:
        """A member left or was evicted: its leases go back (lifecycle.py)."""
        g = self.g
        del g.members[member]
        g.hand_back(member, counts=counts, reason="gone")
        ret = g.returning
        while ret:
            lease, c, reason = ret[0]
            self.fail_lease(lease, counts=c, reason=reason)
            ret.popleft()
        assert not any(ls.member == member for ls in g.leases.values()), "leases kept"

    def pass_time(self, dt: int) -> None:
        """Time passes: due letters become visible, expired leases fail (the manager's tick)."""
        self.now += dt
        due = sorted((d for d in self.scheduled if d[0] <= self.now), key=lambda d: d[0])
        self.scheduled = [d for d in self.scheduled if d[0] > self.now]
        self.retry_log.extend(letter for _, letter in due)
        for lease in self.g.expired(self.now):
            self.fail_lease(lease, counts=True, reason="lease expired before an ack")

    # -- rules ------------------------------------------------------------------------------------

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6))
    def produce(self, keys: list[str]) -> None:
        self.source.extend(keys)

    @rule(member=st.sampled_from(MEMBERS))
    def join(self, member: str) -> None:
        if member not in self.g.members:
            self.g.members[member] = DeliveryMember(member, member, "h", self.now, 10_000,
                                                    [(TOPIC, "*")])

    @precondition(lambda self: self.g.members)
    @rule(data=st.data(), counts=st.booleans())
    def member_leaves(self, data: st.DataObject, counts: bool) -> None:
        member = data.draw(st.sampled_from(sorted(self.g.members)))
        self.member_gone(member, counts=counts)

    @precondition(lambda self: self.g.members)
    @rule(data=st.data(), room=st.integers(1, 8), invisible=st.integers(1, 300))
    def receive_messages(self, data: st.DataObject, room: int, invisible: int) -> None:
        member = data.draw(st.sampled_from(sorted(self.g.members)))
        self.receive(member, room, invisible)

    @precondition(lambda self: self.g.leases)
    @rule(data=st.data())
    def ack_messages(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(sorted(self.g.leases.values(), key=lambda x: x.lease_id)))
        offsets = data.draw(st.lists(st.sampled_from(sorted(lease.offsets)), min_size=1,
                                     unique=True))
        assert self.ack(lease.key, offsets, lease.lease_id) == offsets

    def stale_receipts(self) -> list[tuple[tuple[str, int], int, int]]:
        return [r for r in self.receipts if self.g.lease_of(*r) is None]

    @precondition(lambda self: self.stale_receipts())
    @rule(data=st.data())
    def ack_with_an_old_receipt(self, data: st.DataObject) -> None:
        key, offset, lease_id = data.draw(st.sampled_from(self.stale_receipts()))
        before = (sorted(self.g.leases), dict(self.g.in_flight), set(self.acked))
        assert self.ack(key, [offset], lease_id) == [], "a receipt no longer current acked"
        assert (sorted(self.g.leases), dict(self.g.in_flight), set(self.acked)) == before

    @precondition(lambda self: self.g.leases)
    @rule(data=st.data(), counts=st.booleans(), delay=st.sampled_from([-1, 0, 15]))
    def nack(self, data: st.DataObject, counts: bool, delay: int) -> None:
        lease = data.draw(st.sampled_from(sorted(self.g.leases.values(), key=lambda x: x.lease_id)))
        offset = data.draw(st.sampled_from(sorted(lease.offsets)))
        assert self.g.lease_of(lease.key, offset, lease.lease_id) is lease
        self.fail(lease.key, offset, lease, counts=counts, delay_ms=delay, reason="nack")

    @precondition(lambda self: self.g.leases)
    @rule(data=st.data(), invisible=st.integers(1, 300))
    def change_invisible(self, data: st.DataObject, invisible: int) -> None:
        old = data.draw(st.sampled_from(sorted(self.g.leases.values(), key=lambda x: x.lease_id)))
        offsets = data.draw(st.lists(st.sampled_from(sorted(old.offsets)), min_size=1,
                                     unique=True))
        lease = self.new_lease(old.member, old.key, self.now + invisible, old.reconsume)
        self.g.renew(old.key, [(old, o) for o in offsets], lease)
        for o in offsets:
            self.receipts.append((old.key, o, lease.lease_id))
            assert self.g.lease_of(old.key, o, old.lease_id) is None  # the old receipt is void

    @rule(dt=st.integers(0, 400))
    def time_passes(self, dt: int) -> None:
        self.pass_time(dt)

    @precondition(lambda self: self.g.members)
    @rule(data=st.data())
    def member_evicted(self, data: st.DataObject) -> None:
        member = data.draw(st.sampled_from(sorted(self.g.members)))
        self.member_gone(member, counts=True)

    @rule()
    def restart(self) -> None:
        """The group as recovery.py reads it back from its snapshot (members are not kept)."""
        g = self.g
        snap = snapshot(g, lambda t: t, self.next_lease)
        snap = msgpack.unpackb(msgpack.packb(snap, use_bin_type=True), raw=False,
                               strict_map_key=False)  # as the store writes and reads it
        g2 = DeliveryGroup(g.name, list(DEFAULT_RETRY_DELAYS_MS), DEFAULT_MAX_RECONSUME)
        replay = Replay(lambda t: t, 100, 1)
        replay.apply_snapshot(g2, snap)
        for cur in g2.sources.values():
            if isinstance(cur, OrderlyCursor):
                cur.rebuild({o: self.source[o] for o in cur.pending}, self.now)
            cur.advance_floor()
        rc = g2.retry
        rc.restore([(o, self.retry_log[o], None) for o in sorted(rc.reload)],
                   {o: self.retry_log[o] for o in rc.leased})
        rc.advance_floor()
        assert (g2.orderly, g2.max_reconsume, g2.retry_delays_ms) == \
            (g.orderly, g.max_reconsume, g.retry_delays_ms)
        assert {i: (ls.member, ls.deadline, ls.reconsume, ls.offsets) for i, ls in g2.leases.items()} \
            == {i: (ls.member, ls.deadline, ls.reconsume, ls.offsets) for i, ls in g.leases.items()}
        self.g = g2
        self.next_lease = replay.next_lease

    # -- invariants -------------------------------------------------------------------------------

    def source_unfinished(self, msg: int) -> bool:
        cur = self.g.sources[KEY]
        if msg >= cur.next:
            return True
        return msg in (cur.pending if isinstance(cur, OrderlyCursor) else cur.leased)

    def letter_unfinished(self, offset: int) -> bool:
        rc = self.g.retry
        if offset in rc.ready or offset in rc.leased:
            return True
        return offset >= rc.next and offset not in rc.done

    @invariant()
    def leases_agree_with_cursors(self) -> None:
        g = self.g
        cursors = [(KEY, g.sources[KEY]), (self.retry_key, g.retry)] if g.sources else []
        for key, cur in cursors:
            for o, lease in cur.leased.items():
                assert lease.key == key and o in lease.offsets
                assert g.leases.get(lease.lease_id) is lease, "a leased offset of a lost lease"
        per_member: Counter[str] = Counter()
        for lease_id, lease in g.leases.items():
            assert lease.lease_id == lease_id and lease.offsets, "an empty lease is kept"
            cur = g.cursor(lease.key)
            assert cur is not None
            for o in lease.offsets:
                assert cur.leased.get(o) is lease, f"{lease.key}@{o} is in two leases"
            per_member[lease.member] += len(lease.offsets)
        assert {m: n for m, n in g.in_flight.items() if n} == dict(per_member)

    @invariant()
    def never_leased_twice_at_once(self) -> None:
        g = self.g
        if not g.sources:
            return
        held = Counter(self.origin(KEY, o) for o in g.sources[KEY].leased)
        held.update(self.origin(self.retry_key, o) for o in g.retry.leased)
        assert all(n == 1 for n in held.values()), f"leased twice: {held.most_common(1)}"

    @invariant()
    def every_message_in_exactly_one_place(self) -> None:
        if not self.g.sources:
            return
        places: Counter[int] = Counter()
        for msg in range(len(self.source)):
            places[msg] += self.source_unfinished(msg)
        for r, letter in enumerate(self.retry_log):
            places[letter.offset] += self.letter_unfinished(r)
        places.update(letter.offset for _, letter in self.scheduled)
        places.update(self.acked)
        places.update(letter.offset for letter in self.dead)
        for msg in range(len(self.source)):
            assert places[msg] == 1, f"message {msg} is in {places[msg]} places"

    @invariant()
    def floors_are_below_every_unfinished_message(self) -> None:
        if not self.g.sources:
            return
        cur = self.g.sources[KEY]
        assert not any(self.source_unfinished(o) for o in range(min(cur.floor, len(self.source))))
        rc = self.g.retry
        assert not any(self.letter_unfinished(o) for o in range(min(rc.floor, len(self.retry_log))))

    @invariant()
    def orderly_one_head_per_key_in_flight(self) -> None:
        cur = self.g.sources.get(KEY)
        if not isinstance(cur, OrderlyCursor):
            return
        in_flight = Counter(self.source[o] for o in cur.leased if self.source[o])
        assert all(n == 1 for n in in_flight.values()), f"two in flight: {in_flight}"
        for o in [*cur.leased, *cur.failures]:
            k = self.source[o]
            assert not k or cur.heads.get(k) == o, f"{o} of key {k!r} is not its head"

    # -- the end ----------------------------------------------------------------------------------

    def teardown(self) -> None:
        """One member drains the group: nothing is stuck, nothing is lost."""
        g = self.g
        if not g.sources:
            return
        self.join("drainer")
        for _ in range(20 + 4 * len(self.source)):
            self.pass_time(100_000)  # past every lease, backoff and retry delay
            self.receive("drainer", 1_000, 1_000)
            for lease in sorted(g.leases.values(), key=lambda x: x.lease_id):
                if lease.member == "drainer":
                    self.ack(lease.key, sorted(lease.offsets), lease.lease_id)
            g = self.g
            if not g.leases and not self.scheduled and not any(
                    self.source_unfinished(m) for m in range(len(self.source))) and not any(
                    self.letter_unfinished(r) for r in range(len(self.retry_log))):
                break
        dead = {letter.offset for letter in self.dead}
        assert not self.acked & dead
        assert self.acked | dead == set(range(len(self.source))), "messages left behind"


DeliveryModel.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_delivery_model = DeliveryModel.TestCase
