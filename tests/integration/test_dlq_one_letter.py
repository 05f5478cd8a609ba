"""Redriving or purging ONE chosen dead letter (DLQ_ADMIN with an offset), anywhere in the
dead-letter queue: the others stay, browsing and the DLQ depth skip it, a restart keeps it done
(journal and snapshot), the floor folds it away, and an offset that is not a live dead letter
is refused with nothing changed."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ferrymq import AdminClient, Broker, Message, Producer, SimpleConsumer
from ferrymq.client._session import Session
from ferrymq.errors import (
    InvalidOffsetError,
    InvalidRequestError,
    PolicyViolationError,
    UnsupportedVersionError,
)
from ferrymq.protocol import messages as m
from tests.console_helpers import http_url
from tests.console_helpers import receive as receive_up_to
from tests.helpers import BrokerProcess, free_port

pytestmark = pytest.mark.integration

N = 5


def kill_all(addr: str, topic: str = "t", group: str = "g") -> list[str]:
    """Produce N messages and dead-letter each at once (max_reconsume 0): DLQ offsets 0..N-1
    hold m0..m{N-1}. Returns their message ids, in DLQ order."""
    with AdminClient(addr) as admin:
        admin.create_topic(topic, 1)
    with Producer(addr) as p:
        ids = [r.msg_id for r in p.send_batch([Message(topic, f"m{i}".encode())
                                               for i in range(N)])]
    with SimpleConsumer(addr, group, max_reconsume=0) as c:
        c.subscribe(topic)
        got = receive(c, N)
        for msg in sorted(got, key=lambda x: ids.index(x.msg_id)):
            c.nack(msg, reason="poison")
    with AdminClient(addr) as admin:
        deadline = time.monotonic() + 10
        while admin.describe_delivery(group).dlq_size < N:
            assert time.monotonic() < deadline, "letters did not die"
            time.sleep(0.05)
    return ids


def receive(c: SimpleConsumer, n: int) -> list[Any]:
    got = receive_up_to(c, n)
    assert len(got) == n, f"received {len(got)} of {n}"
    return got


def dead(admin: AdminClient, group: str = "g") -> list[tuple[int, bytes]]:
    """(DLQ offset, body) of the live dead letters, oldest first."""
    return [(x.dlq_offset, x.body) for x in admin.dlq_list(group)]


def scrape_depth(broker: Broker, group: str = "g") -> float:
    """The ferrymq_delivery_group_dlq_depth sample of ``group`` on /metrics."""
    with urllib.request.urlopen(http_url(broker) + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith("ferrymq_delivery_group_dlq_depth{") and f'group="{group}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no dlq depth sample for the group")


@pytest.fixture
def broker_http(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path / "data", port=0, http_port=free_port()).start()
    try:
        yield b
    finally:
        b.stop()


def test_redrive_one_letter_in_the_middle(broker_http: Broker) -> None:
    addr = broker_http.address
    ids = kill_all(addr)
    with AdminClient(addr) as admin:
        dry = admin.dlq_redrive("g", dry_run=True, offset=2)
        assert (dry.first, dry.end, dry.count) == (2, 3, 1)
        assert len(dead(admin)) == N  # a dry run changes nothing
        resp = admin.dlq_redrive("g", offset=2)
        assert (resp.first, resp.end, resp.count, resp.done) == (2, 3, 1, [2])
        assert dead(admin) == [(0, b"m0"), (1, b"m1"), (3, b"m3"), (4, b"m4")]
        assert admin.describe_delivery("g").dlq_size == N - 1
        assert scrape_depth(broker_http) == N - 1
        assert admin.dlq_at("g", 2) is None
        assert admin.dlq_get("g", ids[2]) is None
        assert admin.dlq_get("g", ids[3]) is not None
        assert [s[1] for s in admin.message_status(ids[2]).statuses if s[0] == "g"] \
            != ["DEAD"]
    with SimpleConsumer(addr, "g", max_reconsume=0) as c:
        c.subscribe("t")
        (back,) = receive(c, 1)
        assert back.msg_id == ids[2] and back.body == b"m2" and back.reconsume_times == 0
        assert c.receive(16, wait=0.5) == []  # only that one came back
        c.ack(back)


def test_purge_one_letter_in_the_middle(broker_http: Broker) -> None:
    addr = broker_http.address
    kill_all(addr)
    with AdminClient(addr) as admin:
        assert admin.dlq_purge("g", dry_run=True, offset=1).count == 1
        assert len(dead(admin)) == N
        resp = admin.dlq_purge("g", offset=1)
        assert (resp.first, resp.end, resp.count, resp.done) == (1, 2, 1, [1])
        assert dead(admin) == [(0, b"m0"), (2, b"m2"), (3, b"m3"), (4, b"m4")]
        assert admin.describe_delivery("g").dlq_size == N - 1
        assert scrape_depth(broker_http) == N - 1
        # the bulk operations count and skip it: purge-all dry run says 4, redrive-all moves 4
        assert admin.dlq_purge("g", dry_run=True).count == N - 1
        assert admin.dlq_redrive("g", dry_run=True).count == N - 1
    with SimpleConsumer(addr, "g", max_reconsume=0) as c:
        c.subscribe("t")
        assert c.receive(16, wait=0.5) == []  # purged: not delivered


def test_bulk_redrive_skips_letters_done_one_by_one_and_the_floor_folds_them(
    broker: Broker,
) -> None:
    addr = broker.address
    kill_all(addr)
    with AdminClient(addr) as admin:
        admin.dlq_purge("g", offset=1)
        admin.dlq_redrive("g", offset=3)
        assert admin.dlq_redrive("g", 2).count == 2  # offsets 0 and 2: 1 and 3 are done
        assert dead(admin) == [(4, b"m4")]
        g = broker.server.delivery.groups["g"]
        assert (g.dlq_floor, g.dlq_done) == (4, set())  # the floor passed 3, folding it away
    with SimpleConsumer(addr, "g", max_reconsume=0) as c:
        c.subscribe("t")
        got = receive(c, 3)  # m0, m2 (bulk) and m3 (one by one); never m1 (purged)
        assert sorted(x.body for x in got) == [b"m0", b"m2", b"m3"]
        assert c.receive(16, wait=0.5) == []


@pytest.mark.parametrize("stop", ["clean", "kill9"])
def test_a_restart_keeps_the_letter_done(tmp_path: Path, stop: str) -> None:
    """A clean stop reads it back from the snapshot (``dlq_done``), a kill -9 from the
    journal (``DX`` records)."""
    with BrokerProcess(tmp_path / "data") as bp:
        kill_all(bp.address)
        with AdminClient(bp.address) as admin:
            admin.dlq_redrive("g", offset=2)
            admin.dlq_purge("g", offset=3)
        if stop == "kill9":
            bp.kill9()
        else:
            bp.stop()
        bp.start()
        with AdminClient(bp.address) as admin:
            assert dead(admin) == [(0, b"m0"), (1, b"m1"), (4, b"m4")]
            assert admin.describe_delivery("g").dlq_size == 3
            with pytest.raises(InvalidOffsetError, match="redriven or purged already"):
                admin.dlq_purge("g", offset=2)
            assert admin.dlq_purge("g", 2).count == 2  # 0 and 1: the floor passes 2 and 3
            assert admin.dlq_purge("g", dry_run=True) == m.DlqAdminResponse(4, 5, 1, [])
        if stop == "kill9":
            bp.kill9()
        else:
            bp.stop()
        bp.start()
        with AdminClient(bp.address) as admin:
            assert dead(admin) == [(4, b"m4")]
            assert admin.describe_delivery("g").dlq_size == 1


def test_an_offset_that_is_not_a_live_dead_letter_is_refused_and_changes_nothing(
    broker: Broker,
) -> None:
    addr = broker.address
    kill_all(addr)
    with AdminClient(addr) as admin:
        admin.dlq_purge("g", 1)  # floor 1
        admin.dlq_purge("g", offset=3)
        before = dead(admin)
        assert before == [(1, b"m1"), (2, b"m2"), (4, b"m4")]
        cases = [
            (0, "below the oldest dead letter \\(1\\): redriven or purged already"),
            (3, "redriven or purged already"),
            (N, f"beyond the end of the dead-letter queue \\({N}\\)"),
            (10**9, "beyond the end"),
        ]
        for offset, why in cases:
            for act in (admin.dlq_redrive, admin.dlq_purge):
                for dry_run in (False, True):
                    with pytest.raises(InvalidOffsetError, match=f"offset {offset}: {why}"):
                        act("g", dry_run=dry_run, offset=offset)
        for bad in (-1, 1 << 63):
            with pytest.raises(ValueError, match=r"offset must be 0\.\."):
                admin.dlq_purge("g", offset=bad)
        assert dead(admin) == before
        assert admin.describe_delivery("g").dlq_size == len(before)


def test_a_raw_negative_offset_is_refused(broker: Broker) -> None:
    kill_all(broker.address)

    async def ask() -> None:
        s = Session(broker.address)
        try:
            with pytest.raises(InvalidRequestError, match="offset must be >= 0"):
                await s.request(m.DlqAdminRequest("g", int(m.DlqAction.PURGE), 0, False, -2),
                                m.DlqAdminResponse)
        finally:
            await s.close()

    asyncio.run(ask())
    with AdminClient(broker.address) as admin:
        assert admin.describe_delivery("g").dlq_size == N


def test_max_dlq_done_letters_bounds_the_letters_done_one_by_one(tmp_path: Path) -> None:
    with Broker(tmp_path / "data", port=0, max_dlq_done_letters=2) as b, \
            AdminClient(b.address) as admin:
        kill_all(b.address)
        admin.dlq_purge("g", offset=1)
        admin.dlq_purge("g", offset=2)
        with pytest.raises(PolicyViolationError, match="max_dlq_done_letters = 2"):
            admin.dlq_purge("g", offset=4)
        admin.dlq_purge("g", offset=0)  # the oldest: the floor moves, nothing more is kept
        admin.dlq_purge("g", offset=4)
        assert dead(admin) == [(3, b"m3")]


def test_a_broker_that_predates_the_offset_refuses_it_instead_of_acting_on_the_oldest(
    broker: Broker, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The request names one letter at version 2: a broker that knows only version 1 (made
    so here) answers UNSUPPORTED_VERSION and purges nothing, where ignoring the unknown
    trailing field would have purged the oldest letter."""
    kill_all(broker.address)
    monkeypatch.setattr(m.DlqAdminRequest, "MAX_VERSION", 1)
    with AdminClient(broker.address) as admin:
        with pytest.raises(UnsupportedVersionError):
            admin.dlq_purge("g", offset=3)
        assert admin.dlq_purge("g", 1).count == 1  # version 1 (no offset) still works
        assert [o for o, _ in dead(admin)] == [1, 2, 3, 4]
