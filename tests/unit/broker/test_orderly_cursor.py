"""OrderlyCursor.rewind: a scan whose position could not be journaled is undone exactly."""

from __future__ import annotations

import random

import pytest

from ferrymq.broker.delivery.orderly import OrderlyCursor
from ferrymq.broker.delivery.state import Lease


def state(c: OrderlyCursor) -> tuple[object, ...]:
    return (c.next, sorted(c.pending), dict(c.heads), {k: list(q) for k, q in c.held.items()},
            c.held_count, dict(c.key_of), sorted(c.ready), list(c._order))


@pytest.mark.parametrize("seed", range(20))
def test_rewind_restores_the_cursor_as_before_the_scan(seed: int) -> None:
    rnd = random.Random(seed)
    keys = ["", "a", "b", "c", "d"]
    c = OrderlyCursor("t", 0, 10)
    for o in range(10, 30):  # an earlier scan: heads, held messages, a lease, a finish
        c.examine(o, rnd.choice(keys))
    c.lease([c.heads["a"]] if "a" in c.heads else [], Lease(1, "m", ("t", 0), 0, 0))
    if "b" in c.heads:
        c.finish(c.heads["b"])
    before = state(c)
    start = c.next
    examined = []
    for o in range(start, start + rnd.randrange(1, 25)):
        if rnd.random() < 0.2:  # filtered out: the scan moves past it without examining it
            c.next = o + 1
            continue
        examined.append(o)
        c.examine(o, rnd.choice(keys))
    c.rewind(start, examined)
    assert state(c) == before
