"""Model test: truncation by leader epoch (KIP-101 / KIP-279) over real ``Log`` replicas.

Three replicas of one queue, each a real :class:`~ferrymq.storage.Log` in a temporary
directory, beside a model: per replica, the list of batches it holds as
``(base_offset, last_offset, epoch, bytes)``. Rules:

- the leader appends a batch (``Log.append``, stamped with its offsets);
- any replica is elected leader with the next epoch (``epochs.assign(epoch, end)``); every
  other replica must then truncate before it fetches again (one that has not done so yet may
  still be elected: its log is one a leader once had);
- a follower fetches: after a leader change it first truncates by epoch (it asks the leader
  ``end_offset_for`` its latest epoch and cuts where ``truncation_point`` says, again until
  that is final), then it gets the leader's batches from its end and the epoch entries
  covering them (``epochs.entries_from``), records each batch's epoch (``epochs.assign``) and
  appends it unchanged (``Log.append_replica``);
- a replica restarts (close, open: clean or not);
- every follower catches up completely.

An entry is committed once every replica holds it (same offset, same bytes). Every replica
can thus be elected without losing committed data, which is exactly what makes divergent
uncommitted tails (the KIP-101 scenarios) appear. Invariants: each log holds the model's
bytes at the model's offsets and knows the model's epoch for each; no committed entry is ever
truncated; right after its truncation a follower's log is a prefix of the leader's; after a
catch-up every follower equals the leader.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ferrymq.protocol.records import BatchHeader, RecordInput, encode_batch, iter_batches
from ferrymq.storage import Log, LogConfig
from ferrymq.storage.epochs import epoch_in

REPLICAS = 3
CONFIG = LogConfig(segment_bytes=900, index_interval_bytes=96, retention_ms=None)
MAX_TRUNCATION_ROUNDS = 50  # each round lowers the follower's latest epoch: far more than used

Entry = tuple[int, int, int, bytes]
"""A batch in the model: (base_offset, last_offset, epoch, bytes as stored)."""


class Replica:
    """One replica: its real log and the batches the model says it holds."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.log, _ = Log.open(directory, CONFIG, clean_shutdown=True, now_ms=0)
        self.batches: list[Entry] = []
        self.must_truncate = False

    @property
    def end(self) -> int:
        return self.batches[-1][1] + 1 if self.batches else 0

    def cut(self, end: int) -> None:
        self.batches = [b for b in self.batches if b[1] < end]


