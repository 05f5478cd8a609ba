"""``ferrymq message``, ``ferrymq dlq`` and delivery groups in ``ferrymq group``, end to end.

The CLI runs in-process through click's CliRunner against real brokers; delivery-group members
are driven on the wire (DELIVERY_HEARTBEAT, RECEIVE, ACK, NACK, DELIVERY_LEAVE) so each test
controls exactly which message is leased, acked, retried or dead-lettered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from ferrymq import (
    AdminClient,
    Broker,
    HalfMessageProducer,
    HalfState,
    Message,
    Producer,
    PullConsumer,
)
from ferrymq.admin.cli import cli
from ferrymq.client._session import Session
from ferrymq.protocol import messages as m
from ferrymq.protocol.records import Record, decode_records
from tests.helpers import BrokerProcess, wait_for

pytestmark = pytest.mark.integration

COLLIDING = ("key-1371838", "key-2000402")
"""Two keys with the same CRC32C: the key index holds one hash for both."""


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    with Broker(tmp_path_factory.mktemp("cli-delivery"), port=0,
                retention_check_interval_ms=200) as b:
        yield b


def run(addr: str, *args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(cli, ["--server", addr, *args], input=stdin)


def ok(addr: str, *args: str) -> str:
    res = run(addr, *args)
    assert res.exit_code == 0, (res.stdout, res.stderr, res.exception)
    return res.stdout


def ok_json(addr: str, *args: str) -> Any:
    return json.loads(ok(addr, "--json", *args))


def fails(addr: str, *args: str, code: int = 1) -> Result:
    res = run(addr, *args)
    assert res.exit_code == code, (res.stdout, res.stderr, res.exception)
    if code == 1:
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, res.stderr
        assert lines[0].startswith("error: ")
        assert "Traceback" not in res.stderr
    return res


# -- a delivery-group member on the wire -----------------------------------------------------------


@dataclasses.dataclass
class Leased:
    topic: str
    queue: int
    offset: int
    lease_id: int
    record: Record


class Member:
    """One delivery-group member over a raw session (use inside one asyncio.run)."""

    def __init__(self, session: Session, group: str, member_id: str) -> None:
        self.s = session
        self.group = group
        self.member_id = member_id

    @classmethod
    async def join(cls, s: Session, group: str, topic: str, *, max_reconsume: int = 16,
                   delays_ms: list[int] | None = None, client_id: str = "cli-test",
                   tags: str = "*", orderly: bool = False) -> Member:
        args: dict[str, Any] = {
            "group": group, "member_id": "", "client_id": client_id,
            "subscriptions": [(topic, tags)], "session_timeout_ms": 60_000, "orderly": orderly,
            "retry_delays_ms": delays_ms or [100], "max_reconsume": max_reconsume,
        }
        if "start_from" in {f.name for f in dataclasses.fields(m.DeliveryHeartbeatRequest)}:
            args["start_from"] = int(m.OffsetSpec.EARLIEST)
        resp = await s.request(m.DeliveryHeartbeatRequest(**args), m.DeliveryHeartbeatResponse)
        return cls(s, group, resp.member_id)

    async def receive(self, n: int, *, invisible_ms: int = 60_000,
                      wait_s: float = 5.0) -> list[Leased]:
        """Exactly ``n`` leased records (several RECEIVEs if needed)."""
        out: list[Leased] = []
        deadline = time.monotonic() + wait_s
        while len(out) < n and time.monotonic() < deadline:
            resp = await self.s.request(
                m.ReceiveRequest(self.group, self.member_id, [], n - len(out), 1 << 20,
                                 invisible_ms, 1000), m.ReceiveResponse)
            for topic, queue, _tid, lease, _rc, first, last, data in resp.deliveries:
                out.extend(Leased(topic, queue, r.offset, lease, r)
                           for r in decode_records(data) if first <= r.offset <= last)
        assert len(out) == n, f"received {len(out)} of {n}"
        return out

    async def ack(self, leased: list[Leased]) -> None:
        by_lease: dict[tuple[str, int, int], list[int]] = {}
        for x in leased:
            by_lease.setdefault((x.topic, x.queue, x.lease_id), []).append(x.offset)
        resp = await self.s.request(m.AckRequest(
            self.group, self.member_id, [(*k, offs) for k, offs in by_lease.items()]
        ), m.AckResponse)
        assert resp.failed == []

    async def nack(self, leased: list[Leased], *, reason: str, delay_ms: int = 0) -> None:
        resp = await self.s.request(m.NackRequest(self.group, self.member_id, [
            (x.topic, x.queue, x.offset, x.lease_id, delay_ms, reason, True) for x in leased
        ]), m.ReceiptResponse)
        assert all(code == 0 for code, _ in resp.results)

    async def leave(self) -> None:
        await self.s.request(m.DeliveryLeaveRequest(self.group, self.member_id), m.Empty)


def produce(addr: str, msgs: list[Message]) -> list[str]:
    with Producer(addr) as p:
        return [p.send(msg).msg_id for msg in msgs]


def create_topic(addr: str, name: str, queues: int, **config: str) -> None:
    with AdminClient(addr) as a:
        a.create_topic(name, queues, config)


def dead_letter_all(addr: str, group: str, topic: str, n: int, reason: str) -> None:
    """Lease ``n`` messages in ``group`` (max_reconsume 0) and nack them: all go to the DLQ."""

    async def go() -> None:
        s = Session(addr)
        try:
            mem = await Member.join(s, group, topic, max_reconsume=0)
            await mem.nack(await mem.receive(n), reason=reason)
        finally:
            await s.close()

    asyncio.run(go())


def dlq_count(addr: str, group: str) -> int:
    return len(ok_json(addr, "dlq", "list", group, "--limit", "1000")["dead_letters"])


# -- topic list ----------------------------------------------------------------------------------------


def test_topic_list_hides_internal_topics_unless_asked(broker: Broker) -> None:
    addr = broker.address
    create_topic(addr, "tl-orders", 1)
    produce(addr, [Message("tl-orders", "m")])
    dead_letter_all(addr, "tl-group", "tl-orders", 1, "bad")  # %DLQ%tl-group
    with HalfMessageProducer(addr, "tl-pg", lambda _m: HalfState.UNKNOWN,
                             check_after=60) as p:
        p.prepare(Message("tl-orders", b"half"))  # %HALF%transactions
    names = {row.split()[0] for row in ok(addr, "topic", "list").splitlines()[1:]}
    assert "tl-orders" in names
    assert not [n for n in names if n.startswith("%")], names
    listed = ok_json(addr, "topic", "list")["topics"]
    assert not [t for t in listed if t["name"].startswith("%")]
    assert {t["internal"] for t in listed} == {False}

    rows = {r.split()[0]: r.split() for r in ok(addr, "topic", "list", "--internal").splitlines()}
    assert rows["TOPIC"] == ["TOPIC", "ID", "QUEUES", "INTERNAL"]
    assert rows["tl-orders"][3] == "no"
    assert rows["%DLQ%tl-group"][3] == "yes"
    assert rows["%HALF%transactions"][3] == "yes"
    everything = {t["name"]: t for t in ok_json(addr, "topic", "list", "--internal")["topics"]}
    assert everything["%DLQ%tl-group"]["internal"] is True
    assert everything["tl-orders"]["internal"] is False


# -- message status ----------------------------------------------------------------------------------


def test_message_status_across_states(broker: Broker) -> None:
    addr = broker.address
    topic = "st-orders"
    create_topic(addr, topic, 1)
    ids = produce(addr, [Message(topic, f"m{i}") for i in range(5)])
    members: dict[str, str] = {}

    async def scenario() -> None:
        s = Session(addr)
        try:
            a = await Member.join(s, "st-a", topic, max_reconsume=3, delays_ms=[60_000])
            members["a"] = a.member_id
            leased = await a.receive(3)
            assert [x.offset for x in leased] == [0, 1, 2]
            await a.ack(leased[:1])
            await a.nack(leased[1:2], reason="db down", delay_ms=-1)  # the ladder: 60 s
            b = await Member.join(s, "st-b", topic, max_reconsume=0)
            await b.nack(await b.receive(1), reason="poison message")
        finally:
            await s.close()

    before = time.time() * 1000 - 1000  # the broker's and the test's clock: same machine
    asyncio.run(scenario())

    def groups(msg_id: str) -> dict[str, Any]:
        resp = ok_json(addr, "message", "status", msg_id)
        assert (resp["msg_id"], resp["topic"], resp["queue"]) == (msg_id, topic, 0)
        return {g["group"]: g for g in resp["groups"]}

    wait_for(lambda: groups(ids[0])["st-b"]["state"] == "DEAD")
    wait_for(lambda: groups(ids[1])["st-a"]["state"] == "RETRYING")
    now = time.time() * 1000
    s0 = groups(ids[0])
    assert s0["st-a"]["state"] == "CONSUMED"
    assert before <= s0["st-a"]["at_ms"] <= now + 1000
    assert before <= s0["st-b"]["at_ms"] <= now + 1000  # when it was dead-lettered
    assert "poison message" in s0["st-b"]["reason"]
    assert s0["st-b"]["reconsume_times"] == 1
    s1 = groups(ids[1])
    assert s1["st-a"]["reconsume_times"] == 1
    assert s1["st-a"]["reason"] == "db down"
    assert s1["st-a"]["at_ms"] is None  # retrying: neither consumed nor dead
    assert now + 30_000 < s1["st-a"]["next_attempt_ms"] < now + 70_000
    assert s1["st-b"]["state"] == "WAITING"
    s2 = groups(ids[2])
    assert s2["st-a"]["state"] == "DELIVERED"
    assert s2["st-a"]["member"] == members["a"]
    assert now + 30_000 < s2["st-a"]["lease_until_ms"] < now + 70_000
    assert {g: s["state"] for g, s in groups(ids[3]).items()} == {"st-a": "WAITING",
                                                                  "st-b": "WAITING"}

    plain = ok(addr, "message", "status", ids[1])
    assert f"message {ids[1]}: {topic}/0 offset 1" in plain
    row = next(line for line in plain.splitlines() if line.startswith("st-a"))
    assert "RETRYING" in row
    assert "next attempt at" in row
    assert "db down" in row
    row = next(line for line in ok(addr, "message", "status", ids[2]).splitlines()
               if line.startswith("st-a"))
    assert "DELIVERED" in row
    assert members["a"] in row
    plain0 = ok(addr, "message", "status", ids[0])
    assert "DEAD" in plain0
    row = next(line for line in plain0.splitlines() if line.startswith("st-a"))
    assert "CONSUMED" in row and "acknowledged at " in row
    # --json after the command works too
    assert json.loads(ok(addr, "message", "status", ids[0], "--json"))["msg_id"] == ids[0]

    fails(addr, "message", "status", "not-an-id", code=2)
    res = fails(addr, "message", "status", "7FFF0000" + "0" * 20)
    assert "7FFF0000" in res.stderr or "32767" in res.stderr


def test_message_status_of_messages_the_tag_filter_skipped(tmp_path: Path) -> None:
    """FILTERED names the group's tag expression, with no member online, after a kill -9
    (journal) and after a clean restart (snapshot); a message judged by an expression the group
    no longer uses is not claimed either way."""
    topic = "fl-orders"
    bp = BrokerProcess(tmp_path / "data").start()
    addr = bp.address
    try:
        create_topic(addr, topic, 1)
        ids = produce(addr, [Message(topic, "m0", tags="paid"), Message(topic, "m1", tags="created"),
                             Message(topic, "m2"), Message(topic, "m3", tags="created")])

        async def consume(tags: str, n: int) -> list[int]:
            s = Session(addr)
            try:
                mem = await Member.join(s, "fl-g", topic, tags=tags)
                got = await mem.receive(n)
                await mem.ack(got)
                await mem.leave()
                return [x.offset for x in got]
            finally:
                await s.close()

        assert asyncio.run(consume("created", 2)) == [1, 3]

        def status(msg_id: str) -> dict[str, Any]:
            resp = ok_json(addr, "message", "status", msg_id)
            (row,) = resp["groups"]
            return dict(row)

        def check_first_run() -> None:
            s0 = status(ids[0])
            assert (s0["state"], s0["reason"]) == ("FILTERED", "filtered out by the group's tag "
                                                   "expression 'created' (its tag is 'paid'): "
                                                   "never delivered")
            assert s0["at_ms"] is None
            s2 = status(ids[2])
            assert s2["state"] == "FILTERED" and "(it has no tag)" in s2["reason"]
            s1 = status(ids[1])
            assert s1["state"] == "CONSUMED" and s1["at_ms"] is not None and not s1["reason"]

        check_first_run()
        row = next(line for line in ok(addr, "message", "status", ids[0]).splitlines()
                   if line.startswith("fl-g"))
        assert row.split()[1] == "FILTERED" and "tag expression 'created'" in row
        bp.kill9()
        bp.start()  # the journal
        check_first_run()
        assert bp.terminate() == 0
        bp.start()  # the snapshot
        check_first_run()

        # the group changes its expression: new messages are judged by it, older ones by the
        # old one, which is not kept
        ids += produce(addr, [Message(topic, "m4", tags="created"), Message(topic, "m5",
                                                                             tags="paid")])
        assert asyncio.run(consume("paid", 1)) == [5]
        s4 = status(ids[4])
        assert s4["state"] == "FILTERED" and "expression 'paid' (its tag is 'created')" in \
            s4["reason"]
        s0 = status(ids[0])
        assert s0["state"] == "CONSUMED" and s0["at_ms"] is None
        assert "filtered out by a tag expression the group no longer uses" in s0["reason"]
        assert status(ids[5])["state"] == "CONSUMED"
    finally:
        if bp.proc is not None and bp.proc.poll() is None:
            bp.proc.kill()
            bp.proc.wait(10)


# -- message show --------------------------------------------------------------------------------------


def test_message_show_and_gone_messages(broker: Broker) -> None:
    addr = broker.address
    topic = "show-t"
    create_topic(addr, topic, 1, segment_bytes="200", retention_ms="1")
    (msg_id,) = produce(addr, [Message(topic, "hello\nworld", tags="created",
                                       keys=["o-1", "o-2"], properties={"src": "test"})])
    plain = ok(addr, "message", "show", msg_id)
    lines = plain.splitlines()
    assert lines[0].split() == ["msg_id:", msg_id]
    assert "tag:          created" in plain
    assert "keys:         o-1 o-2" in plain
    assert "properties:   src=test" in plain
    assert lines[-2:] == ["hello", "world"]
    d = ok_json(addr, "message", "show", msg_id)
    assert (d["msg_id"], d["topic"], d["queue"], d["offset"]) == (msg_id, topic, 0, 0)
    assert (d["body"], d["keys"], d["properties"], d["tag"]) == (
        "hello\nworld", ["o-1", "o-2"], {"src": "test"}, "created")

    beyond = msg_id[:-2] + "63"  # offset 99
    res = fails(addr, "message", "show", beyond)
    assert "is gone" in res.stderr
    assert "never written" in res.stderr

    # retention removes the first segment once another one exists (segments of 200 bytes)
    produce(addr, [Message(topic, "x" * 300), Message(topic, "y" * 300)])
    wait_for(lambda: run(addr, "message", "show", msg_id).exit_code == 1, timeout=15)
    res = fails(addr, "message", "show", msg_id)
    assert "deleted by retention" in res.stderr
    fails(addr, "message", "show", "xyz", code=2)
    res = fails(addr, "message", "show", "7FFF0000" + "0" * 20)
    assert "no topic has id" in res.stderr


# -- dead letters ----------------------------------------------------------------------------------------


def test_dlq_list_show_redrive_purge(broker: Broker) -> None:
    addr = broker.address
    topic, group = "dlq-t", "dlq-g"
    create_topic(addr, topic, 1)
    ids = produce(addr, [Message(topic, f"payload {i}", keys=f"d{i}", properties={"n": str(i)})
                         for i in range(6)])
    dead_letter_all(addr, group, topic, 6, "bad payload")
    wait_for(lambda: dlq_count(addr, group) == 6)

    letters = ok_json(addr, "dlq", "list", group)["dead_letters"]
    assert [d["msg_id"] for d in letters] == ids
    for i, d in enumerate(letters):
        assert (d["topic"], d["queue"], d["offset"], d["attempts"]) == (topic, 0, i, 1)
        assert "bad payload" in d["reason"]
        assert d["properties"] == {"n": str(i)}  # the broker's % properties hidden
        assert (d["body"], d["keys"]) == (f"payload {i}", [f"d{i}"])
        assert d["dead_ms"] > 0
    assert [d["msg_id"] for d in ok_json(addr, "dlq", "list", group, "-n", "2")[
        "dead_letters"]] == ids[:2]
    plain = ok(addr, "dlq", "list", group)
    assert len(plain.splitlines()) == 7
    assert ids[0] in plain
    assert "bad payload" in plain

    shown = ok(addr, "dlq", "show", group, ids[3])
    assert "payload 3" in shown
    assert "properties:   n=3" in shown
    assert "bad payload" in shown
    one = ok_json(addr, "dlq", "show", group, ids[3])
    assert ok_json(addr, "dlq", "show", group, one["dlq_msg_id"])["msg_id"] == ids[3]
    res = fails(addr, "dlq", "show", group, ids[3][:-1] + "F")
    assert "not in the dead-letter queue" in res.stderr
    fails(addr, "dlq", "list", "no-such-group")
    assert ok_json(addr, "group", "describe", group)["dlq_size"] == 6

    # dry run changes nothing
    assert "would redrive 6 dead letters of group dlq-g" in ok(addr, "dlq", "redrive", group,
                                                              "--dry-run")
    assert ok_json(addr, "dlq", "redrive", group, "--dry-run", "--max", "4")["count"] == 4
    assert dlq_count(addr, group) == 6

    out = ok(addr, "dlq", "redrive", group, "--max", "2")
    assert "redrove 2 dead letters" in out
    assert [d["msg_id"] for d in ok_json(addr, "dlq", "list", group)["dead_letters"]] == ids[2:]

    async def redelivered_and_dead_again() -> list[str]:
        s = Session(addr)
        try:
            mem = await Member.join(s, group, topic, max_reconsume=0)
            back = await mem.receive(2)
            assert {x.topic for x in back} == {f"%RETRY%{group}"}
            await mem.nack(back, reason="still bad")
            return [x.record.properties["%MSGID"] for x in back]
        finally:
            await s.close()

    assert sorted(asyncio.run(redelivered_and_dead_again())) == ids[:2]
    wait_for(lambda: dlq_count(addr, group) == 6)

    # paced: 8 msgs/s in chunks of 2 -> chunks at 0, 0.25, 0.5 s, then one that finds nothing
    t0 = time.monotonic()
    out = ok(addr, "dlq", "redrive", group, "--rate", "8")
    elapsed = time.monotonic() - t0
    assert "redrove 6 dead letters" in out
    assert elapsed >= 0.6, elapsed
    assert dlq_count(addr, group) == 0

    async def all_dead_again() -> None:
        s = Session(addr)
        try:
            mem = await Member.join(s, group, topic, max_reconsume=0)
            await mem.nack(await mem.receive(6), reason="hopeless")
        finally:
            await s.close()

    asyncio.run(all_dead_again())
    wait_for(lambda: dlq_count(addr, group) == 6)

    assert "would purge 6 dead letters" in ok(addr, "dlq", "purge", group, "--dry-run")
    assert dlq_count(addr, group) == 6
    fails(addr, "dlq", "purge", group, code=2)  # no --yes and no terminal
    assert "purged 6 dead letters of group dlq-g" in ok(addr, "dlq", "purge", group, "--yes")
    assert "no dead letters in group dlq-g" in ok(addr, "dlq", "list", group)
    assert ok_json(addr, "group", "describe", group)["dlq_size"] == 0
    assert ok_json(addr, "dlq", "purge", group, "--yes")["count"] == 0


def test_dlq_redrive_and_purge_one_letter_by_its_offset(broker: Broker) -> None:
    addr = broker.address
    topic, group = "one-t", "one-g"
    create_topic(addr, topic, 1)
    ids = produce(addr, [Message(topic, f"payload {i}") for i in range(5)])
    dead_letter_all(addr, group, topic, 5, "bad payload")
    wait_for(lambda: dlq_count(addr, group) == 5)

    def listed() -> list[tuple[int, str]]:
        return [(d["dlq_offset"], d["msg_id"])
                for d in ok_json(addr, "dlq", "list", group)["dead_letters"]]

    offsets = {msg_id: off for off, msg_id in listed()}
    mid, other = offsets[ids[2]], offsets[ids[3]]
    out = ok(addr, "dlq", "redrive", group, "--offset", str(mid), "--dry-run")
    assert out == f"would redrive 1 dead letter of group {group} (DLQ offset {mid})\n"
    assert len(listed()) == 5
    out = ok(addr, "dlq", "redrive", group, "--offset", str(mid))
    assert out == f"redrove 1 dead letter of group {group} (DLQ offset {mid})\n"
    assert ids[2] not in {msg_id for _, msg_id in listed()}
    fails(addr, "dlq", "purge", group, "--offset", str(other), code=2)  # no --yes, no terminal
    got = ok_json(addr, "dlq", "purge", group, "--offset", str(other), "--yes")
    assert (got["count"], got["first"], got["end"]) == (1, other, other + 1)
    assert sorted(msg_id for _, msg_id in listed()) == sorted([ids[0], ids[1], ids[4]])
    assert ok_json(addr, "group", "describe", group)["dlq_size"] == 3
    res = fails(addr, "dlq", "purge", group, "--offset", str(other), "--yes")
    assert f"offset {other}: redriven or purged already; nothing was changed" in res.stderr
    res = fails(addr, "dlq", "redrive", group, "--offset", "99")
    assert "offset 99: beyond the end of the dead-letter queue (5)" in res.stderr
    res = fails(addr, "dlq", "redrive", group, "--offset", "1", "--max", "2", code=2)
    assert "--offset names one dead letter" in res.stderr
    fails(addr, "dlq", "redrive", group, "--offset", "-1", code=2)
    assert ok_json(addr, "group", "describe", group)["dlq_size"] == 3

    async def redriven_one_comes_back() -> str:
        s = Session(addr)
        try:
            mem = await Member.join(s, group, topic, max_reconsume=0)
            (back,) = await mem.receive(1)
            await mem.ack([back])
            return back.record.properties["%MSGID"]
        finally:
            await s.close()

    assert asyncio.run(redriven_one_comes_back()) == ids[2]


NO_TERMINAL = {"FORCE_COLOR": None, "TTY_COMPATIBLE": None}
"""CliRunner's stderr is no terminal; these would make rich treat it as one."""
TERMINAL = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": None}
"""rich (and so the progress bar) treats stderr as a terminal."""


