"""The broker's heap freezer: it freezes after start and again only when the queue count moved by
a quarter (and at least MIN_QUEUE_CHANGE queues), unfreezing first so deleted topics can go."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from ferrymq.broker.heap import MIN_QUEUE_CHANGE, HeapFreezer


@pytest.fixture(autouse=True)
def _thawed() -> Iterator[None]:
    yield
    gc.unfreeze()  # the test process's heap as it was


def test_it_settles_at_start_then_only_when_the_queue_count_moves_enough() -> None:
    queues = [0]
    f = HeapFreezer(lambda: queues[0])
    assert f.tick() and f.settled_at == 0 and gc.get_freeze_count() > 0
    queues[0] = MIN_QUEUE_CHANGE - 1
    assert not f.tick()  # too few queues to matter
    queues[0] = 1000
    assert f.tick() and f.settled_at == 1000
    queues[0] = 1200
    assert not f.tick()  # +20 %: not a quarter
    queues[0] = 1300
    assert f.tick()
    queues[0] = 1000
    assert f.tick() and f.settles == 4  # a quarter fewer (deleted topics): thawed and frozen again


def test_settling_frees_garbage_cycles_and_freezes_the_rest() -> None:
    class Node:
        def __init__(self) -> None:
            self.me = self

    gone = weakref.ref(Node())  # a garbage cycle: collected by the settle, not frozen
    kept = [Node() for _ in range(1000)]
    f = HeapFreezer(lambda: 0)
    f.settle()
    assert gone() is None
    frozen = gc.get_freeze_count()
    assert frozen >= 1000
    assert not any(kept[0] is o for o in gc.get_objects(generation=2))  # frozen: not walked
