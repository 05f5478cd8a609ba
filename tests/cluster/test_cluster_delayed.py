"""Delayed messages across a kill -9 of their queue's leader: etcd and three ``ferrymq broker``
processes, delays spread before and after the kill, cancels before and after it, and a history
checker over the final log: never early, never lost, never twice, cancelled never delivered.

CI runs a short history (about 30 s); ``make soak`` (marker ``soak``) a longer one with more
messages and two kills."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ferrymq.client import AdminClient, Message, Producer, PullConsumer
from ferrymq.client.message import ReceivedMessage
from ferrymq.errors import FerryMQError, NotLeaderError, NotScheduledError
from ferrymq.protocol.schedule import SCHEDULED_DUE, SCHEDULED_ID
from ferrymq.testing import ClusterProcess
from tests.cluster.chaos.cluster import ChaosCluster
from tests.cluster.conftest import needs_etcd
from tests.cluster.test_cluster_etcd import FAST, describe, wait_until

pytestmark = [pytest.mark.integration, needs_etcd]

TOPIC = "dl"
QUEUES = 2
CLOCK_GRANULARITY_MS = 2
"""How early a copy's append time may read against its due time: the scheduler snaps skews of
up to 2 ms (the rounding between its clock and the wall clock) to 0 (docs/scheduled.md)."""


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class History:
    """What the clients did: each original sent (id -> earliest due it may have, its delay)
    and each cancel's outcome."""

    sent: dict[str, int] = field(default_factory=dict)
    """msg id -> the earliest wall ms it may be due (send start + delay)."""
    cancelled: set[str] = field(default_factory=set)
    """Cancels the leader confirmed."""
    unsure: set[str] = field(default_factory=set)
    """Cancels whose answer was lost (timed out, the leader died): either outcome is right."""


def check(history: History, copies: list[ReceivedMessage]) -> None:
    """The history checker: every copy names a sent original, is never early (its append time
    at or after its due time, and that due time no earlier than the send plus the delay), no
    original has two copies, every original neither cancelled nor unsure has one, no cancelled
    one has any."""
    by_original: dict[str, list[ReceivedMessage]] = {}
    for c in copies:
        by_original.setdefault(c.properties[SCHEDULED_ID], []).append(c)
    unknown = set(by_original) - set(history.sent)
    assert not unknown, f"copies of originals never sent: {sorted(unknown)[:5]}"
    twice = {i: [(c.queue, c.offset) for c in cs] for i, cs in by_original.items() if len(cs) > 1}
    assert not twice, f"{len(twice)} originals delivered twice: {list(twice.items())[:5]}"
    early = []
    for i, (c,) in by_original.items():
        due = int(c.properties[SCHEDULED_DUE])
        if due < history.sent[i] or c.stored_ms < due - CLOCK_GRANULARITY_MS:
            early.append((i, history.sent[i], due, c.stored_ms))
    assert not early, f"{len(early)} delivered early (id, earliest due, due, stored): {early[:5]}"
    delivered_cancelled = history.cancelled & set(by_original)
    assert not delivered_cancelled, f"cancelled but delivered: {sorted(delivered_cancelled)}"
    lost = set(history.sent) - history.cancelled - history.unsure - set(by_original)
    assert not lost, f"{len(lost)} delayed messages lost: {sorted(lost)[:5]}"


def cancel(bootstrap: str, history: History, msg_id: str) -> None:
    """Cancel ``msg_id`` through any broker (the client finds the queue's leader), retrying
    while no broker leads it; record the outcome."""
    deadline = time.monotonic() + 30
    with Producer(bootstrap, connect_timeout_s=5) as p:
        while True:
            try:
                p.cancel(msg_id)
            except NotLeaderError:
                if time.monotonic() > deadline:
                    history.unsure.add(msg_id)
                    return
                time.sleep(0.2)
                continue
            except NotScheduledError:
                raise
            except FerryMQError:  # the answer was lost: the cancel may stand or not
                history.unsure.add(msg_id)
                return
            history.cancelled.add(msg_id)
            return


def read_copies(bootstrap: str, expected: int) -> list[ReceivedMessage]:
    """Every copy of a delayed message in the topic, read by a fresh group from the start."""
    got: list[ReceivedMessage] = []
    with PullConsumer(bootstrap, group="check", auto_offset_reset="earliest") as consumer:
        consumer.subscribe(TOPIC)
        deadline = time.monotonic() + 60
        while len(got) < expected and time.monotonic() < deadline:
            got += consumer.poll(timeout=1.0)
        quiet_until = time.monotonic() + 1.5  # and a little longer, to catch extras
        while time.monotonic() < quiet_until:
            got += consumer.poll(timeout=0.3)
    return [m for m in got if SCHEDULED_ID in m.properties]


