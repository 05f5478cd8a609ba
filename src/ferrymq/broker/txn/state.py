"""Transactional ids and their transactions in memory: the state table, fencing, sink fences.

Pure data and transitions: no I/O, no clock (times are wall-clock ms passed in; new producer ids
come from a function passed in). :mod:`.coordinator` drives it, writes every change to
``%TXN%state`` (:mod:`.statelog`) and completes decided transactions (:mod:`.completion`).

A transactional id's transaction moves through :data:`TRANSITIONS` (state x event -> state)::

    EMPTY, COMPLETE_COMMIT, COMPLETE_ABORT --BEGIN--> ONGOING     (its first send or offsets)
                                           --INIT---> EMPTY       (a new instance, new epoch)
    ONGOING --STAGE--> STAGED                                      (a Spark sink task's part)
    ONGOING --COMMIT--> PREPARE_COMMIT --COMPLETE--> COMPLETE_COMMIT
    STAGED  --COMMIT_STAGED--> PREPARE_COMMIT                      (the sink's commit record)
    ONGOING, STAGED --ABORT--> PREPARE_ABORT --COMPLETE--> COMPLETE_ABORT

A PrepareX state is the *decision*: asked for again (a retry, or the broker finishing it after
a full disk) it stays; the opposite is refused, so an outcome never changes once decided. A pair
missing from the table is refused with INVALID_TXN_STATE (:func:`step`). Whether the markers
reached every touched queue before COMPLETE is :mod:`.completion`'s to ensure; this module
only says which states are open (:data:`OPEN_STATES`: the queues' LSOs wait for them).

Fencing (:meth:`TxnBook.check_epoch`): a request must carry the tid's current producer id and
epoch. Every INIT_TXN bumps the epoch, and so does the broker when it aborts a transaction past
its timeout (the old epoch then hears TRANSACTION_TIMED_OUT, any older one PRODUCER_FENCED). At
:data:`MAX_EPOCH` the tid gets a new producer id and epoch 0.

Sink fences: a sink id's last committed batch id; a batch at or below it is a replay.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ferrymq.errors import (
    BusyError,
    ConcurrentTransactionsError,
    InvalidTxnStateError,
    ProducerFencedError,
    TransactionTimedOutError,
)
from ferrymq.protocol.messages import TxnState

__all__ = [
    "DONE_STATES",
    "MAX_EPOCH",
    "OPEN_STATES",
    "PREPARE_STATES",
    "TRANSITIONS",
    "QueueKey",
    "TxnBook",
    "TxnEvent",
    "TxnMeta",
    "can",
    "step",
]

MAX_EPOCH = 32767
"""Epochs are i16: at this epoch a transactional id gets a new producer id."""
OPEN_STATES = (TxnState.ONGOING, TxnState.STAGED)
DONE_STATES = (TxnState.EMPTY, TxnState.COMPLETE_COMMIT, TxnState.COMPLETE_ABORT)
PREPARE_STATES = (TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT)
QueueKey = tuple[str, int]


class TxnEvent(enum.Enum):
    """What can happen to a transactional id's transaction."""

    BEGIN = "begin"  # its first transactional send or offsets
    STAGE = "stage"  # END_TXN stage (Spark sink)
    COMMIT = "commit"  # END_TXN commit (or the same decision asked for again)
    ABORT = "abort"  # END_TXN abort, a timeout, a new instance, a replayed sink batch
    COMMIT_STAGED = "commit staged"  # COMMIT_STAGED (its SinkCommit record is the decision)
    COMPLETE = "complete"  # markers durable on every touched queue, offsets applied
    INIT = "init"  # INIT_TXN of a new instance