def _common_prefix(a: list[Entry], b: list[Entry]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class EpochTruncationModel(RuleBasedStateMachine):
    """Leaders, followers and leader changes over real logs, checked against lists."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="ferrymq-epochs-"))
        self.replicas = [Replica(self.root / f"r{i}") for i in range(REPLICAS)]
        self.leader = 0
        self.epoch = 0
        self.replicas[0].log.epochs.assign(0, 0)
        self.committed: list[Entry] = []
        self.serial = 0
        self.now_ms = 0

    def teardown(self) -> None:
        for r in self.replicas:
            r.log.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # --- helpers ------------------------------------------------------------------------------

    def _followers(self) -> list[int]:
        return [i for i in range(REPLICAS) if i != self.leader]

    def _update_committed(self) -> None:
        leader = self.replicas[self.leader].batches
        held = min(_common_prefix(r.batches, leader) for r in self.replicas)
        if held > len(self.committed):
            assert leader[: len(self.committed)] == self.committed
            self.committed = leader[:held]

    def _fetch(self, follower: Replica, max_batches: int) -> int:
        leader = self.replicas[self.leader]
        start = follower.log.end_offset
        if start == leader.log.end_offset:
            return 0
        entries = leader.log.epochs.entries_from(start)
        data = leader.log.read(start, 1 << 20)
        copied = 0
        for pos, h in iter_batches(data):
            if copied == max_batches:
                break
            epoch = epoch_in(entries, h.base_offset)
            expected = leader.batches[len(follower.batches)]
            assert (h.base_offset, epoch) == (expected[0], expected[2])
            follower.log.epochs.assign(epoch, h.base_offset)  # before the data, always
            follower.log.append_replica(data[pos : pos + h.size])
            follower.batches.append(expected)
            copied += 1
        self._update_committed()
        return copied

    def _truncate(self, follower: Replica) -> None:
        leader = self.replicas[self.leader]
        for _ in range(MAX_TRUNCATION_ROUNDS):
            log = follower.log
            answer = leader.log.epochs.end_offset_for(log.epochs.latest_epoch(),
                                                      leader.log.end_offset)
            point, final = log.epochs.truncation_point(answer, log.start_offset, log.end_offset)
            log.truncate_to(point)
            if point < follower.end:
                event("a follower cut a diverged tail")
            follower.cut(point)
            assert log.end_offset == follower.end
            assert follower.batches[: len(self.committed)] == self.committed, (
                "a committed entry was truncated")
            if final:
                break
            event("the leader answered an epoch the follower did not know (KIP-279)")
        else:
            raise AssertionError("truncation by epoch did not converge")
        assert follower.batches == leader.batches[: len(follower.batches)], (
            "after truncation the follower must hold a prefix of the leader's log")
        follower.must_truncate = False

    # --- rules --------------------------------------------------------------------------------

    @rule(count=st.integers(1, 3), size=st.integers(0, 60), dt=st.integers(0, 20))
    def leader_appends(self, count: int, size: int, dt: int) -> None:
        self.now_ms += dt
        leader = self.replicas[self.leader]
        records = []
        for _ in range(count):
            self.serial += 1
            records.append(RecordInput(self.serial.to_bytes(4, "little") * (size // 4 + 1),
                                       self.now_ms))
        result = leader.log.append(encode_batch(records), now_ms=self.now_ms)
        assert result.base_offset == leader.end
        stored = leader.log.read(result.base_offset, 1)
        leader.batches.append((result.base_offset, result.last_offset, self.epoch, stored))

    @rule(data=st.data(), max_batches=st.integers(0, 4))
    def follower_fetches(self, data: st.DataObject, max_batches: int) -> None:
        """A follower's fetcher: truncation first after a leader change, then a fetch (of
        nothing: the truncation alone)."""
        follower = self.replicas[data.draw(st.sampled_from(self._followers()))]
        if follower.must_truncate:
            self._truncate(follower)
        self._fetch(follower, max_batches)

    @rule(new_leader=st.integers(0, REPLICAS - 1))
    def leader_changes(self, new_leader: int) -> None:
        chosen = self.replicas[new_leader]
        assert chosen.batches[: len(self.committed)] == self.committed
        self.epoch += 1
        self.leader = new_leader
        chosen.log.epochs.assign(self.epoch, chosen.log.end_offset)
        chosen.must_truncate = False  # a leader never truncates
        for i in self._followers():
            self.replicas[i].must_truncate = True

    @rule(i=st.integers(0, REPLICAS - 1), clean=st.booleans())
    def replica_restarts(self, i: int, clean: bool) -> None:
        r = self.replicas[i]
        before = r.log.epochs.entries()
        r.log.close()
        r.log, _ = Log.open(r.directory, CONFIG, clean_shutdown=clean, now_ms=0)
        # the cache survives, less an entry at the end (an epoch that wrote nothing here)
        assert r.log.epochs.entries() == [e for e in before if e[1] < r.end]
        if i == self.leader:  # still the leader: it records its epoch again
            r.log.epochs.assign(self.epoch, r.log.end_offset)

    @precondition(lambda self: self.replicas[self.leader].batches)
    @rule()
    def everyone_catches_up(self) -> None:
        leader = self.replicas[self.leader]
        for i in self._followers():
            follower = self.replicas[i]
            if follower.must_truncate:
                self._truncate(follower)
            while self._fetch(follower, 10):
                pass
            assert follower.batches == leader.batches
            assert _log_bytes(follower.log) == _log_bytes(leader.log)
        assert self.committed == leader.batches

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def logs_match_the_model(self) -> None:
        for r in self.replicas:
            assert r.log.end_offset == r.end
            stored = [(h.base_offset, h.last_offset, r.log.epochs.epoch_at(h.base_offset),
                       bytes(raw)) for h, raw in _batches(r.log)]
            assert stored == r.batches

    @invariant()
    def committed_entries_are_everywhere(self) -> None:
        for r in self.replicas:
            assert r.batches[: len(self.committed)] == self.committed


def _batches(log: Log) -> list[tuple[BatchHeader, bytes]]:
    out: list[tuple[BatchHeader, bytes]] = []
    offset = log.start_offset
    while offset < log.end_offset:
        data = log.read(offset, 1 << 20)
        for pos, h in iter_batches(data):
            out.append((h, data[pos : pos + h.size]))
            offset = h.last_offset + 1
    return out


def _log_bytes(log: Log) -> bytes:
    return b"".join(raw for _h, raw in _batches(log))


EpochTruncationModel.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_epoch_truncation_model = EpochTruncationModel.TestCase