def test_dlq_redrive_and_purge_progress_only_on_a_terminal(broker: Broker) -> None:
    addr = broker.address
    topic, group = "prog-t", "prog-g"
    create_topic(addr, topic, 1)
    produce(addr, [Message(topic, f"p{i}") for i in range(6)])

    def fill() -> None:
        dead_letter_all(addr, group, topic, 6, "bad")
        wait_for(lambda: dlq_count(addr, group) == 6)

    def invoke(env: dict[str, str | None], *args: str) -> Result:
        res = CliRunner().invoke(cli, ["--server", addr, *args], env=env)
        assert res.exit_code == 0, (res.stdout, res.stderr, res.exception)
        return res

    fill()
    plain = invoke(NO_TERMINAL, "dlq", "redrive", group, "--rate", "40")  # chunks of 10
    assert plain.stdout == "redrove 6 dead letters of group prog-g (DLQ offsets 0..5)\n"
    assert plain.stderr == ""  # no terminal: nothing extra

    async def dead_again() -> None:
        s = Session(addr)
        try:
            mem = await Member.join(s, group, topic, max_reconsume=0)
            await mem.nack(await mem.receive(6), reason="bad")
        finally:
            await s.close()

    asyncio.run(dead_again())
    wait_for(lambda: dlq_count(addr, group) == 6)
    shown = invoke(TERMINAL, "dlq", "redrive", group, "--rate", "8")  # chunks of 2
    assert shown.stdout == "redrove 6 dead letters of group prog-g (DLQ offsets 6..11)\n"
    assert "redriving prog-g" in shown.stderr
    assert "6/6" in shown.stderr  # the bar's total came from the dry run, all moved
    assert "\x1b[" in shown.stderr  # drawn with terminal control sequences

    asyncio.run(dead_again())
    wait_for(lambda: dlq_count(addr, group) == 6)
    as_json = invoke(TERMINAL, "--json", "dlq", "purge", group, "--yes")
    assert json.loads(as_json.stdout)["count"] == 6
    assert as_json.stderr == ""  # --json: never a bar, even on a terminal
    assert invoke(TERMINAL, "dlq", "purge", group, "--yes").stderr.count("purging prog-g") >= 1

    create_topic(addr, "prog-del", 2)
    create_topic(addr, "prog-del2", 2)
    shown = invoke(TERMINAL, "topic", "delete", "prog-del", "--yes")
    plain = invoke(NO_TERMINAL, "topic", "delete", "prog-del2", "--yes")
    assert "deleting prog-del" in shown.stderr
    assert plain.stderr == ""
    assert shown.stdout.replace("prog-del", "X") == plain.stdout.replace("prog-del2", "X") != ""


