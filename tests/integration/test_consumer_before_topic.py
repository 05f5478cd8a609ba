"""A pull consumer may start before its topic exists: it waits (one warning, a metadata check
about once a second) and reads the topic once it is created; ``require_topic=True`` keeps the
fail-fast behaviour; ``ferrymq consume`` says it is waiting."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from ferrymq import AdminClient, Broker, Message, Producer, PullConsumer, ReceivedMessage
from ferrymq.client._session import Session, TopicInfo
from ferrymq.errors import InvalidRequestError, InvalidTopicNameError, UnknownTopicError

pytestmark = pytest.mark.integration


def _poll_until(c: PullConsumer, n: int, timeout: float) -> list[ReceivedMessage]:
    got: list[ReceivedMessage] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += c.poll(timeout=0.1)
    return got


@pytest.mark.parametrize("reset", ["earliest", "latest"])
def test_subscribe_waits_for_the_topic_and_reads_it_from_its_first_message(
        broker: Broker, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        reset: str) -> None:
    caplog.set_level(logging.INFO, logger="ferrymq.client")
    checks: list[float] = []
    real = Session.existing_topics

    async def counted(self: Session, names: Iterable[str],
                      timeout_s: float | None = None) -> dict[str, TopicInfo]:
        checks.append(time.monotonic())  # counts the metadata checks; the real one runs
        return await real(self, names, timeout_s=timeout_s)

    monkeypatch.setattr(Session, "existing_topics", counted)
    with PullConsumer(broker.address, "billing", auto_offset_reset=reset) as c:
        c.subscribe("orders")  # no producer has created it yet
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0:
            assert c.poll(timeout=0.1) == []
        waited = len(checks)
        with Producer(broker.address) as p:  # auto-creates the topic
            p.send_batch([Message("orders", f"o{i}") for i in range(20)])
        t1 = time.monotonic()
        got = _poll_until(c, 20, timeout=10)
        noticed_after = time.monotonic() - t1
    # the messages produced before the consumer noticed the topic are read, also with
    # "latest": all of a topic created after the subscription is newer than the subscription
    assert sorted(m.body.decode() for m in got) == sorted(f"o{i}" for i in range(20))
    assert noticed_after < 3.0
    # about one metadata check a second while waiting: no busy loop, no request storm
    assert 2 <= waited <= 5, checks
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "ferrymq.client" and r.levelno == logging.WARNING]
    assert warnings == ["topic 'orders' does not exist yet: waiting for it to be created "
                        "(checking every 1 s)"]
    assert "topic 'orders' exists now: reading it" in caplog.messages


def test_members_of_a_group_share_a_topic_created_after_they_joined(broker: Broker) -> None:
    opts = {"auto_offset_reset": "earliest", "heartbeat_interval_s": 0.2}
    with PullConsumer(broker.address, "g", **opts) as c1, \
            PullConsumer(broker.address, "g", **opts) as c2:
        c1.subscribe("later")
        c2.subscribe("later")
        assert c1.assignment() == c2.assignment() == []
        with AdminClient(broker.address) as admin:
            admin.create_topic("later", 4)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
                len(c1.assignment()) == len(c2.assignment()) == 2):
            c1.poll(0.1)
            c2.poll(0.1)
        assert len(c1.assignment()) == len(c2.assignment()) == 2
        assert set(c1.assignment()).isdisjoint(c2.assignment())


def test_assign_waits_for_the_topic_too(broker: Broker) -> None:
    with PullConsumer(broker.address, "a", auto_offset_reset="earliest") as c:
        c.assign([("assigned-later", 0), ("assigned-later", 1)])
        assert c.assignment() == []
        assert c.poll(timeout=0.3) == []
        with AdminClient(broker.address) as admin:
            admin.create_topic("assigned-later", 2)
        with Producer(broker.address) as p:
            p.send_batch([Message("assigned-later", f"m{i}", sharding_key=str(i))
                          for i in range(10)])
        got = _poll_until(c, 10, timeout=10)
        assert c.assignment() == [("assigned-later", 0), ("assigned-later", 1)]
    assert sorted(m.body.decode() for m in got) == sorted(f"m{i}" for i in range(10))


def test_require_topic_fails_fast_and_bad_names_always_fail(broker: Broker) -> None:
    with PullConsumer(broker.address, "g", require_topic=True) as c:
        with pytest.raises(UnknownTopicError, match="'nope'"):
            c.subscribe("nope")
    with PullConsumer(broker.address, "g", require_topic=True) as c:
        with pytest.raises(UnknownTopicError, match="'nope'"):
            c.assign([("nope", 0)])
    with PullConsumer(broker.address, "g") as c:
        with pytest.raises(InvalidTopicNameError):
            c.subscribe("no such/topic")  # never worth waiting for


def test_cli_consume_says_it_waits_and_reads_the_topic_from_its_start(broker: Broker) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferrymq.admin.cli", "--server", broker.address, "consume",
         "cli-later", "-g", "cli", "--count", "2", "--timeout", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line == ("topic 'cli-later' does not exist yet: waiting for it to be created "
                        "(checking every 1 s)\n")
        with Producer(broker.address) as p:
            p.send_batch([Message("cli-later", "first"), Message("cli-later", "second")])
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert sorted(row.split("\t")[3] for row in out.splitlines()) == ["first", "second"]
    assert err == ""  # that one line on stderr, nothing more


def test_a_member_subscribes_to_at_most_max_member_topics(tmp_path: Path) -> None:
    with Broker(tmp_path / "d", max_member_topics=2) as b, PullConsumer(b.address, "g") as c:
        c.subscribe("a")
        c.subscribe("b")  # neither exists: both are waited for, both count
        with pytest.raises(InvalidRequestError, match="max_member_topics=2"):
            c.subscribe("c")
        c.subscribe("b", "x || y")  # the refused topic was not kept: the member still joins


def test_waiting_for_a_topic_does_not_hold_poll_during_an_outage(tmp_path: Path) -> None:
    b = Broker(tmp_path / "d", port=0).start()
    with PullConsumer(b.address, "g", reconnect_timeout_s=60) as c:
        c.subscribe("later")
        b.stop()
        for _ in range(6):  # the checks for the topic (one a second) meet the lost broker
            t0 = time.monotonic()
            assert c.poll(timeout=0.5) == []
            assert time.monotonic() - t0 < 2.5
