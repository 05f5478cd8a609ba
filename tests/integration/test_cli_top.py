"""``ferrymq top`` against real brokers: rates from produced messages, lag after commits, the
JSON lines, and its errors (no broker, a refused login, a broker that stops mid-view)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from ferrymq import AdminClient, Broker, Message, Producer, PullConsumer
from ferrymq.admin.cli import cli
from ferrymq.admin.top import Sample, build_view, take_sample
from ferrymq.client.admin import AsyncAdminClient
from tests.security_helpers import make_user, write_users

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    with Broker(tmp_path_factory.mktemp("top"), port=0) as b:
        yield b


def run(addr: str, *args: str) -> Result:
    return CliRunner().invoke(cli, ["--server", addr, "--connect-timeout", "1", *args])


def views(addr: str, *args: str) -> list[dict[str, Any]]:
    res = run(addr, "top", "--json", "--interval", "0.1", *args)
    assert res.exit_code == 0, (res.stdout, res.stderr, res.exception)
    return [json.loads(line) for line in res.stdout.splitlines()]


def produce(addr: str, topic: str, n: int, body: bytes = b"x" * 100) -> None:
    with Producer(addr) as p:
        for i in range(n):
            p.send(Message(topic, body, sharding_key=str(i)))


def sample(addr: str, **kw: Any) -> Sample:
    async def go() -> Sample:
        async with AsyncAdminClient(addr) as admin:
            return await take_sample(admin, **kw)
    return asyncio.run(go())


def test_rates_come_from_the_messages_produced_between_two_samples(broker: Broker) -> None:
    addr = broker.address
    with AdminClient(addr) as a:
        a.create_topic("top-rate", 2)
        a.create_topic("top-idle", 1)
    produce(addr, "top-rate", 10)
    before = sample(addr, topics=["top-*"])
    with AdminClient(addr) as a:
        size0 = sum(q.size_bytes for q in a.describe_topic("top-rate").queues)
    produce(addr, "top-rate", 50)
    after = sample(addr, topics=["top-*"])
    with AdminClient(addr) as a:
        size1 = sum(q.size_bytes for q in a.describe_topic("top-rate").queues)
    view = build_view(before, after)
    interval = after.at_s - before.at_s
    assert [t.topic for t in view.topics] == ["top-rate", "top-idle"]  # busiest first
    busy, idle = view.topics
    assert (busy.queues, busy.end_offset) == (2, 60)
    assert busy.messages_per_s == pytest.approx(50 / interval)
    assert busy.bytes_per_s == pytest.approx((size1 - size0) / interval)
    assert size1 - size0 > 50 * 100
    assert (idle.messages_per_s, idle.bytes_per_s) == (0, 0)
    assert [t.topic for t in build_view(before, after, sort="name", limit=1).topics] == \
        ["top-idle"]


def test_json_views_show_rates_and_consumer_group_lag_after_a_commit(broker: Broker) -> None:
    addr = broker.address
    with AdminClient(addr) as a:
        a.create_topic("top-lag", 1)
    produce(addr, "top-lag", 10)
    with PullConsumer(addr, group="top-g", auto_offset_reset="earliest") as c:
        c.assign([("top-lag", 0)])
        c.commit({("top-lag", 0): 4})
    time.sleep(0.3)  # the oldest unconsumed message (offset 4) is at least this old

    producing = threading.Thread(target=produce, args=(addr, "top-lag", 20))
    producing.start()
    try:
        got = views(addr, "--iterations", "3", "--topic", "top-lag", "--group", "top-*")
    finally:
        producing.join()
    assert len(got) == 3
    for v in got:
        assert set(v) == {"interval_s", "topics", "consumer_groups", "delivery_groups"}
        assert [t["topic"] for t in v["topics"]] == ["top-lag"]
        assert set(v["topics"][0]) == {"topic", "queues", "end_offset", "size_bytes",
                                       "messages_per_s", "bytes_per_s"}
        assert v["interval_s"] >= 0.1
        (g,) = v["consumer_groups"]
        assert (g["group"], g["members"]) == ("top-g", 0)
        assert g["lag"] == v["topics"][0]["end_offset"] - 4
        assert g["lag_s"] >= 0.3
        assert v["delivery_groups"] == []
    ends = [v["topics"][0]["end_offset"] for v in got]
    for prev, v in itertools.pairwise(got):  # rate x interval: what the producer added
        grown = v["topics"][0]["end_offset"] - prev["topics"][0]["end_offset"]
        assert v["topics"][0]["messages_per_s"] * v["interval_s"] == pytest.approx(grown, abs=0.5)
    assert ends[-1] <= 30
    wait_until_end(addr, "top-lag", 30)

    with PullConsumer(addr, group="top-g", auto_offset_reset="earliest") as c:
        c.assign([("top-lag", 0)])
        c.commit({("top-lag", 0): 30})
    (v,) = views(addr, "--once", "--topic", "top-lag", "--group", "top-g")
    assert (v["consumer_groups"][0]["lag"], v["consumer_groups"][0]["lag_s"]) == (0, 0)
    assert v["topics"][0]["end_offset"] == 30


def wait_until_end(addr: str, topic: str, end: int) -> None:
    with AdminClient(addr) as a:
        assert sum(q.end_offset for q in a.describe_topic(topic).queues) == end


def test_table_output_once(broker: Broker) -> None:
    addr = broker.address
    with AdminClient(addr) as a:
        a.create_topic("top-table", 1)
    res = run(addr, "top", "--once", "--interval", "0.1", "--topic", "top-table")
    assert res.exit_code == 0, (res.stdout, res.stderr, res.exception)
    assert "top-table" in res.stdout
    assert "msg/s" in res.stdout
    assert "consumer groups" in res.stdout
    assert all(line == line.rstrip() for line in res.stdout.splitlines())  # plain columns
    assert "\x1b[" not in res.stdout
    assert res.stderr == ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_error_line(res: Result) -> str:
    assert res.exit_code == 1, (res.stdout, res.stderr, res.exception)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in res.stderr
    return lines[0]


def test_errors_no_broker_bad_login_usage(broker: Broker, tmp_path: Path) -> None:
    port = free_port()
    line = one_error_line(run(f"127.0.0.1:{port}", "top", "--once"))
    assert str(port) in line
    assert run(broker.address, "top", "--once", "--iterations", "2").exit_code == 2
    assert run(broker.address, "top", "--interval", "0").exit_code == 2
    users = write_users(tmp_path / "users", make_user("admin", "right-secret", admin=True))
    with Broker(tmp_path / "data", port=0, users_file=str(users)) as b:
        res = CliRunner().invoke(cli, ["--server", b.address, "--user", "admin", "--password",
                                       "wrong", "top", "--once", "--interval", "0.1"])
        assert "authentication" in one_error_line(res).lower()
        res = CliRunner().invoke(cli, ["--server", b.address, "--user", "admin", "--password",
                                       "right-secret", "--json", "top", "--once",
                                       "--interval", "0.1"])
        assert res.exit_code == 0, (res.stdout, res.stderr)


@pytest.mark.parametrize("live", [False, True], ids=["json-lines", "live-terminal"])
def test_a_broker_that_stops_mid_view_ends_it_with_an_error(tmp_path: Path, live: bool) -> None:
    b = Broker(tmp_path, port=0).start()
    with AdminClient(b.address) as a:
        a.create_topic("top-dies", 1)
    stopper = threading.Timer(0.8, b.stop)
    stopper.start()
    args = ["top", "--interval", "0.1"] + ([] if live else ["--json", "--iterations", "1000"])
    try:
        res = CliRunner().invoke(cli, ["--server", b.address, "--connect-timeout", "1", *args],
                                 env={"FORCE_COLOR": "1" if live else None,
                                      "TTY_COMPATIBLE": None})
    finally:
        stopper.join()
        b.stop()
    line = one_error_line(res)
    assert "connection" in line.lower() or "broker" in line.lower()
    assert "top-dies" in res.stdout  # the views before it went away were shown
    if live:
        assert "\x1b[" in res.stdout  # redrawn in place on the terminal
    else:
        assert all(json.loads(x)["topics"] for x in res.stdout.splitlines())


def test_limit_and_sort_choose_the_groups_shown(broker: Broker) -> None:
    addr = broker.address
    with AdminClient(addr) as a:
        a.create_topic("top-lim", 1)
    produce(addr, "top-lim", 10)
    for group, at in (("lim-a", 9), ("lim-b", 2), ("lim-c", 5)):
        with PullConsumer(addr, group=group) as c:
            c.assign([("top-lim", 0)])
            c.commit({("top-lim", 0): at})
    (v,) = views(addr, "--once", "--topic", "top-lim", "--group", "lim-*", "--limit", "2")
    assert [(g["group"], g["lag"]) for g in v["consumer_groups"]] == [("lim-b", 8),
                                                                       ("lim-c", 5)]
    assert all(g["lag_s"] >= 0 for g in v["consumer_groups"])  # the ages of those shown
    (v,) = views(addr, "--once", "--topic", "top-lim", "--group", "lim-*", "--sort", "name",
                 "--limit", "1")
    assert [g["group"] for g in v["consumer_groups"]] == ["lim-a"]
    assert v["consumer_groups"][0]["lag_s"] >= 0


def test_ctrl_c_ends_the_live_view_with_exit_0(broker: Broker) -> None:
    env = {**os.environ, "FORCE_COLOR": "1"}
    env.pop("TTY_COMPATIBLE", None)
    proc = subprocess.Popen([sys.executable, "-m", "ferrymq.admin.cli", "--server",
                             broker.address, "top", "--interval", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        drawn = b""
        while b"ferrymq top" not in drawn:  # the first view (after one interval)
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, proc.stderr.read() if proc.stderr else b""
            drawn += chunk
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert b"Traceback" not in err