# -- group describe / list -------------------------------------------------------------------------------


def test_group_describe_delivery_group_with_and_without_members(broker: Broker) -> None:
    addr = broker.address
    topic, group = "gd-t", "gd-g"
    create_topic(addr, topic, 2)
    produce(addr, [Message(topic, f"w{i}", sharding_key=str(i)) for i in range(6)])
    loop = asyncio.new_event_loop()
    s = Session(addr)
    try:
        mem = loop.run_until_complete(Member.join(s, group, topic, client_id="gd-client",
                                                  delays_ms=[100, 2000]))
        loop.run_until_complete(mem.receive(2))

        d = ok_json(addr, "group", "describe", group)
        assert (d["group"], d["kind"]) == (group, "delivery")
        assert [(x["client_id"], x["in_flight"]) for x in d["members"]] == [("gd-client", 2)]
        assert d["members"][0]["last_heartbeat_ms_ago"] < 10_000
        assert {q["topic"] for q in d["queues"]} == {topic}
        assert sum(q["lag"] for q in d["queues"]) == 6
        assert sum(q["in_flight"] for q in d["queues"]) == 2
        assert sum(q["end_offset"] for q in d["queues"]) == 6
        assert all(q["oldest_age_ms"] is not None for q in d["queues"] if q["lag"])
        assert d["retry_policy"] == {"max_reconsume": 16, "retry_delays_ms": [100, 2000]}
        assert (d["retry_pending"], d["dlq_size"]) == (0, 0)
        plain = ok(addr, "group", "describe", group)
        assert "delivery group gd-g: 1 members online" in plain
        assert "retry policy: max_reconsume 16, delays 100ms 2s" in plain
        assert "gd-client" in plain
        assert "LAG" in plain
        assert "OLDEST" in plain
        listed = {(g["group"], g["state"]): g["members"]
                  for g in ok_json(addr, "group", "list")["groups"]}
        assert listed[(group, "DELIVERY")] == 1
        assert "DELIVERY" in ok(addr, "group", "list")

        loop.run_until_complete(mem.leave())
    finally:
        loop.run_until_complete(s.close())
        loop.close()

    # nobody online: the group is still described; the released leases wait as retries
    def settled() -> bool:
        d = ok_json(addr, "group", "describe", group)
        return bool(d["retry_pending"] == 2)

    wait_for(settled)
    d = ok_json(addr, "group", "describe", group)
    assert d["members"] == []
    assert sum(q["lag"] for q in d["queues"]) == 4
    assert sum(q["in_flight"] for q in d["queues"]) == 0
    plain = ok(addr, "group", "describe", group)
    assert "no member online" in plain
    assert "0 members online" in plain

    # a consumer group of the same name: both are shown
    with PullConsumer(addr, group=group, auto_offset_reset="earliest") as c:
        c.subscribe(topic)
        wait_for(lambda: bool(c.poll(timeout=0.5)))
        c.commit()
    both = ok_json(addr, "group", "describe", group)
    assert both["kind"] == "both"
    assert both["consumer"]["group"] == group
    assert both["consumer"]["kind"] == "consumer"
    assert both["delivery"]["kind"] == "delivery"
    plain = ok(addr, "group", "describe", group)
    assert f"group {group}: state" in plain
    assert f"delivery group {group}" in plain

    res = fails(addr, "group", "describe", "nobody-knows-this-group")
    assert "no consumer group or delivery group" in res.stderr