_S = TxnState
_E = TxnEvent
TRANSITIONS: dict[tuple[TxnState, TxnEvent], TxnState] = {
    (_S.EMPTY, _E.BEGIN): _S.ONGOING,
    (_S.COMPLETE_COMMIT, _E.BEGIN): _S.ONGOING,
    (_S.COMPLETE_ABORT, _E.BEGIN): _S.ONGOING,
    (_S.ONGOING, _E.STAGE): _S.STAGED,
    (_S.ONGOING, _E.COMMIT): _S.PREPARE_COMMIT,
    (_S.ONGOING, _E.ABORT): _S.PREPARE_ABORT,
    (_S.STAGED, _E.ABORT): _S.PREPARE_ABORT,
    (_S.STAGED, _E.COMMIT_STAGED): _S.PREPARE_COMMIT,
    (_S.PREPARE_COMMIT, _E.COMMIT): _S.PREPARE_COMMIT,  # decided: asked again, it stands
    (_S.PREPARE_ABORT, _E.ABORT): _S.PREPARE_ABORT,
    (_S.PREPARE_COMMIT, _E.COMPLETE): _S.COMPLETE_COMMIT,
    (_S.PREPARE_ABORT, _E.COMPLETE): _S.COMPLETE_ABORT,
    (_S.EMPTY, _E.INIT): _S.EMPTY,
    (_S.COMPLETE_COMMIT, _E.INIT): _S.EMPTY,
    (_S.COMPLETE_ABORT, _E.INIT): _S.EMPTY,
}
"""Every legal move; anything missing is refused (:func:`step`)."""


def can(state: TxnState, event: TxnEvent) -> bool:
    """Whether the table has a move for ``event`` in ``state``."""
    return (state, event) in TRANSITIONS


def step(state: TxnState, event: TxnEvent) -> TxnState:
    """The state after ``event``.

    Raises:
        InvalidTxnStateError: the table has no such move.
    """
    nxt = TRANSITIONS.get((state, event))
    if nxt is None:
        raise InvalidTxnStateError(f"a transaction in state {state.name} cannot {event.value}")
    return nxt


@dataclass(eq=False, slots=True)
class TxnMeta:
    """A transactional id's state (what the newest ``%TXN%state`` record says)."""

    tid: str
    pid: int
    epoch: int
    state: TxnState
    timeout_ms: int
    started_ms: int = 0
    updated_ms: int = 0
    queues: dict[QueueKey, None] = field(default_factory=dict)  # ordered set
    offsets: dict[str, dict[QueueKey, int]] = field(default_factory=dict)
    sink: tuple[str, int] | None = None
    ttl_ms: int = 0
    staged_ms: int = 0
    bumped_by: str = ""  # why the epoch last moved: "init", "timeout", "" (new)
    completing: bool = False  # a commit/abort is being driven (not stored)

    def move(self, event: TxnEvent) -> None:
        """Take ``event`` (:func:`step`)."""
        self.state = step(self.state, event)


