"""Topic limits (max_topics, max_total_queues, auto_create_topics_per_minute) and topic settings:
every refusal is a clear error naming the limit or setting, checked before anything exists."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ferrymq
from ferrymq.broker.topic_settings import TOPIC_SETTINGS
from ferrymq.broker.topics import check_topic_name
from ferrymq.errors import (
    InvalidConfigError,
    InvalidTopicNameError,
    PolicyViolationError,
)
from tests.security_helpers import make_user, write_users

pytestmark = pytest.mark.integration

LIMITS = {"max_topics": 4, "max_total_queues": 10, "auto_create_topics_per_minute": 3,
          "default_queues": 2}


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[ferrymq.Broker]:
    with ferrymq.Broker(tmp_path / "d", **LIMITS) as b:
        yield b


def topic_names(address: str) -> list[str]:
    with ferrymq.AdminClient(address) as admin:
        return sorted(t[0] for t in admin.list_topics())


def topic_dirs(b: ferrymq.Broker) -> list[str]:
    return sorted(p.name for p in (b.server.data_dir / "topics").iterdir())


def test_max_topics_refuses_explicit_and_auto_creation(broker: ferrymq.Broker) -> None:
    with ferrymq.AdminClient(broker.address) as admin:
        for i in range(4):
            admin.create_topic(f"t{i}", 1)
        with pytest.raises(PolicyViolationError, match=r"'t4' not created: the broker has 4 "
                                                       r"topics, max_topics=4") as info:
            admin.create_topic("t4", 1)
        assert not info.value.retriable
    with ferrymq.Producer(broker.address) as p, \
            pytest.raises(PolicyViolationError, match=r"'auto' not created.*max_topics=4"):
        p.send(ferrymq.Message("auto", b"x"))
    assert topic_names(broker.address) == ["t0", "t1", "t2", "t3"]
    assert topic_dirs(broker) == ["t0", "t1", "t2", "t3"]
    with ferrymq.AdminClient(broker.address) as admin:  # a deleted topic frees its place
        admin.delete_topic("t0")
        admin.create_topic("t4", 1)
    assert topic_names(broker.address) == ["t1", "t2", "t3", "t4"]


def test_max_total_queues(broker: ferrymq.Broker) -> None:
    with ferrymq.AdminClient(broker.address) as admin:
        admin.create_topic("big", 8)
        with pytest.raises(PolicyViolationError, match=r"'more' not created: its 3 queues would "
                                                       r"make 11 on the broker, above "
                                                       r"max_total_queues=10"):
            admin.create_topic("more", 3)
        admin.create_topic("fits", 2)
    assert topic_names(broker.address) == ["big", "fits"]
    assert topic_dirs(broker) == ["big", "fits"]


def test_internal_topics_are_not_counted_nor_refused(broker: ferrymq.Broker) -> None:
    with ferrymq.AdminClient(broker.address) as admin:
        for i in range(4):
            admin.create_topic(f"t{i}", 1)
    with ferrymq.Producer(broker.address) as p:
        p.send(ferrymq.Message("t0", b"fails once"))
    with ferrymq.SimpleConsumer(broker.address, group="audit") as c:
        c.subscribe("t0")
        got: list[ferrymq.ReceivedMessage] = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = c.receive(max_messages=1, invisible_duration=30)
        assert got
        c.nack(got[0], delay=1)  # the group's retry topic is created now, at max_topics
        deadline = time.monotonic() + 10
        again: list[ferrymq.ReceivedMessage] = []
        while not again and time.monotonic() < deadline:
            again = c.receive(max_messages=1, invisible_duration=30)
        assert [m.body for m in again] == [b"fails once"]
        c.ack(again[0])
    assert "%RETRY%audit" in topic_names(broker.address)
    assert broker.server.topics.user_topics == 4


def test_auto_creation_rate_per_connection(tmp_path: Path) -> None:
    with ferrymq.Broker(tmp_path / "d", auto_create_topics_per_minute=3) as b:
        _auto_creation_rate_per_connection(b)


def _auto_creation_rate_per_connection(broker: ferrymq.Broker) -> None:
    with ferrymq.Producer(broker.address) as p:
        for i in range(3):
            p.send(ferrymq.Message(f"a{i}", b"x"))
        with pytest.raises(PolicyViolationError, match=r"'a3' not auto-created: this connection "
                                                       r"auto-created "
                                                       r"auto_create_topics_per_minute=3") as info:
            p.send(ferrymq.Message("a3", b"x"))
        assert 0 < info.value.retry_after_ms <= 20_001 and not info.value.retriable
        p.send(ferrymq.Message("a0", b"existing topics are not counted"))
    assert "a3" not in topic_names(broker.address) and "a3" not in topic_dirs(broker)
    with ferrymq.AdminClient(broker.address) as admin:  # explicit creation is not rate limited
        admin.create_topic("explicit", 1)
    with ferrymq.Producer(broker.address) as p:  # a new connection has its own budget
        p.send(ferrymq.Message("a3", b"x"))


def test_auto_creation_rate_refills(tmp_path: Path) -> None:
    # 20 a minute: one comes back every 3 s, so 20 creations on a crowded machine (each with
    # its fsyncs) fit in the time before the first one returns
    with ferrymq.Broker(tmp_path / "d", auto_create_topics_per_minute=20) as b, \
            ferrymq.Producer(b.address) as p:
        for i in range(20):
            p.send(ferrymq.Message(f"r{i}", b"x"))
        with pytest.raises(PolicyViolationError, match="auto_create_topics_per_minute=20"):
            p.send(ferrymq.Message("r20", b"x"))
        time.sleep(3.1)  # one every 3 s comes back
        p.send(ferrymq.Message("r20", b"x"))


def test_auto_creation_rate_is_per_user_with_authentication(tmp_path: Path) -> None:
    alice = ("alice", "alice-secret-7f3a")
    users = write_users(tmp_path / "users.toml", make_user(*alice, admin=True))
    with ferrymq.Broker(tmp_path / "d", users_file=str(users),
                        auto_create_topics_per_minute=3) as b:
        with ferrymq.Producer(b.address, auth=alice) as p1, \
                ferrymq.Producer(b.address, auth=alice) as p2:
            p1.send(ferrymq.Message("u0", b"x"))
            p2.send(ferrymq.Message("u1", b"x"))
            p1.send(ferrymq.Message("u2", b"x"))
            with pytest.raises(PolicyViolationError, match="user 'alice' auto-created"):
                p2.send(ferrymq.Message("u3", b"x"))
        with ferrymq.Producer(b.address, auth=alice) as p3, \
                pytest.raises(PolicyViolationError, match="auto_create_topics_per_minute=3"):
            p3.send(ferrymq.Message("u3", b"x"))


def test_limits_count_the_topics_found_at_start(tmp_path: Path) -> None:
    with ferrymq.Broker(tmp_path / "d", **LIMITS) as b, ferrymq.AdminClient(b.address) as admin:
        admin.create_topic("a", 4)
        admin.create_topic("b", 4)
    with ferrymq.Broker(tmp_path / "d", **LIMITS) as b, ferrymq.AdminClient(b.address) as admin:
        with pytest.raises(PolicyViolationError, match="max_total_queues=10"):
            admin.create_topic("c", 4)
        admin.create_topic("c", 1)
        admin.create_topic("d", 1)
        with pytest.raises(PolicyViolationError, match="max_topics=4"):
            admin.create_topic("e", 1)


# --- topic settings -----------------------------------------------------------------------------


def _bad_values(name: str) -> list[str]:
    """Not numbers, numbers Python's int() would take, negatives, out of range."""
    s = TOPIC_SETTINGS[name]
    bad = ["abc", "", "1.5", " 7", "1_000", "\u0663", "0x10", "9" * 30, str(s.high + 1),
           "-2" if s.minus_one_unlimited else "-1"]
    if s.low - 1 >= 0:
        bad.append(str(s.low - 1))
    return bad


