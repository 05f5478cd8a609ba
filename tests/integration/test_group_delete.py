"""``AdminClient.delete_group`` and ``ferrymq group delete`` against real brokers.

A group is deleted only when no consumer of it runs (NON_EMPTY_GROUP otherwise), a delivery
group with dead letters only with ``delete_dlq``; what goes is the consumer group's committed
offsets, the delivery group's state, retry queue and dead-letter queue, and nothing else. A
consumer that uses the name afterwards starts afresh.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ferrymq import (
    AdminClient,
    Broker,
    LeasedMessage,
    Message,
    Producer,
    PullConsumer,
    ReceivedMessage,
    SimpleConsumer,
)
from ferrymq.admin.cli import cli
from ferrymq.broker.delivery.lifecycle import DELETED_SUFFIX
from ferrymq.client._session import Session
from ferrymq.errors import InvalidRequestError, NonEmptyGroupError, UnknownGroupError
from ferrymq.protocol import messages as m
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

TOPIC = "gd-orders"
BODIES = [f"m{i}".encode() for i in range(6)]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    with Broker(tmp_path / "data", port=0) as b:
        with AdminClient(b.address) as admin:
            admin.create_topic(TOPIC, 1)
        with Producer(b.address) as p:
            for body in BODIES:
                p.send(Message(TOPIC, body))
        yield b


def run(addr: str, *args: str) -> Result:
    return CliRunner().invoke(cli, ["--server", addr, *args])


def one_error_line(res: Result) -> str:
    assert res.exit_code == 1, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def groups(addr: str) -> set[tuple[str, str]]:
    with AdminClient(addr) as admin:
        return {(g, state) for g, state, _n in admin.list_groups()}


def topic_names(addr: str) -> set[str]:
    with AdminClient(addr) as admin:
        return {t[0] for t in admin.list_topics()}


def pull_all(addr: str, group: str, n: int) -> list[ReceivedMessage]:
    got: list[ReceivedMessage] = []
    with PullConsumer(addr, group=group, auto_offset_reset="earliest") as c:
        c.subscribe(TOPIC)
        deadline = time.monotonic() + 10
        while len(got) < n and time.monotonic() < deadline:
            got.extend(c.poll(timeout=0.2))
        c.commit()
    return got


def receive(c: SimpleConsumer, n: int, timeout: float = 10.0) -> list[LeasedMessage]:
    got: list[LeasedMessage] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got.extend(c.receive(max_messages=n - len(got), wait=0.5))
    assert len(got) == n, [x.body for x in got]
    return got


def delivery_progress(addr: str, group: str) -> tuple[object, ...]:
    with AdminClient(addr) as admin:
        d = admin.describe_delivery(group)
    return tuple(q[:6] for q in d.queues), d.dlq_size, d.retry_pending


def test_a_pull_group_is_deleted_once_its_consumer_left(broker: Broker) -> None:
    addr = broker.address
    assert len(pull_all(addr, "gd-keep", 6)) == 6  # another group: must not be touched
    with PullConsumer(addr, group="gd-pull", auto_offset_reset="earliest") as c:
        c.subscribe(TOPIC)
        got: list[ReceivedMessage] = []
        while len(got) < 6:
            got.extend(c.poll(timeout=0.5))
        c.commit()
        with AdminClient(addr) as admin, pytest.raises(NonEmptyGroupError,
                                                       match=r"1 live member .*ferrymq"):
            admin.delete_group("gd-pull")
        line = one_error_line(run(addr, "group", "delete", "gd-pull", "--yes"))
        assert "consumer group 'gd-pull' has 1 live member" in line
        assert "stop its consumers first" in line
    with AdminClient(addr) as admin:
        assert admin.describe_group("gd-pull").offsets[0][2] == 6  # refused: nothing deleted
        keep = admin.describe_group("gd-keep").offsets

    res = run(addr, "--json", "group", "delete", "gd-pull", "--yes")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout) == {"group": "gd-pull", "deleted": True,
                                      "consumer_group": True, "delivery_group": False,
                                      "dead_letters": 0}
    assert ("gd-pull", "EMPTY") not in groups(addr)
    assert "gd-pull" not in run(addr, "group", "list").stdout
    with AdminClient(addr) as admin:
        with pytest.raises(UnknownGroupError):
            admin.describe_group("gd-pull")
        assert admin.describe_group("gd-keep").offsets == keep
    assert topic_names(addr) >= {TOPIC}

    # the name starts afresh: no committed offset, so auto_offset_reset decides
    assert [m.body for m in pull_all(addr, "gd-pull", 6)] == BODIES


def test_a_delivery_group_is_deleted_with_its_retry_and_dead_letter_queues(
        broker: Broker) -> None:
    addr = broker.address
    with SimpleConsumer(addr, "gd-other", max_reconsume=0) as other:  # must not be touched
        other.subscribe(TOPIC)
        first = receive(other, 6)
        other.nack(first[0], reason="other's dead letter")
        for msg in first[1:]:
            other.ack(msg)
    wait_for(lambda: delivery_progress(addr, "gd-other")[1] == 1)
    other_before = delivery_progress(addr, "gd-other")

    with SimpleConsumer(addr, "gd-push", max_reconsume=1, retry_delays=[2.0]) as c:
        c.subscribe(TOPIC)
        got = {m.body: m for m in receive(c, 6)}
        c.ack(got[b"m0"])
        c.ack(got[b"m1"])
        c.nack(got[b"m2"])  # the ladder: a retry letter due in 2 s
        c.nack(got[b"m3"], delay=0)
        again = receive(c, 1)[0]
        assert (again.body, again.reconsume_times) == (b"m3", 1)
        c.nack(again, reason="poison")  # its second failure: dead-lettered
        wait_for(lambda: delivery_progress(addr, "gd-push")[1] == 1)
        with AdminClient(addr) as admin, pytest.raises(NonEmptyGroupError,
                                                       match="1 live member"):
            admin.delete_group("gd-push", delete_dlq=True)
        line = one_error_line(run(addr, "group", "delete", "gd-push", "--yes", "--delete-dlq"))
        assert "delivery group 'gd-push' has 1 live member" in line
    # m4 and m5 went back to the group when it left: retry letters, like m2's

    with AdminClient(addr) as admin, pytest.raises(NonEmptyGroupError,
                                                   match=r"1 dead letters .*delete_dlq=True"):
        admin.delete_group("gd-push")
    line = one_error_line(run(addr, "group", "delete", "gd-push", "--yes"))
    assert "1 dead letters in %DLQ%gd-push: redrive or purge them first" in line
    assert "(--delete-dlq)" in line and "delete_dlq" not in line
    assert {"%RETRY%gd-push", "%DLQ%gd-push"} <= topic_names(addr)  # refused: nothing deleted

    res = run(addr, "group", "delete", "gd-push", "--yes", "--delete-dlq")
    assert res.exit_code == 0, res.stderr
    assert res.stdout.strip() == ("deleted group gd-push: delivery group with its retry queue "
                                  "and 1 dead letters")
    deleted_at = time.monotonic()
    assert ("gd-push", "DELIVERY") not in groups(addr)
    names = topic_names(addr)
    assert "%RETRY%gd-push" not in names and "%DLQ%gd-push" not in names
    assert {TOPIC, "%DLQ%gd-other"} <= names
    assert not list((Path(broker.config.data_dir) / "delivery").glob("gd-push*"))
    with AdminClient(addr) as admin, pytest.raises(UnknownGroupError):
        admin.describe_delivery("gd-push")
    assert delivery_progress(addr, "gd-other") == other_before

    # a new member of that name starts a new group (start_from earliest): every message once,
    # each a first delivery; the old retry letters (m2's was due 2 s later) never come
    with SimpleConsumer(addr, "gd-push") as fresh:
        fresh.subscribe(TOPIC)
        again_all = receive(fresh, 6)
        assert sorted(m.body for m in again_all) == BODIES
        assert {m.reconsume_times for m in again_all} == {0}
        for msg in again_all:
            fresh.ack(msg)
        while time.monotonic() < deleted_at + 3.0:
            assert fresh.receive(max_messages=10, wait=0.5) == []
    assert delivery_progress(addr, "gd-push")[1:] == (0, 0)


def test_a_name_with_both_kinds_and_unknown_names(broker: Broker) -> None:
    addr = broker.address
    assert len(pull_all(addr, "gd-both", 6)) == 6
    with SimpleConsumer(addr, "gd-both") as c:
        c.subscribe(TOPIC)
        for msg in receive(c, 6):
            c.ack(msg)
    assert {("gd-both", "EMPTY"), ("gd-both", "DELIVERY")} <= groups(addr)
    with AdminClient(addr) as admin:
        resp = admin.delete_group("gd-both")
        assert (resp.consumer_group, resp.delivery_group, resp.dead_letters) == (True, True, 0)
        assert not {g for g, _ in groups(addr)} & {"gd-both"}
        with pytest.raises(UnknownGroupError, match="no consumer group or delivery group"):
            admin.delete_group("gd-both")
    assert "unknown group 'gd-nobody'" in one_error_line(
        run(addr, "group", "delete", "gd-nobody", "--yes"))
    res = run(addr, "group", "delete", "gd-nobody")  # no --yes, no terminal
    assert res.exit_code == 2 and "--yes" in res.stderr


def test_a_deletion_cut_short_is_finished_at_start(tmp_path: Path) -> None:
    """The group's directory renamed (the decision), its topics still there: the next start
    removes them and the directory."""
    data = tmp_path / "data"
    with Broker(data, port=0) as b:
        with Producer(b.address) as p:
            p.send(Message(TOPIC, b"x"))
        with SimpleConsumer(b.address, "gd-cut", max_reconsume=0) as c:
            c.subscribe(TOPIC)
            c.nack(receive(c, 1)[0], reason="dead")
        wait_for(lambda: delivery_progress(b.address, "gd-cut")[1] == 1)
    group_dir = data / "delivery" / "gd-cut"
    shutil.move(group_dir, group_dir.with_name(f"gd-cut{DELETED_SUFFIX}"))
    with Broker(data, port=0) as b:
        assert "%DLQ%gd-cut" not in topic_names(b.address)
        assert ("gd-cut", "DELIVERY") not in groups(b.address)
        assert TOPIC in topic_names(b.address)
    assert not list((data / "delivery").iterdir())


def test_delete_group_kinds_and_validate_only(broker: Broker) -> None:
    """DELETE_GROUP's ``validate_only`` checks and deletes nothing; ``kinds`` deletes one kind
    of a name that has both (what a cluster's broker asks a delivery group's coordinator);
    ``kinds`` naming no kind is refused."""
    addr = broker.address
    assert len(pull_all(addr, "gd-kinds", 6)) == 6
    with SimpleConsumer(addr, "gd-kinds") as c:
        c.subscribe(TOPIC)
        for msg in receive(c, 6):
            c.ack(msg)

    async def body() -> None:
        s = Session([addr])
        try:
            check = await s.request(
                m.DeleteGroupRequest("gd-kinds", False, m.GroupKinds.BOTH, True),
                m.DeleteGroupResponse, retry=False)
            assert (check.consumer_group, check.delivery_group) == (True, True)
            assert {("gd-kinds", "EMPTY"), ("gd-kinds", "DELIVERY")} <= groups(addr)
            with pytest.raises(InvalidRequestError, match="kinds"):
                await s.request(m.DeleteGroupRequest("gd-kinds", False, 0),
                                m.DeleteGroupResponse, retry=False)
            only = await s.request(
                m.DeleteGroupRequest("gd-kinds", False, m.GroupKinds.DELIVERY),
                m.DeleteGroupResponse, retry=False)
            assert (only.consumer_group, only.delivery_group) == (False, True)
        finally:
            await s.close()

    asyncio.run(body())
    left = {kind for g, kind in groups(addr) if g == "gd-kinds"}
    assert left == {"EMPTY"}  # the consumer group stays
