"""Model test of the real DeliveryManager without a socket or a broker process: its real logs
and journals in a temporary directory, a FakeClock, async flush (the flusher thread is not
started: nothing waits for an fsync), driven by the calls the handlers make.

Rules: produce (messages with sharding keys, a key always to the same queue), a member joins
(DELIVERY_HEARTBEAT) or leaves, RECEIVE, ACK (one or more messages of a lease), NACK,
CHANGE_INVISIBLE, the three with receipts no longer current, time passes (the manager's tick:
expired leases), MESSAGE_STATUS, redriving or purging dead letters (one chosen letter by its
offset, or the oldest n; an offset that is no live letter is refused), and a restart (clean:
snapshots; or as after kill -9: the journals replayed).

Invariants, on what the consumers see: a message is never leased twice at once; an acked
message is never delivered again; no message is delivered after its last attempt; an orderly
group delivers a key's messages one at a time in send order; a good receipt is accepted, and a
stale one refused without changing anything; MESSAGE_STATUS agrees; DESCRIBE_DELIVERY's
in-flight counts are the good receipts; the DLQ depth and the dry runs count the dead letters
the model says are live; a purged message is never delivered again. At the end one member
drains the group: every message ends acked, dead-lettered or purged, and DESCRIBE_DELIVERY
reports no lag.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ferrymq.broker.config import BrokerConfig
from ferrymq.broker.delivery import DeliveryManager
from ferrymq.broker.flusher import Flusher
from ferrymq.broker.scheduler import Scheduler
from ferrymq.broker.topics import TopicRegistry
from ferrymq.errors import InvalidOffsetError
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.letters import parse_letter
from ferrymq.protocol.records import (
    Record,
    RecordInput,
    decode_records,
    encode_batch,
    encode_msg_id,
)
from ferrymq.storage import LogConfig
from ferrymq.testing import FakeClock

GROUP = "g"
SUBS = [("t", "*")]
KEYS = {"": None, "a": 0, "b": 1, "c": 0}  # sharding key -> its queue (None: any)
MEMBERS = ["m0", "m1", "m2"]
SESSION_MS = 600_000

Receipt = tuple[str, int, int, int, bytes, str]  # topic, queue, offset, lease id, body, member


class ManagerModel(RuleBasedStateMachine):
    """One delivery group of a real DeliveryManager over a topic of two queues."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ferrymq-delivery-model-"))
        self.clock = FakeClock()
        self.loop = asyncio.new_event_loop()  # the flusher's; never run (async flush)
        self.config = BrokerConfig(data_dir=str(self.dir), flush="async", max_retry_loaded=4,
                                   max_orderly_held=3, orderly_retry_ms=20).validate()
        self.open()
        self.topics.create("t", 2, {}, self.clock.wall_ms())
        self.orderly = False
        self.max_reconsume = 0
        self.members: set[str] = set()
        self.sent: list[tuple[bytes, str]] = []  # (body, key) in send order
        self.acked: set[bytes] = set()
        self.receipts: list[Receipt] = []
        self.dlq_gone: set[int] = set()  # DLQ offsets redriven or purged
        self.purged: set[bytes] = set()
        self.n = 0

    def open(self) -> None:
        self.topics = TopicRegistry(self.dir, LogConfig(), sync_visibility=False,
                                    clean_shutdown=False, max_queues=8)
        self.topics.open_all(self.clock.wall_ms())
        flusher = Flusher(self.loop, sync=False, interval_ms=1000)
        scheduler = Scheduler(self.config, self.topics, flusher, self.clock, self.dir)
        self.dm = DeliveryManager(self.config, self.topics, flusher, self.clock, self.dir,
                                  scheduler)
        self.dm.load()

    def teardown(self) -> None:
        try:
            self.drain()
        finally:
            self.dm.close()
            self.topics.close()
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers ----------------------------------------------------------------------------------

    def heartbeat(self, member: str) -> None:
        self.dm.heartbeat(GROUP, member, member, "h", SUBS, SESSION_MS, [0], self.max_reconsume,
                          -2, self.orderly)
        self.members.add(member)

    def current(self) -> list[Receipt]:
        g = self.dm.group(GROUP)
        return [r for r in self.receipts if g.lease_of((r[0], r[1]), r[2], r[3]) is not None]

    def stale(self) -> list[Receipt]:
        current = set(self.current())
        return [r for r in self.receipts if r not in current]

    def dlq_records(self) -> list[Record]:
        """Every record of the DLQ, redriven and purged ones too."""
        t = self.topics.topics.get(f"%DLQ%{GROUP}")
        if t is None:
            return []
        lg = t.queues[0].log
        return decode_records(lg.read(lg.start_offset, 1 << 24))

    def dead_letters(self) -> list[Record]:
        """The live dead letters, by the model: not redriven or purged."""
        return [r for r in self.dlq_records() if r.offset not in self.dlq_gone]

    def dead(self) -> set[bytes]:
        return {r.body for r in self.dead_letters()}

    def receive(self, member: str, room: int, invisible_ms: int) -> int:
        g = self.dm.group(GROUP)
        leased = {r[4] for r in self.current()}
        out, _pos = self.dm.receive(g, member, SUBS, room, 1 << 20, invisible_ms)
        dead = {r.body for r in self.dlq_records()}  # once dead, its key moved on
        got = 0
        for topic, queue, _tid, lease_id, reconsume, first, last, batches in out:
            assert reconsume <= self.max_reconsume, "delivered after its last attempt"
            for r in decode_records(batches):
                if not first <= r.offset <= last:  # whole stored batches: the client skips
                    continue
                body = r.body
                assert body not in self.acked, f"{body!r} delivered again after its ack"
                assert body not in self.purged, f"{body!r} delivered after it was purged"
                assert body not in leased, f"{body!r} leased twice at once"
                leased.add(body)
                key = dict(self.sent)[body]
                if self.orderly and key:
                    earlier = [b for b, k in self.sent[:self.sent.index((body, key))] if k == key]
                    waiting = [b for b in earlier if b not in self.acked and b not in dead]
                    assert not waiting, f"key {key!r}: {body!r} delivered before {waiting}"
                self.receipts.append((topic, queue, r.offset, lease_id, body, member))
                got += 1
        return got

    # -- rules ------------------------------------------------------------------------------------

    @initialize(orderly=st.booleans(), max_reconsume=st.integers(0, 2))
    def create_group(self, orderly: bool, max_reconsume: int) -> None:
        self.orderly = orderly
        self.max_reconsume = max_reconsume
        self.heartbeat("m0")

    @rule(keys=st.lists(st.sampled_from(sorted(KEYS)), min_size=1, max_size=6),
          queue=st.integers(0, 1))
    def produce(self, keys: list[str], queue: int) -> None:
        wall = self.clock.wall_ms()
        batches: dict[int, list[RecordInput]] = {}
        for k in keys:
            body = b"m%d" % self.n
            self.n += 1
            q = KEYS[k]
            batches.setdefault(queue if q is None else q, []).append(
                RecordInput(body, wall, sharding_key=k.encode()))
            self.sent.append((body, k))
        for q, recs in batches.items():
            qs = self.topics.queue("t", q)
            qs.log.append(encode_batch(recs), now_ms=wall)
            qs.advance(qs.log.end_offset)

    @rule(member=st.sampled_from(MEMBERS))
    def join(self, member: str) -> None:
        self.heartbeat(member)

    @precondition(lambda self: self.members)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        member = data.draw(st.sampled_from(sorted(self.members)))
        self.dm.leave(GROUP, member)
        self.members.discard(member)
        g = self.dm.group(GROUP)
        assert not any(ls.member == member for ls in g.leases.values()), "leases kept"

    @precondition(lambda self: self.members)
    @rule(data=st.data(), room=st.integers(1, 6), invisible=st.sampled_from([50, 300, 5_000]))
    def receive_messages(self, data: st.DataObject, room: int, invisible: int) -> None:
        self.receive(data.draw(st.sampled_from(sorted(self.members))), room, invisible)

    @precondition(lambda self: self.current())
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        current = self.current()
        topic, queue, _offset, lease_id, _body, _member = data.draw(st.sampled_from(current))
        acked = data.draw(st.lists(st.sampled_from(
            [r for r in current if r[:2] == (topic, queue) and r[3] == lease_id]),
            min_size=1, unique=True))  # one or more messages of one lease
        failed, _pos = self.dm.ack(self.dm.group(GROUP),
                                   [(topic, queue, lease_id, [r[2] for r in acked])])
        assert failed == [], "a current receipt was refused"
        self.acked.update(r[4] for r in acked)

    @precondition(lambda self: self.stale())
    @rule(data=st.data(), request=st.sampled_from(["ack", "nack", "change_invisible"]))
    def use_an_old_receipt(self, data: st.DataObject, request: str) -> None:
        topic, queue, offset, lease_id, _body, member = data.draw(st.sampled_from(self.stale()))
        g = self.dm.group(GROUP)
        before = self.dm.describe(GROUP)
        bad = int(ErrorCode.INVALID_RECEIPT)
        if request == "ack":
            failed, _pos = self.dm.ack(g, [(topic, queue, lease_id, [offset])])
            assert failed == [(topic, queue, offset, bad)]
        elif request == "nack":
            results, _waits = self.dm.nack(g, [(topic, queue, offset, lease_id, 0, "", True)])
            assert results == [(bad, -1)]
        else:
            results, _pos = self.dm.change_invisible(g, member,
                                                     [(topic, queue, offset, lease_id, 5_000)])
            assert results == [(bad, -1)]
        assert self.dm.describe(GROUP) == before, "a refused receipt changed the group"

    @precondition(lambda self: self.current())
    @rule(data=st.data(), counts=st.booleans(), delay=st.sampled_from([-1, 0]))
    def nack(self, data: st.DataObject, counts: bool, delay: int) -> None:
        topic, queue, offset, lease_id, _body, _member = data.draw(
            st.sampled_from(self.current()))
        results, waits = self.dm.nack(self.dm.group(GROUP),
                                      [(topic, queue, offset, lease_id, delay, "nack", counts)])
        assert results == [(int(ErrorCode.NONE), -1)] and waits == []

    @precondition(lambda self: self.current() and self.members)
    @rule(data=st.data(), invisible=st.sampled_from([50, 5_000]))
    def change_invisible(self, data: st.DataObject, invisible: int) -> None:
        topic, queue, offset, lease_id, body, _ = data.draw(st.sampled_from(self.current()))
        member = data.draw(st.sampled_from(sorted(self.members)))
        results, _pos = self.dm.change_invisible(self.dm.group(GROUP), member,
                                                 [(topic, queue, offset, lease_id, invisible)])
        ((code, new_id),) = results
        assert code == int(ErrorCode.NONE) and new_id != lease_id
        self.receipts.append((topic, queue, offset, new_id, body, member))

    @rule(dt_ms=st.sampled_from([10, 60, 400, 6_000]))
    def time_passes(self, dt_ms: int) -> None:
        self.clock.advance(dt_ms / 1000)
        self.dm.tick()
        self.members &= set(self.dm.group(GROUP).members)  # (sessions are long: none expire)

    @precondition(lambda self: self.sent)
    @rule(data=st.data())
    def message_status(self, data: st.DataObject) -> None:
        body, _key = data.draw(st.sampled_from(self.sent))
        t = self.topics.topics["t"]
        queue, offset = next((qs.queue, r.offset) for qs in t.queues
                             for r in decode_records(qs.log.read(0, 1 << 24)) if r.body == body)
        msg_id = encode_msg_id(t.topic_id, queue, offset)
        statuses = self.dm.message_status(msg_id).statuses
        g = self.dm.group(GROUP)
        if not statuses:  # a group shows only once it reads the queue or a member subscribes
            assert not g.members and ("t", queue) not in g.sources
            return
        ((name, state, *_),) = statuses
        assert name == GROUP
        if body in self.acked or body in self.purged:
            assert state == "CONSUMED", state
        elif body in self.dead():
            assert state == "DEAD", state
        elif body in {r[4] for r in self.current()}:
            assert state == "DELIVERED", state
        else:
            assert state in ("WAITING", "RETRYING"), state

    @precondition(lambda self: self.dead_letters())
    @rule(data=st.data(), action=st.sampled_from([m.DlqAction.REDRIVE, m.DlqAction.PURGE]),
          dry_run=st.booleans())
    def dlq_one(self, data: st.DataObject, action: m.DlqAction, dry_run: bool) -> None:
        """Redrive or purge one chosen dead letter, anywhere in the DLQ (mostly not the oldest:
        the one the floor cannot simply pass)."""
        live = self.dead_letters()
        letter = data.draw(st.sampled_from(live[1:] or live) if data.draw(st.integers(0, 3))
                           else st.sampled_from(live))
        resp, _pos = self.dm.dlq_admin(GROUP, int(action), 0, dry_run, letter.offset)
        assert (resp.first, resp.end, resp.count) == (letter.offset, letter.offset + 1, 1)
        if dry_run:
            return
        self.dlq_gone.add(letter.offset)
        if action == m.DlqAction.PURGE:
            self.purged.add(letter.body)

    @rule(action=st.sampled_from([m.DlqAction.REDRIVE, m.DlqAction.PURGE]),
          n=st.integers(0, 3))
    def dlq_oldest(self, action: m.DlqAction, n: int) -> None:
        """Redrive or purge the oldest n dead letters (0: all)."""
        live = self.dead_letters()
        chosen = live if n == 0 else live[:n]
        resp, _pos = self.dm.dlq_admin(GROUP, int(action), n, False)
        assert resp.count == len(chosen), (resp, [r.offset for r in live])
        self.dlq_gone.update(r.offset for r in chosen)
        if action == m.DlqAction.PURGE:
            self.purged.update(r.body for r in chosen)

    @rule(data=st.data(), action=st.sampled_from([m.DlqAction.REDRIVE, m.DlqAction.PURGE]))
    def dlq_one_that_is_not_live(self, data: st.DataObject, action: m.DlqAction) -> None:
        end = len(self.dlq_records())  # (the DLQ is one queue, offsets from 0, no retention)
        offset = data.draw(st.sampled_from([*sorted(self.dlq_gone), end, end + 7]))
        before = self.dm.describe(GROUP)
        try:
            self.dm.dlq_admin(GROUP, int(action), 0, False, offset)
        except InvalidOffsetError:
            pass
        else:
            raise AssertionError(f"offset {offset} is no live dead letter; it was accepted")
        assert self.dm.describe(GROUP) == before, "a refused DLQ request changed the group"

    @rule(clean=st.booleans())
    def restart(self, clean: bool) -> None:
        if clean:
            self.dm.close()  # snapshots
        else:  # as after kill -9: the journals are replayed (their files are complete)
            for store in self.dm.stores.values():
                store.journal.close()
        self.topics.close()
        self.open()
        self.members.clear()  # members are not kept across a restart; leases are

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def describe_counts_the_current_receipts(self) -> None:
        """DESCRIBE_DELIVERY's in-flight counts (per member, per queue, retry letters) are the
        receipts that are good now."""
        described = self.dm.describe(GROUP)
        current = self.current()
        per_member = Counter(r[5] for r in current)
        for member_id, _client, _host, _age, in_flight in described.members:
            assert in_flight == per_member[member_id], (member_id, in_flight, current)
        per_queue = Counter(r[:2] for r in current)
        for topic, queue, _floor, _next, _end, in_flight, _age in described.queues:
            assert in_flight == per_queue[(topic, queue)], (topic, queue, in_flight, current)
        assert described.retry_in_flight == per_queue[(f"%RETRY%{GROUP}", 0)]

    @invariant()
    def the_dlq_depth_counts_the_live_dead_letters(self) -> None:
        live = self.dead_letters()
        assert self.dm.describe(GROUP).dlq_size == len(live)
        resp, _pos = self.dm.dlq_admin(GROUP, int(m.DlqAction.PURGE), 0, True)
        assert resp.count == len(live)
        assert set(resp.done) <= self.dlq_gone

    @invariant()
    def dead_letters_had_every_attempt(self) -> None:
        """A message is dead-lettered (none on purpose here) only after max_reconsume + 1
        failed attempts (counted again from 0 after a redrive); it is a live dead letter once
        at most."""
        letters = self.dead_letters()
        for r in letters:
            assert parse_letter(r.properties).reconsume == self.max_reconsume + 1, r
        assert len({r.body for r in letters}) == len(letters), "dead-lettered twice"

    # -- the end ----------------------------------------------------------------------------------

    def drain(self) -> None:
        """One member takes and acks everything left: every message ends acked or dead."""
        for _ in range(10 + 3 * len(self.sent)):
            self.clock.advance(10)  # past every lease and backoff
            self.heartbeat("drainer")
            self.dm.tick()
            self.receive("drainer", 1_000, 60_000)
            for r in self.current():
                failed, _pos = self.dm.ack(self.dm.group(GROUP), [(r[0], r[1], r[3], [r[2]])])
                assert failed == []
                self.acked.add(r[4])
            if self.acked | self.dead() | self.purged >= {b for b, _ in self.sent} \
                    and not self.current():
                break
        dead = self.dead()
        assert not self.acked & dead and not self.acked & self.purged
        assert self.acked | dead | self.purged == {b for b, _ in self.sent}, \
            "messages left behind"
        described = self.dm.describe(GROUP)
        assert sum(described.lag) == 0 and described.retry_pending == 0, described


class DeadLetterModel(ManagerModel):
    """The same group with no retry (max_reconsume 0) and a rule that fails a lease's messages:
    dead letters are common, so that redriving and purging them, one by one or from the oldest,
    meet every other rule (restarts between them above all)."""

    @initialize(orderly=st.booleans())
    def create_group(self, orderly: bool) -> None:
        self.orderly = orderly
        self.max_reconsume = 0
        self.heartbeat("m0")

    @precondition(lambda self: self.current())
    @rule(data=st.data())
    def fail_to_the_dlq(self, data: st.DataObject) -> None:
        failed = data.draw(st.lists(st.sampled_from(self.current()), min_size=1, unique=True))
        results, _waits = self.dm.nack(self.dm.group(GROUP), [
            (topic, queue, offset, lease_id, -1, "poison", True)
            for topic, queue, offset, lease_id, _body, _member in failed])
        assert all(code == int(ErrorCode.NONE) for code, _ in results)


for _model in (ManagerModel, DeadLetterModel):
    _model.TestCase.settings = settings(
        max_examples=150,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
test_delivery_manager_model = ManagerModel.TestCase
test_dead_letter_model = DeadLetterModel.TestCase
