"""The producer's accumulator and sender without a broker: queue choice, batching limits,
kinds, back-pressure, sequence numbers and the retry order (no sockets: the session only
holds topic metadata filled in by hand)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ferrymq.client._accumulator import Accumulator, QueueBuffer, Unit
from ferrymq.client._cluster import Cluster
from ferrymq.client._sender import Batch, Sender
from ferrymq.client._session import Session, TopicInfo
from ferrymq.client._txn_manager import IN_TXN, TxnManager
from ferrymq.client.message import Message
from ferrymq.client.partitioner import queue_for_key
from ferrymq.errors import (
    ClientError,
    InvalidRequestError,
    MessageTooLargeError,
    TxnUsageError,
    UnknownQueueError,
)
from ferrymq.protocol.records import (
    ATTR_DEDUP,
    ATTR_SCHEDULED,
    ATTR_TRANSACTIONAL,
    NO_SEQUENCE,
    RECORD_PREFIX_SIZE,
    decode_header,
)
from ferrymq.testing import FakeClock


def _parts(session: Session | None = None, cluster: Cluster | None = None,
           **options: Any) -> tuple[Session, Accumulator, asyncio.Event]:
    session = session or Session("127.0.0.1:1")
    session.topics["t"] = TopicInfo("t", 1, 4)
    session.topics["d"] = TopicInfo("d", 2, 2, dedup_window_ms=60_000)
    wake = asyncio.Event()
    settings: dict[str, Any] = {
        "linger_s": 0.0, "batch_max_bytes": 1 << 20, "batch_max_records": 1000,
        "max_buffer_bytes": 1 << 20, "selector": None, "sticky_queue_bytes": 0,
        "auto_create": False, "clock": FakeClock(),
    }
    settings.update(options)
    return session, Accumulator(session, cluster or Cluster(session), wake, **settings), wake


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_sharding_key_picks_its_stable_queue() -> None:
    async def main() -> None:
        _, acc, wake = _parts()
        fut = asyncio.get_running_loop().create_future()
        acc.enqueue(Message("t", b"x", sharding_key="order-7"), Unit(1, fut, False),
                    immediate=True)
        assert list(acc.buffers) == [("t", queue_for_key("order-7", 4))]
        b = acc.buffers["t", queue_for_key("order-7", 4)]
        assert b.ready and wake.is_set()
        assert b.nbytes == acc.buffered_bytes == 1 + RECORD_PREFIX_SIZE

    _run(main())


def test_a_selector_out_of_range_fails_the_send_not_the_producer() -> None:
    async def main() -> None:
        _, acc, _ = _parts(selector=lambda _m, n: n)
        fut = asyncio.get_running_loop().create_future()
        acc.enqueue(Message("t", b"x"), Unit(1, fut, False), immediate=True)
        with pytest.raises(UnknownQueueError, match="selector chose queue 4 of 4"):
            await fut
        assert not acc.buffers

    _run(main())


def test_a_message_over_the_brokers_limit_is_refused_before_buffering() -> None:
    async def main() -> None:
        _, acc, _ = _parts()
        acc.max_message_bytes = 100
        fut = asyncio.get_running_loop().create_future()
        acc.enqueue(Message("t", b"x" * 100), Unit(1, fut, False), immediate=True)
        with pytest.raises(MessageTooLargeError, match="max_message_bytes 100"):
            await fut
        assert acc.buffered_bytes == 0

    _run(main())


def test_a_delay_beyond_the_brokers_limit_is_refused() -> None:
    async def main() -> None:
        _, acc, _ = _parts()
        acc.max_delay_ms = 1000
        fut = asyncio.get_running_loop().create_future()
        acc.enqueue(Message("t", b"x", delay=2.0), Unit(1, fut, False), immediate=True)
        with pytest.raises(InvalidRequestError, match="exceeds the broker's max_delay_ms"):
            await fut

    _run(main())


def test_lingering_buffers_wait_for_the_timer() -> None:
    async def main() -> None:
        _, acc, wake = _parts(linger_s=0.02, selector=lambda _m, _n: 0)
        acc.enqueue(Message("t", b"a"), Unit(1, None, False), immediate=False)
        b = acc.buffers["t", 0]
        assert not b.ready and not wake.is_set() and b.timer is not None
        await asyncio.wait_for(wake.wait(), 1.0)
        assert b.ready and b.timer is None

    _run(main())


def test_a_full_buffer_is_ready_without_lingering() -> None:
    async def main() -> None:
        _, acc, wake = _parts(linger_s=10.0, batch_max_records=3, selector=lambda _m, _n: 0)
        for _ in range(2):
            acc.enqueue(Message("t", b"a"), Unit(1, None, False), immediate=False)
        assert not acc.buffers["t", 0].ready
        acc.enqueue(Message("t", b"a"), Unit(1, None, False), immediate=False)
        assert acc.buffers["t", 0].ready and wake.is_set()
        acc.drain(acc.buffers["t", 0])  # cancels the linger timer

    _run(main())


def test_drain_takes_whole_units_of_one_kind_within_the_limits() -> None:
    async def main() -> None:
        _, acc, _ = _parts(batch_max_records=5, selector=lambda _m, _n: 0)
        loop = asyncio.get_running_loop()
        b = acc.buffer(acc._session.topics["t"], 0)
        units = [Unit(n, loop.create_future(), True) for n in (2, 2, 2)]
        for u in units:
            acc.add(b, [Message("t", b"x").to_record(0)] * u.count, u, immediate=True)
        records, taken, nbytes, attrs = acc.drain(b)
        # 2 + 2 fit in 5 records; the third unit does not (units are never split)
        assert (len(records), taken, attrs) == (4, units[:2], 0)
        assert nbytes == 4 * (1 + RECORD_PREFIX_SIZE)
        assert b.ready and acc.buffered_bytes == 2 * (1 + RECORD_PREFIX_SIZE)
        records, taken, _, _ = acc.drain(b)
        assert (len(records), taken) == (2, units[2:])
        assert not b.ready and not b.records and acc.buffered_bytes == 0

    _run(main())


def test_an_oversized_unit_goes_alone() -> None:
    async def main() -> None:
        _, acc, _ = _parts(batch_max_records=2, selector=lambda _m, _n: 0)
        b = acc.buffer(acc._session.topics["t"], 0)
        u = Unit(3, None, True)
        acc.add(b, [Message("t", b"x").to_record(0)] * 3, u, immediate=True)
        records, taken, _, _ = acc.drain(b)
        assert (len(records), taken) == (3, [u])

    _run(main())


def test_a_change_of_kind_ships_what_was_buffered_before_it() -> None:
    async def main() -> None:
        _, acc, _ = _parts(linger_s=10.0, selector=lambda _m, _n: 0)
        acc.enqueue(Message("d", b"plain"), Unit(1, None, False), immediate=False)
        b = acc.buffers["d", 0]
        assert not b.ready
        acc.enqueue(Message("d", b"once", dedup_key="k1"), Unit(1, None, False), immediate=False)
        assert b.ready  # the plain message may not wait in a batch with the dedup one
        _, taken, _, attrs = acc.drain(b)
        assert (len(taken), attrs) == (1, 0)
        _, taken, _, attrs = acc.drain(b)
        assert (len(taken), attrs) == (1, ATTR_DEDUP)

    _run(main())


def test_scheduled_messages_are_their_own_kind() -> None:
    async def main() -> None:
        _, acc, _ = _parts(selector=lambda _m, _n: 0)
        acc.enqueue(Message("t", b"later", delay=5.0), Unit(1, None, False), immediate=True)
        assert acc.buffers["t", 0].units[0].attrs == ATTR_SCHEDULED
        # a dedup key on a topic without a dedup window is just stored: no ATTR_DEDUP
        acc.enqueue(Message("t", b"k", dedup_key="k"), Unit(1, None, False), immediate=True)
        assert acc.buffers["t", 0].units[1].attrs == 0

    _run(main())


def test_send_batch_keyless_messages_share_one_queue_per_call() -> None:
    async def main() -> None:
        _, acc, _ = _parts(sticky_queue_bytes=0)
        rr_queue = acc._rr.pick("t", 4)  # where this call's keyless messages go (random start)
        key = next(k for k in "abcdefgh" if queue_for_key(k, 4) != rr_queue)
        msgs = [Message("t", b"x") for _ in range(5)] + [Message("t", b"y", sharding_key=key)]
        futs = acc.enqueue_batch(msgs)
        assert [idxs for idxs, _ in futs] == [[0, 1, 2, 3, 4], [5]]
        assert [r.body for r in acc.buffers["t", rr_queue].records] == [b"x"] * 5
        assert len(acc.buffers["t", rr_queue].units) == 1  # one unit: one record batch
        assert [r.body for r in acc.buffers["t", queue_for_key(key, 4)].records] == [b"y"]

    _run(main())


class _InstantMetadata(Session):
    """Answers a topic's metadata look-up at once from ``metadata`` (no socket)."""

    metadata: dict[str, TopicInfo]

    async def topic(self, name: str, *, auto_create: bool = True,
                    refresh: bool = False) -> TopicInfo:
        info = self.topics[name] = self.metadata[name]
        return info


