"""The transaction coordinator's pure state (broker/txn/state.py), without a broker: the
(state, event) table, fencing, begin limits, decisions that never flip, sink fences, timeouts;
and the state log's records replayed into an equal book (broker/txn/statelog.py)."""

from __future__ import annotations

import itertools

import pytest

from ferrymq.broker.txn.state import (
    DONE_STATES,
    MAX_EPOCH,
    PREPARE_STATES,
    TRANSITIONS,
    TxnBook,
    TxnEvent,
    TxnMeta,
    step,
)
from ferrymq.broker.txn.statelog import apply_record, meta_record, sink_record
from ferrymq.errors import (
    BusyError,
    ConcurrentTransactionsError,
    InvalidTxnStateError,
    ProducerFencedError,
    TransactionTimedOutError,
)
from ferrymq.protocol.messages import TxnState


def book_with(*tids: str) -> TxnBook:
    book = TxnBook()
    for i, tid in enumerate(tids):
        book.put(TxnMeta(tid, 100 + i, 0, TxnState.EMPTY, 60_000))
    return book


@pytest.mark.parametrize(("state", "event"), list(itertools.product(TxnState, TxnEvent)))
def test_every_pair_moves_by_the_table_or_is_refused(state: TxnState, event: TxnEvent) -> None:
    if (state, event) in TRANSITIONS:
        assert step(state, event) is TRANSITIONS[(state, event)]
    else:
        with pytest.raises(InvalidTxnStateError, match=state.name):
            step(state, event)


def test_a_decision_only_completes_its_own_way() -> None:
    for (state, _event), nxt in TRANSITIONS.items():
        if state == TxnState.PREPARE_COMMIT:
            assert nxt in (TxnState.PREPARE_COMMIT, TxnState.COMPLETE_COMMIT)
        if state == TxnState.PREPARE_ABORT:
            assert nxt in (TxnState.PREPARE_ABORT, TxnState.COMPLETE_ABORT)
    book = book_with("a")
    meta = book.txns["a"]
    book.begin(meta, 5, 10)
    assert book.decide(meta, True) is True
    assert book.decide(meta, True) is False  # asked again: it stands
    with pytest.raises(InvalidTxnStateError, match="being committed"):
        book.decide(meta, False)
    assert meta.state == TxnState.PREPARE_COMMIT
    assert book.complete(meta) is True
    assert meta.state == TxnState.COMPLETE_COMMIT and not meta.queues and meta.started_ms == 0


def test_a_zombie_epoch_is_fenced_and_a_timed_out_one_told_so() -> None:
    book = book_with("a")
    meta = book.txns["a"]
    book.bump(meta, "init", lambda: 999)
    assert book.meta("a", 100, 1) is meta
    with pytest.raises(ProducerFencedError, match="fenced by a newer instance"):
        book.meta("a", 100, 0)
    with pytest.raises(ProducerFencedError):
        book.producer(100, 0)
    book.bump(meta, "timeout", lambda: 999)
    with pytest.raises(TransactionTimedOutError, match="after its timeout"):
        book.producer(100, 1)
    with pytest.raises(ProducerFencedError):
        book.producer(100, 0)  # only the epoch just before hears "timed out"
    with pytest.raises(InvalidTxnStateError, match="INIT_TXN first"):
        book.producer(555, 0)
    with pytest.raises(InvalidTxnStateError, match="INIT_TXN first"):
        book.meta("nobody", 100, 2)


def test_past_the_last_epoch_a_new_producer_id_fences_the_old_one() -> None:
    book = book_with("a")
    meta = book.txns["a"]
    meta.epoch = MAX_EPOCH
    book.bump(meta, "init", lambda: 4242)
    assert (meta.pid, meta.epoch) == (4242, 0)
    assert book.by_pid == {4242: meta}
    with pytest.raises(InvalidTxnStateError):
        book.producer(100, MAX_EPOCH)


def test_begin_is_refused_while_completing_staged_decided_or_at_the_limit() -> None:
    book = book_with("a", "b", "c")
    a, b, c = (book.txns[t] for t in "abc")
    book.begin(a, 1, 2)
    book.begin(a, 99, 2)  # ongoing: nothing changes
    assert a.started_ms == 1 and book.open_count() == 1
    book.begin(b, 2, 2)
    with pytest.raises(BusyError, match="txn_max_open"):
        book.begin(c, 3, 2)
    assert c.state == TxnState.EMPTY
    book.decide(b, False)
    b.completing = True
    with pytest.raises(ConcurrentTransactionsError):
        book.begin(b, 4, 2)
    b.completing = False
    with pytest.raises(InvalidTxnStateError, match="no more sends"):
        book.begin(b, 4, 2)
    book.stage(a, ("sink", 3), 1000, 10)
    with pytest.raises(InvalidTxnStateError, match="STAGED: no more sends"):
        book.begin(a, 11, 5)