class TxnBook:
    """Every transactional id's :class:`TxnMeta`, by id and by producer id; the sink fences;
    which groups' offsets wait in an open transaction; END_TXNs answered STORAGE_FULL."""

    def __init__(self) -> None:
        self.txns: dict[str, TxnMeta] = {}
        self.by_pid: dict[int, TxnMeta] = {}
        self.sinks: dict[str, tuple[int, int]] = {}  # sink id -> (last batch id, at ms)
        self.pending_offsets: dict[tuple[str, str, int], str] = {}  # (group, t, q) -> tid
        self.unanswered: dict[str, bool] = {}
        """Tid -> commit?: an END_TXN answered STORAGE_FULL, not yet answered otherwise."""

    def clear(self) -> None:
        """Forget everything (an unusable snapshot)."""
        self.txns.clear()
        self.by_pid.clear()
        self.sinks.clear()

    # -- transactional ids -----------------------------------------------------------------------

    def put(self, meta: TxnMeta) -> None:
        """Add ``meta`` (replacing the tid's previous state)."""
        old = self.txns.get(meta.tid)
        if old is not None and self.by_pid.get(old.pid) is old:
            del self.by_pid[old.pid]
        self.txns[meta.tid] = meta
        self.by_pid[meta.pid] = meta

    def forget(self, meta: TxnMeta) -> None:
        """Remove an idle transactional id."""
        del self.txns[meta.tid]
        if self.by_pid.get(meta.pid) is meta:
            del self.by_pid[meta.pid]

    def meta(self, tid: str, pid: int, epoch: int) -> TxnMeta:
        """The tid's state, checked against the caller's producer id and epoch.

        Raises:
            InvalidTxnStateError: unknown tid (INIT_TXN first).
            TransactionTimedOutError: the caller's epoch was ended by a timeout.
            ProducerFencedError: another instance took the tid.
        """
        meta = self.txns.get(tid)
        if meta is None:
            raise InvalidTxnStateError(f"unknown transactional id {tid!r}: call INIT_TXN first")
        self.check_epoch(meta, pid, epoch)
        return meta

    def producer(self, pid: int, epoch: int) -> TxnMeta:
        """The tid a transactional batch's producer id belongs to, fenced by its epoch.

        Raises:
            InvalidTxnStateError: the producer id has no transactional id.
            TransactionTimedOutError, ProducerFencedError: as :meth:`meta`.
        """
        meta = self.by_pid.get(pid)
        if meta is None:
            raise InvalidTxnStateError(f"producer {pid} has no transactional id: INIT_TXN first")
        self.check_epoch(meta, pid, epoch)
        return meta

    @staticmethod
    def check_epoch(meta: TxnMeta, pid: int, epoch: int) -> None:
        """Fence a zombie: ``(pid, epoch)`` must be the tid's current one.

        Raises:
            TransactionTimedOutError: the epoch just before, ended by the broker's timeout.
            ProducerFencedError: any other.
        """
        if pid == meta.pid and epoch == meta.epoch:
            return
        if pid == meta.pid and epoch == meta.epoch - 1 and meta.bumped_by == "timeout":
            raise TransactionTimedOutError(
                f"transaction of {meta.tid!r} was aborted after its timeout "
                f"({meta.timeout_ms} ms); abort() and begin again")
        raise ProducerFencedError(
            f"transactional id {meta.tid!r} is now producer {meta.pid} epoch {meta.epoch} "
            f"(this one: {pid} epoch {epoch}): fenced by a newer instance")

    def bump(self, meta: TxnMeta, why: str, allocate: Callable[[], int]) -> None:
        """A new epoch (fences every older one); a new producer id past :data:`MAX_EPOCH`."""
        if meta.epoch >= MAX_EPOCH:
            del self.by_pid[meta.pid]
            meta.pid = allocate()
            meta.epoch = 0
            self.by_pid[meta.pid] = meta
        else:
            meta.epoch += 1
        meta.bumped_by = why

    def reset(self, meta: TxnMeta, timeout_ms: int) -> None:
        """INIT_TXN of a new instance (the epoch was bumped, nothing is open)."""
        meta.move(TxnEvent.INIT)
        meta.timeout_ms = timeout_ms

    # -- an open transaction ---------------------------------------------------------------------

    def open_count(self) -> int:
        """Transactions open (begun or staged)."""
        return sum(1 for t in self.txns.values() if t.state in OPEN_STATES)

    def begin(self, meta: TxnMeta, now_ms: int, max_open: int) -> None:
        """Begin ``meta``'s transaction unless it is ongoing.

        Raises:
            ConcurrentTransactionsError: the previous one is still completing.
            InvalidTxnStateError: staged or decided: no more sends.
            BusyError: ``max_open`` transactions are open (``txn_max_open``).
        """
        if meta.state == TxnState.ONGOING:
            return
        if meta.completing:
            raise ConcurrentTransactionsError(
                f"the previous transaction of {meta.tid!r} is still completing")
        if not can(meta.state, TxnEvent.BEGIN):
            raise InvalidTxnStateError(
                f"transaction of {meta.tid!r} is {meta.state.name}: no more sends")
        if self.open_count() >= max_open:
            raise BusyError(f"{max_open} transactions open (txn_max_open); retry when some end")
        meta.move(TxnEvent.BEGIN)
        meta.started_ms = now_ms
        self.unanswered.pop(meta.tid, None)

    def add_offsets(self, meta: TxnMeta, group: str,
                    entries: Iterable[tuple[str, int, int]]) -> None:
        """Consumer offsets that commit with ``meta``'s (begun) transaction."""
        offs = meta.offsets.setdefault(group, {})
        for topic, queue, offset in entries:
            offs[(topic, queue)] = offset
            self.pending_offsets[(group, topic, queue)] = meta.tid

    def offsets_done(self, meta: TxnMeta, group: str | None = None) -> None:
        """``meta``'s offsets (of ``group``, None: all) were applied (commit) or dropped
        (abort): other transactions and plain commits may take those queues again."""
        for g, offs in meta.offsets.items():
            if group is not None and g != group:
                continue
            for t, q in offs:
                if self.pending_offsets.get((g, t, q)) == meta.tid:
                    del self.pending_offsets[(g, t, q)]

    def check_pending(self, group: str, topic: str, queue: int, tid: str = "") -> None:
        """Offsets of ``group`` on a queue may not be committed while a transaction other than
        ``tid``'s ("": any) holds offsets for it.

        Raises:
            ConcurrentTransactionsError.
        """
        owner = self.pending_offsets.get((group, topic, queue)) if self.pending_offsets else None
        if owner is not None and owner != tid:
            raise ConcurrentTransactionsError(
                f"{group} {topic}/{queue} has offsets pending in the transaction of {owner!r}")

    def unstable(self, group: str) -> list[tuple[str, int]]:
        """Queues of ``group`` with offsets pending in an open transaction."""
        return sorted((t, q) for (g, t, q) in self.pending_offsets if g == group)

    def stage(self, meta: TxnMeta, sink: tuple[str, int], ttl_ms: int, now_ms: int) -> None:
        """END_TXN stage of ``meta``'s (begun) transaction for a sink batch."""
        meta.move(TxnEvent.STAGE)
        meta.sink = sink
        meta.ttl_ms = ttl_ms
        meta.staged_ms = now_ms

    # -- deciding and completing -----------------------------------------------------------------

    def check_end(self, meta: TxnMeta, commit: bool) -> bool:
        """Whether END_TXN ``commit`` finds nothing open (True: the outcome asked for holds).

        Raises:
            InvalidTxnStateError: the opposite was asked for before and answered STORAGE_FULL
                after the decision was taken: it stands; or a staged transaction's commit (it
                commits with COMMIT_STAGED).
        """
        asked = self.unanswered.get(meta.tid)
        if asked is not None and asked != commit and meta.state not in OPEN_STATES:
            raise InvalidTxnStateError(
                f"the {'commit' if asked else 'abort'} of the transaction of {meta.tid!r} was "
                "answered STORAGE_FULL, but it was decided then: it "
                f"{'is' if meta.state in DONE_STATES else 'will be'} "
                f"{'committed' if asked else 'aborted'} (once disk space is back); retry "
                f"{'commit' if asked else 'abort'}, it cannot be "
                f"{'aborted' if asked else 'committed'} any more")
        if meta.state in DONE_STATES:
            self.unanswered.pop(meta.tid, None)
            # nothing open at this epoch: the transaction sent nothing (begin() is local), or
            # this is a retry whose first answer was lost; either way the outcome asked for
            # holds (a transaction the broker aborted on its own moved the epoch on, so its
            # producer gets TRANSACTION_TIMED_OUT or PRODUCER_FENCED before this)
            return True
        if meta.state not in PREPARE_STATES and not can(meta.state, _decision(commit)):
            raise InvalidTxnStateError(f"transaction of {meta.tid!r} is "
                                       f"{meta.state.name.lower()}: commit it with COMMIT_STAGED")
        return False

    def decide(self, meta: TxnMeta, commit: bool) -> bool:
        """Take the decision (PrepareX) or find it taken already; True when it is new.

        Raises:
            InvalidTxnStateError: the opposite was decided before (it completes once the
                storage lets it).
        """
        event = _decision(commit)
        if not can(meta.state, event):
            raise InvalidTxnStateError(
                f"the transaction of {meta.tid!r} is being "
                f"{'committed' if not commit else 'aborted'} (decided before the disk "
                "filled up; it completes once space is back)")
        new = meta.state not in PREPARE_STATES
        meta.move(event)
        return new

    def complete(self, meta: TxnMeta) -> bool:
        """The decided transaction completed (markers durable on every touched queue, offsets
        applied): CompleteX, with nothing open. Returns whether it committed."""
        meta.move(TxnEvent.COMPLETE)
        commit = meta.state == TxnState.COMPLETE_COMMIT
        if not commit:
            self.offsets_done(meta)
        meta.queues = {}
        meta.offsets = {}
        meta.sink = None
        meta.started_ms = 0
        meta.staged_ms = 0
        return commit

    # -- sinks -----------------------------------------------------------------------------------

    def last_batch(self, sink_id: str) -> int | None:
        """The sink's last committed batch id (None: never committed)."""
        last = self.sinks.get(sink_id)
        return None if last is None else last[0]

    @staticmethod
    def staged(meta: TxnMeta, pid: int, epoch: int, sink: tuple[str, int]) -> bool:
        """Whether ``meta`` is staged for ``sink`` at ``(pid, epoch)``, free to commit."""
        return (meta.pid == pid and meta.epoch == epoch
                and can(meta.state, TxnEvent.COMMIT_STAGED) and meta.sink == sink
                and not meta.completing)

    def commit_sink(self, sink_id: str, batch_id: int, at_ms: int,
                    members: Iterable[tuple[str, int, int]]) -> list[TxnMeta]:
        """A SinkCommit: the sink's fence moves to ``batch_id`` and its members staged at their
        epoch are decided (PREPARE_COMMIT); returns those members."""
        self.sinks[sink_id] = (batch_id, at_ms)
        out = []
        for tid, pid, epoch in members:
            meta = self.txns.get(tid)
            if (meta is not None and meta.pid == pid and meta.epoch == epoch
                    and can(meta.state, TxnEvent.COMMIT_STAGED)):
                meta.move(TxnEvent.COMMIT_STAGED)
                out.append(meta)
        return out

    def staged_of(self, sink_id: str, batch_id: int,
                  named: set[tuple[str, int, int]]) -> list[TxnMeta]:
        """The staged transactions of a sink batch free to abort (only ``named`` ones unless
        empty)."""
        return [
            meta for meta in self.txns.values()
            if meta.state == TxnState.STAGED and meta.sink == (sink_id, batch_id)
            and not meta.completing
            and (not named or (meta.tid, meta.pid, meta.epoch) in named)
        ]

    # -- housekeeping ----------------------------------------------------------------------------

    @staticmethod
    def expired(meta: TxnMeta, now_ms: int) -> bool:
        """Whether ``meta``'s open transaction is past its timeout (ongoing) or TTL (staged)."""
        return ((meta.state == TxnState.ONGOING and now_ms - meta.started_ms > meta.timeout_ms)
                or (meta.state == TxnState.STAGED and now_ms - meta.staged_ms > meta.ttl_ms))

    @staticmethod
    def idle(meta: TxnMeta, now_ms: int, expiration_ms: int) -> bool:
        """Whether ``meta`` has nothing open and was not used for ``expiration_ms``."""
        return meta.state in DONE_STATES and now_ms - meta.updated_ms > expiration_ms


def _decision(commit: bool) -> TxnEvent:
    return TxnEvent.COMMIT if commit else TxnEvent.ABORT