class _SlowLeaders(Cluster):
    """Learns a topic's leaders only once the test sets ``answered`` (a refresh in flight)."""

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        self.answered = asyncio.Event()

    async def ensure(self, topic: str) -> None:
        await self.answered.wait()


def test_a_send_while_its_topics_leaders_are_looked_up_waits_behind_earlier_ones() -> None:
    async def main() -> None:
        session = _InstantMetadata("127.0.0.1:1")
        session.metadata = {"new": TopicInfo("new", 3, 4)}
        cluster = _SlowLeaders(session)
        _, acc, wake = _parts(session, cluster)
        acc.enqueue(Message("new", b"first", sharding_key="k"), Unit(1, None, False),
                    immediate=False)
        for _ in range(10):  # the look-up: the metadata comes back, the leaders do not yet
            await asyncio.sleep(0)
        assert "new" in session.topics and "new" in acc.unresolved
        acc.enqueue(Message("new", b"second", sharding_key="k"), Unit(1, None, False),
                    immediate=False)
        acc.enqueue_batch([Message("new", b"third", sharding_key="k")])
        assert not acc.buffers  # nothing can be sent before its leader is known
        cluster.answered.set()
        await asyncio.wait_for(wake.wait(), 1.0)
        b = acc.buffers["new", queue_for_key("k", 4)]
        assert [r.body for r in b.records] == [b"first", b"second", b"third"]  # send order

    _run(main())


