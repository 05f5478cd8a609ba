"""Model test of the transaction coordinator (broker/txn/) in process: no socket, no broker
process, no flusher thread.

The real :class:`TxnCoordinator` runs over real queues (a :class:`TopicRegistry` in a temporary
directory, async flush mode), a real group coordinator and producer ids, on a fake clock. Rules:
INIT_TXN (a new instance; the one before becomes a zombie), transactional sends exactly as the
produce handler makes them, sends of zombies, offsets in the transaction, END_TXN commit and
abort, a sink task staging and COMMIT_STAGED, a full disk on the state log or on a queue (a fault
injected on purpose into the flusher's ``full`` set) and space coming back, time passing with
housekeeping (timeouts), and a restart (every component rebuilt from the files). The model keeps
each transaction's first offset per queue and its decision. Invariants, after every step:

* an outcome never changes once decided (PrepareX only ever completes its own way, through
  stalls and restarts; the committed offsets are exactly those of committed transactions);
* a zombie epoch is fenced (nothing of it is registered or stored);
* a transaction counts as complete only once a marker closed it on every queue it wrote to
  (the log's producer state has no open transaction of it there, and the aborted-transaction
  index lists it exactly when it aborted);
* every queue's LSO is the smallest first offset of the transactions open on it (never past
  one, released as soon as the last one completes).

tests/property/test_txn_model.py is the end-to-end companion: real clients over sockets, what a
read_committed reader sees.
"""

from __future__ import annotations