def send_delayed(bootstrap: str, messages: int, spread_ms: int) -> History:
    """Create the topic and send ``messages`` delayed messages, their delays spread evenly
    from 0.3 s to 0.3 s + ``spread_ms``."""
    with AdminClient(bootstrap) as admin:
        admin.create_topic(TOPIC, QUEUES, replicas=3, min_insync=2)
    history = History()
    with Producer(bootstrap, delivery_timeout_s=60) as p:
        for i in range(messages):
            delay = 300 + spread_ms * i // messages
            before = now_ms()
            r = p.send(Message(TOPIC, f"m{i}".encode(), delay=delay / 1000,
                               sharding_key=str(i % 7)))
            history.sent[r.msg_id] = before + delay
    return history


def finish(bootstrap: str, history: History) -> None:
    """Wait until every message is due, read the final log, check the history."""
    last_due = max(history.sent.values())
    time.sleep(max(0.0, (last_due - now_ms()) / 1000) + 2)
    expected = len(history.sent) - len(history.cancelled) - len(history.unsure)
    check(history, read_copies(bootstrap, expected))


def run_history(c: ClusterProcess, *, messages: int, spread_ms: int, kills: int) -> None:
    start = now_ms()
    history = send_delayed(c.bootstrap, messages, spread_ms)
    late = [i for i in history.sent if history.sent[i] > start + spread_ms // 2 + 3000]
    stride = kills + 1  # a share of them cancelled before any kill, one after each kill
    for msg_id in late[::stride]:
        cancel(c.bootstrap, history, msg_id)
    for k in range(kills):
        time.sleep(spread_ms / 1000 / (kills + 2))
        queue = (TOPIC, k % QUEUES)
        victim = describe(c)[queue][0]
        c.kill9(victim)
        wait_until(lambda q=queue, v=victim: describe(c)[q][0] not in (v, -1),
                   "a new leader", timeout=30)
        for msg_id in late[1 + k::stride]:  # cancelled after the kill, by the new leader
            if history.sent[msg_id] > now_ms() + 1500:
                cancel(c.bootstrap, history, msg_id)
        c.restart(victim)
        wait_until(lambda: all(sorted(isr) == [1, 2, 3] for _, isr in describe(c).values()),
                   "the restarted broker back in every ISR", timeout=60)
    with AdminClient(c.bootstrap) as admin:  # a cancelled message's state, from its leader
        for msg_id in sorted(history.cancelled)[:2]:
            states = {s.state for s in admin.message_status(msg_id).statuses}
            assert states == {"CANCELLED"}, (msg_id, states)
    finish(c.bootstrap, history)
    assert history.cancelled, "the history cancelled nothing"


def test_delayed_messages_survive_a_kill9_of_their_leader(tmp_path: Path) -> None:
    with ClusterProcess(3, tmp_path / "c", cluster="t", env=FAST) as c:
        run_history(c, messages=80, spread_ms=12_000, kills=1)


@pytest.mark.soak
def test_delayed_messages_survive_repeated_kills_soak(tmp_path: Path) -> None:
    with ClusterProcess(3, tmp_path / "c", cluster="t", env=FAST) as c:
        run_history(c, messages=600, spread_ms=60_000, kills=4)


def test_a_partitioned_leaders_copies_are_cut_not_delivered_twice(tmp_path: Path) -> None:
    """The leader cut off from everyone (etcd too) keeps firing into its own log while the new
    leader fires the same messages; healed, it cuts its copies (they were never committed):
    the final log holds each message once."""
    with ChaosCluster(tmp_path / "c") as c:
        history = send_delayed(c.bootstrap, 60, 8_000)
        asyncio.run(c.wait_healthy(TOPIC))
        victim = asyncio.run(c.leader_of(TOPIC, 0))
        c.partition(victim)
        wait_until(lambda: asyncio.run(c.leader_of(TOPIC, 0)) not in (victim, -1),
                   "a new leader", timeout=30)
        time.sleep(2)  # both fire what comes due meanwhile
        c.heal(victim)
        asyncio.run(c.wait_healthy(TOPIC))
        finish(c.bootstrap, history)
        assert "truncating" in c.cluster.broker(victim).log_text(), \
            "the partitioned leader appended no copy of its own: nothing was tested"