def test_back_pressure_waits_until_the_sender_drains() -> None:
    async def main() -> None:
        _, acc, _ = _parts(max_buffer_bytes=10, selector=lambda _m, _n: 0)
        acc.enqueue(Message("t", b"x" * 20), Unit(1, None, False), immediate=True)
        waiting = asyncio.create_task(acc.wait_for_space())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        acc.drain(acc.buffers["t", 0])
        await asyncio.wait_for(waiting, 1.0)

    _run(main())


def test_a_closed_accumulator_refuses_sends() -> None:
    async def main() -> None:
        _, acc, _ = _parts()
        acc.closed = True
        with pytest.raises(ClientError, match="producer is closed"):
            await acc.wait_for_space()
        fut = asyncio.get_running_loop().create_future()
        acc.enqueue(Message("t", b"x"), Unit(1, fut, False), immediate=True)
        with pytest.raises(ClientError, match="producer is closed"):
            await fut

    _run(main())


# -- the sender's batches ------------------------------------------------------------------------


def _sender(acc: Accumulator, session: Session, wake: asyncio.Event, *,
            idempotent: bool = True) -> Sender:
    return Sender(session, Cluster(session), acc, wake, request_timeout_s=5.0,
                  delivery_timeout_s=60.0, idempotent=idempotent, max_in_flight=4,
                  max_request_bytes=1 << 20)


