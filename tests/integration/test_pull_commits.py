"""What a pull consumer commits: auto-commit stores only batches the application finished (it
called poll() again), so a loop interrupted mid-batch loses nothing; commit() stores everything
returned so far; a seek moves what is committed too."""

from __future__ import annotations

import time

import pytest

from ferrymq import AdminClient, Broker, Message, Producer, PullConsumer

pytestmark = pytest.mark.integration

TOTAL = 6000
STOP_AFTER = 3456  # about this many processed when the loop is interrupted, mid-batch


def _produce(address: str, topic: str) -> None:
    with AdminClient(address) as admin:
        admin.create_topic(topic, 4)
    with Producer(address) as p:
        for start in range(0, TOTAL, 500):
            p.send_batch([Message(topic, f"m{i}") for i in range(start, start + 500)])


def _interrupted_loop(address: str, topic: str, **options: object
                      ) -> tuple[set[tuple[int, int]], dict[tuple[str, int], int]]:
    """The README's pull loop, interrupted (KeyboardInterrupt) in the middle of a batch.
    Returns what it processed and the group's committed offsets at the moment of the
    interrupt (before leaving the ``with`` block)."""
    processed: set[tuple[int, int]] = set()
    committed_at_interrupt: dict[tuple[str, int], int] = {}

    def run() -> None:
        with PullConsumer(address, "billing", auto_offset_reset="earliest", **options) as c:
            c.subscribe(topic)
            while True:
                batch = c.poll(timeout=1.0, max_messages=500)
                for i, msg in enumerate(batch):
                    if len(processed) >= STOP_AFTER and i > 0:  # inside a batch
                        committed_at_interrupt.update(c.committed())
                        raise KeyboardInterrupt
                    processed.add((msg.queue, msg.offset))

    with pytest.raises(KeyboardInterrupt):
        run()
    return processed, committed_at_interrupt


def _read_rest(address: str, topic: str) -> list[tuple[int, int]]:
    got: list[tuple[int, int]] = []
    with PullConsumer(address, "billing", auto_offset_reset="earliest") as c:
        c.subscribe(topic)
        quiet_until = time.monotonic() + 2.0
        while time.monotonic() < quiet_until:
            batch = c.poll(timeout=0.2)
            if batch:
                got += [(m.queue, m.offset) for m in batch]
                quiet_until = time.monotonic() + 1.0
    return got


def _check_nothing_skipped(broker: Broker, topic: str, processed: set[tuple[int, int]]) -> None:
    with AdminClient(broker.address) as admin:
        ends = {q: end for q, _start, end, *_ in admin.describe_topic(topic).queues}
    everything = {(q, o) for q, end in ends.items() for o in range(end)}
    assert len(everything) == TOTAL
    rest = _read_rest(broker.address, topic)
    unfinished = everything - processed
    assert unfinished <= set(rest), f"{len(unfinished - set(rest))} messages skipped for good"
    # and the finished batches were committed: at most the interrupted batch is read again
    assert len(rest) - len(unfinished) < 500


def test_an_interrupted_with_block_commits_only_finished_batches(broker: Broker) -> None:
    _produce(broker.address, "orders")
    processed, _ = _interrupted_loop(broker.address, "orders", auto_commit_interval_s=3600)
    assert STOP_AFTER <= len(processed) < TOTAL
    _check_nothing_skipped(broker, "orders", processed)


def test_periodic_auto_commit_stores_only_finished_batches(broker: Broker) -> None:
    _produce(broker.address, "orders2")
    processed, committed = _interrupted_loop(broker.address, "orders2",
                                             auto_commit_interval_s=0.0)
    assert committed, "the periodic auto-commit ran"
    # at the interrupt, no committed offset is past a message the loop had not processed
    for (_topic, queue), offset in committed.items():
        assert all((queue, o) in processed for o in range(offset)), (queue, offset)
    _check_nothing_skipped(broker, "orders2", processed)


def test_commit_stores_everything_returned_and_seek_moves_the_finished_position(
        broker: Broker) -> None:
    with AdminClient(broker.address) as admin:
        admin.create_topic("one", 1)
    with Producer(broker.address) as p:
        p.send_batch([Message("one", f"m{i}") for i in range(30)])
    with PullConsumer(broker.address, "g", auto_offset_reset="earliest") as c:
        c.subscribe("one")
        got = []
        while len(got) < 10:
            got += c.poll(timeout=1.0, max_messages=10 - len(got))
        c.commit()  # the application says it is done with all of them
        assert c.committed() == {("one", 0): 10}
        c.poll(timeout=1.0, max_messages=5)  # returned, never finished
    with PullConsumer(broker.address, "g") as c:
        c.subscribe("one")
        assert c.committed() == {("one", 0): 10}  # close() did not store the unfinished 5
        c.poll(timeout=1.0, max_messages=1)
        c.seek("one", 0, 3)  # replay from 3: what auto-commit stores follows
    with PullConsumer(broker.address, "g") as c:
        c.subscribe("one")
        assert c.committed() == {("one", 0): 3}


def test_a_commit_refused_for_an_expired_member_makes_the_next_poll_rejoin(broker: Broker) -> None:
    """The broker dropped a member whose heartbeats stopped (its session timed out); its next
    commit is refused (UnknownMemberError) and its next poll rejoins at once, not at its next
    heartbeat (Kafka's consumer too), so the commit after that works."""
    from ferrymq.errors import UnknownMemberError

    with AdminClient(broker.address) as admin:
        admin.create_topic("expiry", 1)
    with Producer(broker.address) as p:
        p.send_batch([Message("expiry", f"m{i}") for i in range(20)])
    with PullConsumer(broker.address, "expiring", auto_offset_reset="earliest",
                      auto_commit=False, heartbeat_interval_s=120,
                      session_timeout_s=1.0) as c:
        c.subscribe("expiry")
        while not c.poll(timeout=0.5, max_messages=5):
            pass
        time.sleep(2.5)  # no heartbeat: the broker expires the member
        with pytest.raises(UnknownMemberError):
            c.commit()
        deadline = time.monotonic() + 10
        while True:
            c.poll(timeout=0.2, max_messages=5)
            try:
                c.commit()
                break
            except UnknownMemberError:
                assert time.monotonic() < deadline, "the member never rejoined"
