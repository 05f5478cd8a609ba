"""Half messages on a real cluster (etcd and three broker processes) with their owner killed
(-9): the half topic is replicated and its leader owns the half messages. Decisions answered
before the kill stand (commits visible once, rollbacks never), and the half messages left
undecided are checked back by the new owner and resolved as the checker says; the committed
copies go to queues led by every broker."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from ferrymq.client import AdminClient, HalfMessageProducer, Message, PullConsumer
from ferrymq.client.message import ReceivedMessage
from ferrymq.client.partitioner import queue_for_key
from ferrymq.protocol.half_messages import HALF_TOPIC
from ferrymq.protocol.messages import HalfState
from ferrymq.testing import ClusterProcess
from tests.cluster.conftest import needs_etcd
from tests.cluster.test_cluster_etcd import FAST, describe, wait_until

pytestmark = [pytest.mark.integration, needs_etcd]

QUEUES = 3


CHECKED: set[bytes] = set()


def _checker(msg: ReceivedMessage) -> HalfState:
    """Undecided half messages: ``uc*`` commit, ``ur*`` roll back."""
    CHECKED.add(msg.body)
    return HalfState.COMMIT if msg.body.startswith(b"uc") else HalfState.ROLLBACK


def _read(bootstrap: str) -> list[bytes]:
    with PullConsumer(bootstrap, group=f"check-{time.monotonic_ns()}",
                      auto_offset_reset="earliest") as c:
        c.assign([("orders", q) for q in range(QUEUES)])
        out: list[bytes] = []
        for _ in range(6):
            out.extend(m.body for m in c.poll(timeout=0.5))
        return out


@pytest.mark.timeout(150)
def test_half_messages_decisions_stand_and_the_new_owner_checks_back(tmp_path: Path) -> None:
    with ClusterProcess(3, tmp_path / "c", cluster="half", env=FAST) as c:
        with AdminClient(c.bootstrap) as admin:
            admin.create_topic("orders", QUEUES, replicas=3, min_insync=2)
        key = {queue_for_key(str(i), QUEUES): str(i) for i in range(100)}
        with HalfMessageProducer(c.bootstrap, "pg", _checker, check_after=4.0,
                                 check_interval=1.0, max_checks=50, poll_wait_s=1.0) as p:
            decided = {}
            for q in range(QUEUES):  # queues led by every broker
                for kind in ("dc", "dr"):
                    body = f"{kind}{q}".encode()
                    decided[body] = p.prepare(Message("orders", body, sharding_key=key[q]))
            for body, hid in decided.items():
                if body.startswith(b"dc"):
                    assert p.commit(hid).committed
                else:
                    p.rollback(hid, "decided before the kill")
            for q in range(QUEUES):  # left to the check-back
                for kind in ("uc", "ur"):
                    p.prepare(Message("orders", f"{kind}{q}".encode(), sharding_key=key[q]))
            owner = describe(c)[(HALF_TOPIC, 0)][0]
            c.kill9(owner)
            want = sorted([f"dc{q}".encode() for q in range(QUEUES)]
                          + [f"uc{q}".encode() for q in range(QUEUES)])
            wait_until(lambda: sorted(_read(c.bootstrap)) == want,
                       "the undecided commits checked back by the new owner", timeout=60)
            assert describe(c)[(HALF_TOPIC, 0)][0] not in (owner, -1)
            wait_until(lambda: {b for b in CHECKED if b.startswith(b"ur")} == {
                f"ur{q}".encode() for q in range(QUEUES)}, "the undecided rollbacks checked")
            assert not {b for b in CHECKED if b.startswith(b"d")}, "a decision was checked"
        got = Counter(_read(c.bootstrap))
        assert sorted(got) == want
        assert all(n == 1 for n in got.values()), got