def test_batches_carry_the_queues_next_sequence() -> None:
    async def main() -> None:
        session, acc, wake = _parts(selector=lambda _m, _n: 0)
        sender = _sender(acc, session, wake)
        sender.restart_sequences(7, 3)
        b = acc.buffer(session.topics["t"], 0)
        acc.add(b, [Message("t", b"x").to_record(0)] * 3, Unit(3, None, True), immediate=True)
        first = sender._close_batch(b, 0.0)
        acc.add(b, [Message("t", b"x").to_record(0)] * 2, Unit(2, None, True), immediate=True)
        second = sender._close_batch(b, 0.0)
        assert (first.seq, second.seq, b.next_seq) == (0, 3, 5)
        h = decode_header(bytes(second.data))
        assert (h.producer_id, h.producer_epoch, h.base_sequence) == (7, 3, 3)
        assert not h.attributes & ATTR_TRANSACTIONAL
        assert b.outstanding == [first, second]
        sender.restart_sequences(7, 4)  # a new epoch: every queue from sequence 0
        assert b.next_seq == 0

    _run(main())


def test_dedup_batches_have_no_sequence() -> None:
    async def main() -> None:
        session, acc, wake = _parts(selector=lambda _m, _n: 0)
        sender = _sender(acc, session, wake)
        sender.restart_sequences(7, 0)
        acc.enqueue(Message("d", b"x", dedup_key="k"), Unit(1, None, False), immediate=True)
        bt = sender._close_batch(acc.buffers["d", 0], 0.0)
        h = decode_header(bytes(bt.data))
        assert bt.seq == h.base_sequence == NO_SEQUENCE and h.attributes & ATTR_DEDUP
        assert acc.buffers["d", 0].next_seq == 0

    _run(main())


def test_retries_go_one_per_queue_lowest_sequence_first() -> None:
    async def main() -> None:
        session, acc, wake = _parts()
        sender = _sender(acc, session, wake)
        qa: QueueBuffer = acc.buffer(session.topics["t"], 0)
        qb: QueueBuffer = acc.buffer(session.topics["t"], 1)

        def failed(b: QueueBuffer, seq: int, not_before: float = 0.0) -> Batch:
            bt = Batch(b, bytearray(), [], 1, 100.0, seq, not_before=not_before)
            b.outstanding.append(bt)
            b.retrying += 1
            sender._retry.append(bt)
            return bt

        a2, a1 = failed(qa, 2), failed(qa, 1)
        b5 = failed(qb, 5, not_before=10.0)
        assert sender._due_retries(1.0) == [a1]  # b5 still waits for its backoff
        assert sender._retry == [a2, b5]
        assert sender._due_retries(1.0) == []  # a1 is on the wire: a2 waits for it
        qa.outstanding.remove(a1)
        assert sender._due_retries(11.0) == [a2, b5]

    _run(main())


# -- the transaction manager's rules for a send ---------------------------------------------------


def test_a_transactional_send_needs_an_open_transaction() -> None:
    async def main() -> None:
        session, acc, wake = _parts()
        sender = _sender(acc, session, wake)
        txn = TxnManager(Cluster(session), acc, sender, "tx", 0)
        acc.txn = sender.txn = txn
        fut = asyncio.get_running_loop().create_future()
        acc.enqueue(Message("t", b"x"), Unit(1, fut, False), immediate=True)
        with pytest.raises(TxnUsageError, match="only between begin"):
            await fut
        txn.state = IN_TXN
        with pytest.raises(ValueError, match="dedup keys cannot be used inside a transaction"):
            txn.check_send(Message("t", b"x", dedup_key="k"))
        acc.enqueue(Message("t", b"x"), Unit(1, None, False), immediate=True)
        b = next(iter(acc.buffers.values()))
        assert decode_header(bytes(sender._close_batch(b, 0.0).data)).attributes \
            & ATTR_TRANSACTIONAL

    _run(main())