def test_group_describe_lag_counts_every_message_not_finished(broker: Broker) -> None:
    """Lag counts what the group has not finished: held behind a blocked key and retried in
    place (orderly), leased, and in the retry queue (the group's total)."""
    addr = broker.address
    create_topic(addr, "lag-t", 1)
    produce(addr, [Message("lag-t", f"k{i}", sharding_key="customer-7") for i in range(10)])
    produce(addr, [Message("lag-t", f"u{i}") for i in range(3)])  # unkeyed: 10, 11, 12

    async def scenario() -> None:
        s = Session(addr)
        try:
            orderly = await Member.join(s, "lag-orderly", "lag-t", orderly=True)
            heads = await orderly.receive(4)  # the key's head and the three unkeyed ones
            assert sorted(x.offset for x in heads) == [0, 10, 11, 12]
            await orderly.ack([x for x in heads if x.offset >= 10])
            head = [x for x in heads if x.offset == 0]
            await orderly.nack(head, reason="payment service down", delay_ms=60_000)
            plain = await Member.join(s, "lag-plain", "lag-t", delays_ms=[60_000])
            got = await plain.receive(13)
            await plain.ack(got[:10])
            await plain.nack(got[10:11], reason="later", delay_ms=-1)  # the ladder: 60 s
        finally:
            await s.close()

    asyncio.run(scenario())
    d = ok_json(addr, "group", "describe", "lag-orderly")
    assert [(q["next"], q["end_offset"], q["in_flight"], q["lag"]) for q in d["queues"]] == [
        (13, 13, 0, 10)]  # the failed head and the 9 messages held behind it
    assert d["lag"] == 10
    assert [k["key"] for k in d["blocked_keys"]] == ["customer-7"]
    text = ok(addr, "group", "describe", "lag-orderly")
    assert "delivery group lag-orderly: 1 members online, lag 10," in text
    row = next(line.split() for line in text.splitlines() if line.startswith("lag-t "))
    assert row[6] == "10", text  # TOPIC QUEUE ACKED-BELOW NEXT END IN-FLIGHT LAG OLDEST

    wait_for(lambda: ok_json(addr, "group", "describe", "lag-plain")["retry_pending"] == 1)
    d = ok_json(addr, "group", "describe", "lag-plain")
    assert [(q["in_flight"], q["lag"]) for q in d["queues"]] == [(2, 2)]
    assert d["lag"] == 3  # and the retry letter


