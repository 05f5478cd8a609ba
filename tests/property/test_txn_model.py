"""Randomized model test of transactions: three transactional producers (and one plain one)
make random sends, commits, aborts and restarts on four queues; a read_committed reader must see
exactly the model's committed messages, per queue in append order, and a read_uncommitted reader
everything that was stored."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ferrymq import AdminClient, Broker, Message, Producer, PullConsumer

QUEUES = 4


def read_all(address: str, isolation: str) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {q: [] for q in range(QUEUES)}
    with PullConsumer(address, f"model-{isolation}", auto_offset_reset="earliest",
                      auto_commit=False, isolation=isolation) as c:
        c.assign([("t", q) for q in range(QUEUES)])
        idle = 0
        while idle < 3:
            batch = c.poll(timeout=0.2, max_messages=1000)
            idle = 0 if batch else idle + 1
            for msg in batch:
                out[msg.queue].append(msg.body)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_read_committed_view_matches_the_model(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    with Broker(tmp_path / "d") as b:
        with AdminClient(b.address) as a:
            a.create_topic("t", QUEUES)
        selector = {"queue_selector": lambda msg, _n: int(msg.properties["q"])}
        tids = ["p0", "p1", "p2"]
        producers = {t: Producer(b.address, transactional_id=t, **selector) for t in tids}
        plain = Producer(b.address, **selector)
        log: dict[int, list[bytes]] = {q: [] for q in range(QUEUES)}  # append order
        open_txn: dict[str, list[bytes]] = {}
        committed: set[bytes] = set()
        n = 0
        try:
            for _ in range(120):
                op = rng.random()
                t = rng.choice(tids)
                p = producers[t]
                if op < 0.5:
                    if t not in open_txn:
                        p.begin()
                        open_txn[t] = []
                    q = rng.randrange(QUEUES)
                    body = f"{t}-{n}".encode()
                    n += 1
                    p.send(Message("t", body, properties={"q": str(q)}))
                    log[q].append(body)
                    open_txn[t].append(body)
                elif op < 0.65:
                    q = rng.randrange(QUEUES)
                    body = f"plain-{n}".encode()
                    n += 1
                    plain.send(Message("t", body, properties={"q": str(q)}))
                    log[q].append(body)
                    committed.add(body)
                elif op < 0.8 and t in open_txn:
                    p.commit()
                    committed.update(open_txn.pop(t))
                elif op < 0.9 and t in open_txn:
                    p.abort()
                    open_txn.pop(t)
                elif op >= 0.95:  # a new instance fences the old one and aborts its txn
                    p.close()
                    open_txn.pop(t, None)
                    producers[t] = Producer(b.address, transactional_id=t, **selector)
            for t in list(open_txn):  # end everything, some each way
                if rng.random() < 0.5:
                    producers[t].commit()
                    committed.update(open_txn.pop(t))
                else:
                    producers[t].abort()
                    open_txn.pop(t)
        finally:
            for p in producers.values():
                p.close()
            plain.close()
        expect = {q: [x for x in log[q] if x in committed] for q in range(QUEUES)}
        assert read_all(b.address, "read_committed") == expect
        assert read_all(b.address, "read_uncommitted") == log
