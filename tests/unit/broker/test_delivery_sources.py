"""BufferedQueue: a source queue read from its leader, held in memory for one delivery group
(ferrymq.broker.delivery.sources): reads like a Log, follows the group's cursor floor, stays
within its byte limit, and knows the aborted transactions of what it holds."""

from __future__ import annotations

import asyncio

import pytest

from ferrymq.broker.delivery.sources import BufferedQueue, RemoteBudget
from ferrymq.errors import BusyError
from ferrymq.protocol.markers import encode_marker
from ferrymq.protocol.records import (
    ATTR_TRANSACTIONAL,
    RecordInput,
    encode_batch,
    iter_batches,
    stamp_batch,
)


def batch(base: int, n: int, *, pid: int = -1, attributes: int = 0) -> bytes:
    buf = encode_batch([RecordInput(f"m{base + i}".encode(), 1) for i in range(n)],
                       producer_id=pid, producer_epoch=0 if pid >= 0 else -1,
                       attributes=attributes)
    stamp_batch(buf, 0, base, 1000)
    return bytes(buf)


def marker(base: int, pid: int) -> bytes:
    buf = bytearray(encode_marker(producer_id=pid, producer_epoch=0, commit=False,
                                  transactional_id="t", coordinator_offset=0, timestamp_ms=1))
    stamp_batch(buf, 0, base, 1000)
    return bytes(buf)


class Floor:
    def __init__(self) -> None:
        self.value: int | None = None
        self.moves = 0

    def __call__(self) -> int | None:
        return self.value

    def moved(self) -> None:
        self.moves += 1


def buffered(limit: int = 1 << 20, at: int | None = None) -> tuple[BufferedQueue, Floor]:
    """A listed buffer (the leader's offsets 0..100), positioned at ``at`` (None: no cursor)."""
    f = Floor()
    q = BufferedQueue("t", 1 << 30, 0, limit, f, f.moved)
    q.leader_start, q.listed_end = 0, 100
    f.value = at
    q.sync()
    return q, f


def bases(data: bytes) -> list[int]:
    return [h.base_offset for _, h in iter_batches(data)]


def test_before_a_cursor_it_answers_the_leaders_offsets_and_reads_nothing() -> None:
    q, _ = buffered()
    assert (q.start_offset, q.lso, q.end_offset) == (0, 100, 100)
    assert q.room == 0  # not positioned: nothing is fetched
    q.add(batch(0, 1), 0, [])  # (an answer to a fetch of a buffer since started again)
    assert q.size == 0
    with pytest.raises(BusyError):
        q.read(0, 100)


def test_it_starts_at_the_cursor_floor_and_reads_whole_batches_like_a_log() -> None:
    q, f = buffered()
    f.value = 10
    assert q.lso == 10 and q.first == 10 and f.moves == 1
    q.add(batch(8, 4) + batch(12, 3) + batch(15, 5), 0, [])  # the first holds the floor
    assert q.lso == 20
    assert bases(q.read(11, 1)) == [8]  # at least one batch
    assert bases(q.read(11, 10_000)) == [8, 12, 15]
    assert bases(q.read(11, 10_000, upto_offset=17)) == [8, 12]  # none ending at or past it
    with pytest.raises(BusyError):
        q.read(20, 10)  # not fetched yet: never "not stored"
    with pytest.raises(BusyError):
        q.read(5, 10)  # below the buffer


def test_the_floor_moving_up_drops_whole_batches_below_it_and_makes_room() -> None:
    q, f = buffered(at=0)
    data = batch(0, 4) + batch(4, 4) + batch(8, 4)
    q.add(data, 0, [])
    assert q.size == len(data)
    f.value = 6
    assert q.lso == 12
    assert q.size == len(data) - len(batch(0, 4))
    assert bases(q.read(6, 10_000)) == [4, 8]
    f.value = 40  # beyond the buffer (retention at the leader): starts again there
    gen = q.generation
    assert q.lso == 40 and q.size == 0 and q.generation == gen + 1


def test_room_is_what_the_limit_leaves_and_answers_already_held_are_skipped() -> None:
    one = batch(0, 4)
    q, _ = buffered(limit=len(one) * 2, at=0)
    assert q.room == len(one) * 2
    q.add(one, 0, [])
    q.add(one + batch(4, 4), 0, [])  # an overlapping answer: the first batch is held already
    assert q.size == len(one) * 2 and q.room == 0 and q.end == 8


def test_the_broker_wide_budget_bounds_every_buffer_together() -> None:
    """delivery_remote_buffers_total_bytes: one buffer's batches leave the others less room;
    a floor moving up, a restart and a stopped reader give the bytes back."""
    one = batch(0, 4)
    budget = RemoteBudget(len(one) * 3)
    f1, f2 = Floor(), Floor()
    q1 = BufferedQueue("t", 1 << 30, 0, 1 << 20, f1, f1.moved, budget)
    q2 = BufferedQueue("t", 1 << 30, 1, 1 << 20, f2, f2.moved, budget)
    for q, f in ((q1, f1), (q2, f2)):
        q.leader_start, q.listed_end = 0, 100
        f.value = 0
        q.sync()
    q1.add(one + batch(4, 4), 0, [])
    assert budget.used == 2 * len(one) and q2.room == len(one) and q1.room == len(one)
    q2.add(one, 0, [])
    assert budget.used == 3 * len(one) and q1.room == 0 and q2.room == 0  # all full together
    f1.value = 4
    q1.sync()  # the group finished offsets 0..3 of queue 0: their batch goes
    assert budget.used == 2 * len(one) and q2.room == len(one)
    f2.value = 50
    q2.sync()  # started again beyond what it held
    assert budget.used == len(one)
    q1.release()  # its reader stopped
    assert budget.used == 0 and q2.room == 3 * len(one)


def test_aborted_transactions_end_at_their_marker() -> None:
    q, _ = buffered(at=0)
    q.add(batch(0, 2, pid=7, attributes=ATTR_TRANSACTIONAL) + marker(2, 7) + batch(3, 2), 0,
          [(7, 0)])
    assert q.aborted_txns(0, 5) == [(7, 0)]
    assert q.aborted_txns(3, 5) == []  # its marker is at 2: not in [3, 5)
    q.add(batch(5, 1, pid=7, attributes=ATTR_TRANSACTIONAL), 0, [(7, 5)])
    assert q.aborted_txns(3, 6) == [(7, 5)]  # the next one, its marker not fetched yet


def test_growth_wakes_the_long_polls() -> None:
    async def body() -> None:
        q, _ = buffered(at=0)
        w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        q.waiters.add(w)
        q.add(batch(0, 1), 0, [])
        assert w.done() and not q.waiters

    asyncio.run(body())