import asyncio
import errno
import shutil
import tempfile
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ferrymq.broker.config import BrokerConfig
from ferrymq.broker.consumer_groups import ConsumerGroupCoordinator
from ferrymq.broker.flusher import Flusher
from ferrymq.broker.producer_ids import ProducerIdManager
from ferrymq.broker.topics import QueueState, TopicRegistry
from ferrymq.broker.txn import TxnCoordinator
from ferrymq.broker.txn.state import OPEN_STATES, PREPARE_STATES
from ferrymq.errors import (
    BrokerError,
    InvalidTxnStateError,
    ProducerFencedError,
    StorageFullError,
    TransactionTimedOutError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.messages import TxnState
from ferrymq.protocol.records import ATTR_TRANSACTIONAL, RecordInput, decode_header, encode_batch
from ferrymq.storage import LogConfig
from ferrymq.testing import FakeClock

QUEUES = 2
TIDS = ("a", "b")
TIMEOUT_MS = 2_000
CONFIG = replace(BrokerConfig(), flush="async", txn_default_timeout_ms=TIMEOUT_MS,
                 txn_max_open=2, busy_retry_after_ms=50)
ENOSPC = OSError(errno.ENOSPC, "No space left on device")
T = TypeVar("T")
SCRATCH = "/dev/shm" if Path("/dev/shm").is_dir() else None
"""Memory-backed when there is one: the rules fsync a lot (restarts), and no fsync is tested."""


@dataclass
class Txn:
    """One transaction as the model sees it."""

    pid: int
    firsts: dict[int, int] = field(default_factory=dict)  # queue -> first offset
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    maybe_offsets: set[tuple[str, int]] = field(default_factory=set)  # answered STORAGE_FULL
    decision: bool | None = None  # True commit, False abort, once decided
    durable: bool = False  # the decision record is in the state log


class CoordinatorModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ferrymq-txn-model-", dir=SCRATCH))
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock()
        self.instances: dict[str, tuple[int, int]] = {}  # tid -> current (pid, epoch)
        self.zombies: list[tuple[str, int, int]] = []
        self.open: dict[str, Txn] = {}  # tid -> its transaction not yet complete
        self.committed: dict[tuple[str, int], int] = {}  # group "g"'s expected offsets
        self.uncertain: set[tuple[str, int]] = set()  # offsets a STORAGE_FULL answer left open
        self.full: set[str] = set()  # "state" or "q<n>": full on purpose
        self.sink_batch = 0
        self._open_components(first=True)

    def _open_components(self, *, first: bool = False) -> None:
        self.topics = TopicRegistry(self.dir, LogConfig(), sync_visibility=False,
                                    clean_shutdown=False, max_queues=64)
        self.topics.open_all(self.clock.wall_ms())
        if first:
            self.topics.create("t", QUEUES, {}, self.clock.wall_ms())
        self.consumer_groups = ConsumerGroupCoordinator(self.dir)
        self.consumer_groups.load()
        self.pids = ProducerIdManager(self.dir)
        self.pids.load()
        self.flusher = Flusher(self.loop, sync=False, interval_ms=200, threads=1)  # not started
        self.flusher.retry_after_ms = CONFIG.busy_retry_after_ms
        self.coord = TxnCoordinator(CONFIG, self.topics, self.flusher, self.consumer_groups, self.pids,
                                    self.clock, self.dir)
        self.coord.load()

    def teardown(self) -> None:
        self.topics.close()
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers ---------------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        async def main() -> T:
            try:
                return await coro
            finally:
                for _ in range(20):  # let the tasks it started (completions) run
                    await asyncio.sleep(0)

        return self.loop.run_until_complete(main())

    def queue(self, q: int) -> QueueState:
        return self.topics.queue("t", q)

    def _send(self, tid: str, pid: int, epoch: int, q: int) -> int:
        """A transactional batch as the produce handler admits and appends it."""
        qs = self.queue(q)
        self.flusher.check_writable(qs)
        entry = qs.log.producer_state.producers.get(pid)
        seq = entry.last_seq + 1 if entry is not None and entry.epoch == epoch else 0
        batch = encode_batch([RecordInput(f"{tid}-{seq}".encode(), self.clock.wall_ms())],
                             producer_id=pid, producer_epoch=epoch, base_sequence=seq,
                             attributes=ATTR_TRANSACTIONAL)
        self.coord.check_produce(qs, decode_header(batch))
        res = qs.log.append(batch, now_ms=self.clock.wall_ms())
        self.coord.on_append(qs, pid, res.base_offset)
        self.flusher.mark_dirty(qs)
        qs.advance(qs.log.end_offset)
        return res.base_offset

    def _set_full(self, name: str, full: bool) -> None:
        qs = self.coord.state_queue if name == "state" else self.queue(int(name[1:]))
        if full:
            self.flusher.full[qs] = ENOSPC
            self.full.add(name)
        else:
            self.flusher.full.pop(qs, None)
            self.full.discard(name)
        self.flusher.space_back = not self.full

    # -- rules -----------------------------------------------------------------------------------

    @rule(tid=st.sampled_from(TIDS))
    def init(self, tid: str) -> None:
        old = self.instances.get(tid)
        try:
            res = self.run(self.coord.init(m.InitTxnRequest(tid, 0, -1, -1)))
        except StorageFullError:
            return  # its open transaction, if any, stays decided (aborted)
        if old is not None:
            self.zombies.append((tid, *old))
            assert (res.producer_id, res.producer_epoch) != old
        self.instances[tid] = (res.producer_id, res.producer_epoch)
        assert self.coord.book.txns[tid].state == TxnState.EMPTY

    @rule(tid=st.sampled_from(TIDS), q=st.integers(0, QUEUES - 1))
    def send(self, tid: str, q: int) -> None:
        if tid not in self.instances:
            return
        pid, epoch = self.instances[tid]
        try:
            base = self._send(tid, pid, epoch, q)
        except (BrokerError, StorageFullError):
            return  # refused: nothing stored (fenced by a timeout, decided, busy, full)
        txn = self.open.setdefault(tid, Txn(pid))
        assert txn.decision is None, "a decided transaction took another send"
        txn.firsts.setdefault(q, base)

    @precondition(lambda self: bool(self.zombies))
    @rule(data=st.data(), q=st.integers(0, QUEUES - 1))
    def zombie_send(self, data: st.DataObject, q: int) -> None:
        tid, pid, epoch = data.draw(st.sampled_from(self.zombies))
        qs = self.queue(q)
        end = qs.log.end_offset
        queues = dict(self.coord.book.txns[tid].queues)
        try:
            self._send(tid, pid, epoch, q)
        except (ProducerFencedError, TransactionTimedOutError):
            pass
        except StorageFullError:
            assert f"q{q}" in self.full  # refused before the fencing check: nothing stored
        else:
            raise AssertionError(f"zombie {tid} producer {pid} epoch {epoch} was not fenced")
        assert qs.log.end_offset == end
        assert self.coord.book.txns[tid].queues == queues

    @rule(tid=st.sampled_from(TIDS), q=st.integers(0, QUEUES - 1))
    def add_offsets(self, tid: str, q: int) -> None:
        if tid not in self.instances:
            return
        pid, epoch = self.instances[tid]
        offset = self.queue(q).log.end_offset
        req = m.TxnOffsetCommitRequest(tid, pid, epoch, "g", "", -1, [("t", q, offset)])
        try:
            res = self.run(self.coord.add_offsets(req))
        except StorageFullError:  # begun, offsets in memory, the record not written
            self.open.setdefault(tid, Txn(pid)).maybe_offsets.add(("t", q))
            return
        except BrokerError:
            return
        if res.results[0][2] == 0:
            txn = self.open.setdefault(tid, Txn(pid))
            assert txn.decision is None
            txn.offsets[("t", q)] = offset

    @rule(tid=st.sampled_from(TIDS), commit=st.booleans())
    def end(self, tid: str, commit: bool) -> None:
        if tid not in self.instances:
            return
        pid, epoch = self.instances[tid]
        action = m.EndTxnAction.COMMIT if commit else m.EndTxnAction.ABORT
        txn = self.open.get(tid)
        try:
            res = self.run(self.coord.end(m.EndTxnRequest(tid, pid, epoch, int(action), "", 0, 0)))
        except InvalidTxnStateError:
            if txn is not None and txn.decision is not None:
                assert txn.decision != commit or self.coord.book.txns[tid].state in OPEN_STATES
            return
        except (BrokerError, StorageFullError):
            return  # fenced by a timeout, or decided and waiting for space
        if txn is not None and txn.decision is not None:
            assert txn.decision == commit, "a decision flipped"
        want = TxnState.COMPLETE_COMMIT if commit else TxnState.COMPLETE_ABORT
        assert res.state == int(want)

    @precondition(lambda self: any(t.decision is not None for t in self.open.values()))
    @rule(data=st.data())
    def end_the_other_way(self, data: st.DataObject) -> None:
        """END_TXN asking the opposite of a decision that waits for space: refused."""
        tid = data.draw(st.sampled_from(sorted(t for t, x in self.open.items()
                                               if x.decision is not None)))
        txn = self.open[tid]
        pid, epoch = self.instances[tid]
        action = m.EndTxnAction.ABORT if txn.decision else m.EndTxnAction.COMMIT
        before = self.coord.book.txns[tid].state
        try:
            self.run(self.coord.end(m.EndTxnRequest(tid, pid, epoch, int(action), "", 0, 0)))
        except (InvalidTxnStateError, ProducerFencedError, TransactionTimedOutError):
            assert self.coord.book.txns[tid].state == before
            return
        raise AssertionError(f"{tid}: {action.name} of a transaction decided the other way")

    @rule(tid=st.sampled_from(TIDS))
    def stage_and_commit(self, tid: str) -> None:
        """A sink task stages its transaction; the driver commits the batch."""
        if tid not in self.instances or tid not in self.open:
            return
        pid, epoch = self.instances[tid]
        self.sink_batch += 1
        req = m.EndTxnRequest(tid, pid, epoch, int(m.EndTxnAction.STAGE), "sink",
                              self.sink_batch, 0)
        try:
            self.run(self.coord.end(req))
            self.run(self.coord.commit_staged(
                m.CommitStagedRequest("sink", self.sink_batch, [(tid, pid, epoch)])))
        except (BrokerError, StorageFullError):
            return

    @rule(name=st.sampled_from(["state", *(f"q{q}" for q in range(QUEUES))]))
    def disk_fills(self, name: str) -> None:
        self._set_full(name, True)

    @precondition(lambda self: bool(self.full))
    @rule()
    def space_comes_back(self) -> None:
        for name in list(self.full):
            self._set_full(name, False)
        self.run(self._tick())

    @rule(ms=st.integers(0, 3 * TIMEOUT_MS))
    def time_passes(self, ms: int) -> None:
        self.clock.advance(ms / 1000)
        self.run(self._tick())

    async def _tick(self) -> None:
        self.coord.tick()

    @rule()
    def restart(self) -> None:
        """Every component is rebuilt from the files (the disk is fine again after it)."""
        for name in list(self.full):
            self._set_full(name, False)
        self.coord.close()
        self.topics.close()
        self._open_components()

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def decisions_stand_and_complete_with_markers_everywhere(self) -> None:
        book = self.coord.book
        for tid, txn in list(self.open.items()):
            meta = book.txns[tid]
            assert meta.pid == txn.pid
            if meta.state in PREPARE_STATES:
                decision = meta.state == TxnState.PREPARE_COMMIT
                assert txn.decision in (None, decision), "a decision flipped"
                txn.decision = decision
                txn.durable = self.coord.completer.decision_written(meta)
                continue
            if meta.state in OPEN_STATES:  # a decision never written is lost by a restart
                assert txn.decision is None or not txn.durable, "a durable decision was lost"
                txn.decision = None
                continue
            # complete: decided one way, and closed by a marker on every queue it wrote to
            commit = meta.state == TxnState.COMPLETE_COMMIT  # EMPTY: aborted by INIT_TXN
            assert txn.decision in (None, commit), "a decision flipped"
            for q, first in txn.firsts.items():
                qs = self.queue(q)
                assert qs.log.ongoing_txns().get(txn.pid) != first, f"no marker on queue {q}"
                aborted = (txn.pid, first) in qs.log.aborted_txns(first, qs.log.end_offset)
                assert aborted == (not commit), f"queue {q} disagrees with the outcome"
            if commit:
                self.committed.update(txn.offsets)
                for key in txn.maybe_offsets:  # answered STORAGE_FULL: in it, or not
                    self.committed.pop(key, None)
                    self.uncertain.add(key)
            del self.open[tid]
        committed = self.consumer_groups.committed("g")
        for key in self.uncertain:
            if key in committed:
                self.committed[key] = committed[key]
        assert committed == self.committed

    @invariant()
    def lso_stops_at_the_first_open_transaction(self) -> None:
        for q in range(QUEUES):
            qs = self.queue(q)
            firsts = [t.firsts[q] for t in self.open.values() if q in t.firsts]
            assert qs.lso == min([qs.visible_end, *firsts])
            assert sorted(qs.open_txns.values()) == sorted(firsts)


CoordinatorModel.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=35,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_coordinator_model = CoordinatorModel.TestCase