@pytest.fixture(scope="module")
def shared_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ferrymq.Broker]:
    with ferrymq.Broker(tmp_path_factory.mktemp("settings") / "d") as b:
        yield b


@pytest.mark.parametrize(("setting", "value"),
                         [(n, v) for n in TOPIC_SETTINGS for v in _bad_values(n)])
def test_an_invalid_topic_setting_is_named(shared_broker: ferrymq.Broker, setting: str,
                                           value: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    s = TOPIC_SETTINGS[setting]
    with ferrymq.AdminClient(shared_broker.address) as admin:
        with pytest.raises(InvalidConfigError) as info:
            admin.create_topic("x", 1, {setting: value})
        assert not any(t[0] == "x" for t in admin.list_topics())
    text = str(info.value)
    assert f"topic setting {setting}=" in text
    assert f"use an integer in {s.low}..{s.high}" in text
    assert ("or -1 for no limit" in text) == s.minus_one_unlimited
    assert "internal error" not in text and "Traceback" not in caplog.text
    assert not (shared_broker.server.data_dir / "topics" / "x").exists()


def test_valid_topic_settings_are_taken(shared_broker: ferrymq.Broker) -> None:
    good = {"retention_ms": "-1", "retention_bytes": "0", "segment_bytes": str(2**31 - 1),
            "segment_ms": "1", "dedup_window_ms": "86400000"}
    with ferrymq.AdminClient(shared_broker.address) as admin:
        admin.create_topic("good", 1, good)
        assert admin.describe_topic("good").config == good
        with pytest.raises(InvalidConfigError, match=r"unknown topic setting 'segment_size'; "
                                                     r"known: retention_ms, retention_bytes"):
            admin.create_topic("y", 1, {"segment_size": "1"})
        with pytest.raises(InvalidConfigError, match=r"queues must be 1\.\.1024 \(max_queues\)"):
            admin.create_topic("y", 0)


def test_the_documented_topic_name_length_is_the_one_enforced() -> None:
    doc = InvalidTopicNameError.__doc__ or ""
    found = re.search(r"1\.\.(\d+) characters", doc)
    assert found is not None, doc
    longest = int(found.group(1))
    check_topic_name("a" * longest)
    with pytest.raises(InvalidTopicNameError, match=f"1-{longest} characters"):
        check_topic_name("a" * (longest + 1))