def test_end_after_storage_full_cannot_flip_the_decision() -> None:
    book = book_with("a")
    meta = book.txns["a"]
    book.begin(meta, 1, 5)
    book.decide(meta, True)
    book.unanswered["a"] = True  # the commit was answered STORAGE_FULL
    with pytest.raises(InvalidTxnStateError, match="cannot be aborted any more"):
        book.check_end(meta, False)
    assert book.check_end(meta, True) is False  # a retry goes on with it
    book.complete(meta)
    with pytest.raises(InvalidTxnStateError, match="it is committed"):
        book.check_end(meta, False)
    assert book.check_end(meta, True) is True and "a" not in book.unanswered


def test_a_staged_transaction_commits_only_with_its_sink_batch() -> None:
    book = book_with("a")
    meta = book.txns["a"]
    book.begin(meta, 1, 5)
    book.stage(meta, ("s", 7), 500, 2)
    with pytest.raises(InvalidTxnStateError, match="commit it with COMMIT_STAGED"):
        book.check_end(meta, True)
    assert not book.staged(meta, 100, 0, ("s", 8))
    assert not book.staged(meta, 100, 1, ("s", 7))
    assert book.staged(meta, 100, 0, ("s", 7))
    assert book.staged_of("s", 7, set()) == [meta]
    assert book.staged_of("s", 7, {("a", 100, 1)}) == []
    assert book.commit_sink("s", 7, 9, [("a", 100, 0)]) == [meta]
    assert meta.state == TxnState.PREPARE_COMMIT and book.last_batch("s") == 7
    assert book.commit_sink("s", 7, 9, [("a", 100, 0)]) == []  # decided once


def test_offsets_wait_in_the_transaction_and_leave_with_it() -> None:
    book = book_with("a", "b")
    a = book.txns["a"]
    book.begin(a, 1, 5)
    book.add_offsets(a, "g", [("t", 0, 5), ("t", 1, 6)])
    assert book.unstable("g") == [("t", 0), ("t", 1)]
    book.check_pending("g", "t", 0, "a")
    with pytest.raises(ConcurrentTransactionsError, match="'a'"):
        book.check_pending("g", "t", 0, "b")
    with pytest.raises(ConcurrentTransactionsError):
        book.check_pending("g", "t", 1)
    book.decide(a, False)
    book.complete(a)
    assert book.unstable("g") == [] and a.offsets == {}


def test_timeouts_and_idle_ids() -> None:
    book = book_with("a", "b")
    a, b = book.txns["a"], book.txns["b"]
    book.begin(a, 1_000, 5)
    assert not book.expired(a, 1_000 + a.timeout_ms)
    assert book.expired(a, 1_001 + a.timeout_ms)
    book.begin(b, 0, 5)
    book.stage(b, ("s", 1), 50, 100)
    assert not book.expired(b, 150) and book.expired(b, 151)
    c = TxnMeta("c", 7, 0, TxnState.COMPLETE_ABORT, 1, updated_ms=10)
    book.put(c)
    assert not book.idle(c, 20, 10) and book.idle(c, 21, 10)
    assert not book.idle(a, 10**12, 10)
    book.forget(c)
    assert "c" not in book.txns and 7 not in book.by_pid


def test_records_replayed_give_the_same_book() -> None:
    live = book_with("a", "b", "c")
    a, b, c = (live.txns[t] for t in "abc")
    live.begin(a, 1, 5)
    a.queues[("t", 0)] = None
    live.add_offsets(a, "g", [("t", 0, 3)])
    live.begin(b, 2, 5)
    live.stage(b, ("s", 4), 100, 3)
    live.bump(c, "init", lambda: 0)
    records = [meta_record(m) for m in (a, b, c)]
    records.append(sink_record("s", 4, 8, [("b", b.pid, b.epoch)]))
    live.commit_sink("s", 4, 8, [("b", b.pid, b.epoch)])
    again = TxnBook()
    for rec in records:
        apply_record(again, rec)
    assert {t: meta_record(m) for t, m in again.txns.items()} == {
        t: meta_record(m) for t, m in live.txns.items()}
    assert again.sinks == live.sinks
    assert again.txns["b"].state in PREPARE_STATES
    assert again.txns["c"].state in DONE_STATES