# -- find by key -------------------------------------------------------------------------------------------


def _indexed(b: Broker, topic: str) -> bool:
    srv = b.server
    t = srv.topics.topics[topic]
    indexes = srv.key_index.indexes
    return all((t.topic_id, qs.queue) in indexes
               and indexes[(t.topic_id, qs.queue)].next_offset >= qs.visible_end
               for qs in t.queues)


def test_find_by_key_from_the_index_and_after_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    b = Broker(data, port=0).start()
    try:
        addr = b.address
        topic = "fk"
        create_topic(addr, topic, 2)
        msgs = [Message(topic, f"order event {i}", keys=[f"order-{i % 4}", "all"],
                        sharding_key=str(i)) for i in range(20)]
        msgs += [Message(topic, "collides a", keys=COLLIDING[0]),
                 Message(topic, "collides b", keys=COLLIDING[1])]
        ids = produce(addr, msgs)
        want = {ids[i] for i in range(20) if i % 4 == 1}

        def found(key: str, *extra: str) -> list[dict[str, Any]]:
            resp = ok_json(addr, "message", "find", topic, "--key", key, *extra)
            assert resp["unindexed"] == 0
            return list(resp["messages"])

        # at once: the part not indexed yet is searched directly
        hits = found("order-1")
        assert {h["msg_id"] for h in hits} == want
        assert all("order-1" in h["keys"] for h in hits)
        stored = [h["stored_ms"] for h in hits]
        assert stored == sorted(stored, reverse=True)  # newest first
        assert len(found("all", "--limit", "3")) == 3
        assert [h["msg_id"] for h in found(COLLIDING[0])] == [ids[20]]

        wait_for(lambda: _indexed(b, topic), timeout=15)
        assert {h["msg_id"] for h in found("order-1")} == want
        assert [h["msg_id"] for h in found(COLLIDING[1])] == [ids[21]]  # hash collision sorted out
        assert found("no-such-key") == []
        plain = ok(addr, "message", "find", topic, "--key", "order-2")
        assert len(plain.splitlines()) == 1 + 5
        assert "order-2 all" in plain
        assert "has key 'nope'" in ok(addr, "message", "find", topic, "-k", "nope")
        files = sorted((data / "topics" / topic).glob("*/keyindex/*.kix"))
        assert len(files) == 2
    finally:
        b.stop()

    b = Broker(data, port=0).start()
    try:
        addr = b.address
        t = b.server.topics.topics[topic]
        hits = found("order-1")
        assert {h["msg_id"] for h in hits} == want
        # served from the index kept on disk, not rebuilt
        for qs in t.queues:
            assert b.server.key_index.indexes[(t.topic_id, qs.queue)].next_offset == qs.visible_end
        more = produce(addr, [Message(topic, "after restart", keys="order-1")])
        assert found("order-1", "-n", "1")[0]["msg_id"] == more[0]

        fails(addr, "message", "find", "no-such-topic", "--key", "k")
        fails(addr, "message", "find", topic, "--key", "", code=2)
        ok(addr, "topic", "delete", topic, "--yes")
        assert not (data / "topics" / topic).exists()
        wait_for(lambda: t.topic_id not in {k[0] for k in b.server.key_index.indexes})
    finally:
        b.stop()


def test_find_by_key_reports_what_it_could_not_search(tmp_path: Path) -> None:
    with Broker(tmp_path / "data", port=0, key_index_enabled=False, find_scan_bytes=1) as b:
        addr = b.address
        create_topic(addr, "fk-partial", 1)
        ids = produce(addr, [Message("fk-partial", f"v{i}", keys="k") for i in range(3)])
        res = run(addr, "--json", "message", "find", "fk-partial", "--key", "k")
        assert res.exit_code == 0, res.stderr
        resp = json.loads(res.stdout)
        assert [h["msg_id"] for h in resp["messages"]] == ids[:1]
        assert resp["unindexed"] == 2
        assert "2 of the newest offsets were not searched" in res.stderr


# -- usage errors (no broker) ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["message", "status"],
        ["message", "status", "123"],
        ["message", "show", "zz" * 14],
        ["message", "find", "t"],  # --key is required
        ["message", "find", "t", "--key", "k", "--limit", "0"],
        ["dlq", "show", "g"],
        ["dlq", "list", "g", "--limit", "0"],
        ["dlq", "redrive", "g", "--rate", "0"],
        ["dlq", "redrive", "g", "--max", "0"],
        ["dlq", "purge", "g"],  # no --yes and stdin is not a terminal
    ],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    res = CliRunner().invoke(cli, ["--server", "127.0.0.1:1", *args])
    assert res.exit_code == 2, res.output


def test_help_lists_the_new_commands() -> None:
    out = CliRunner().invoke(cli, ["--help"]).output
    assert "message" in out
    assert "dlq" in out
    for sub, names in (("message", ("status", "show", "find")),
                       ("dlq", ("list", "show", "redrive", "purge"))):
        text = CliRunner().invoke(cli, [sub, "--help"]).output
        assert all(n in text for n in names)
