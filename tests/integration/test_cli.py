"""End-to-end tests of the ``ferrymq`` command line against a real broker.

Every CLI call runs as a subprocess (``python -m ferrymq.admin.cli``) against one in-process
broker per module; each test uses its own topic and group names. Pure argument parsing is tested
with click's CliRunner (no broker involved).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from ferrymq import AdminClient, Broker, __version__
from ferrymq.admin.cli import Position, PositionType, cli, parse_time_ms
from tests.helpers import BrokerProcess, free_port, wait_for

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "ferrymq.admin.cli"]


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    with Broker(tmp_path_factory.mktemp("cli-broker"), port=0) as b:
        yield b


def ferrymq(server: str, *args: str, stdin: str | None = None,
            timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a subprocess against ``server``."""
    return subprocess.run(
        [*CLI, "--server", server, *args], input=stdin, capture_output=True, text=True,
        timeout=timeout, stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def ok(server: str, *args: str, stdin: str | None = None) -> str:
    """Run the CLI, assert success, return stdout."""
    res = ferrymq(server, *args, stdin=stdin)
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    return res.stdout


def assert_one_error_line(res: subprocess.CompletedProcess[str]) -> None:
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ")


def assert_right_aligned(table: list[str], columns: tuple[str, ...]) -> None:
    """Every row of a plain table ends each of ``columns`` where its header ends."""
    header, rows = table[0], table[1:]
    for name in columns:
        end = header.index(name) + len(name)
        for row in rows:
            assert row[end - 1] != " " and row[end:end + 1] in ("", " "), (name, table)


def bodies(stdout: str) -> list[str]:
    """Bodies of plain ``consume`` output (queue, offset, tag, body per line)."""
    return [line.split("\t", 3)[3] for line in stdout.splitlines()]


# -- topics ------------------------------------------------------------------------------------


def test_topic_create_list_describe_delete(broker: Broker) -> None:
    addr = broker.address
    out = ok(addr, "topic", "create", "cli-topics", "--queues", "3",
             "--config", "retention_ms=3600000")
    assert "cli-topics" in out

    assert "cli-topics" in ok(addr, "topic", "list")
    listed = json.loads(ok(addr, "--json", "topic", "list"))
    mine = [t for t in listed["topics"] if t["name"] == "cli-topics"]
    assert [t["queues"] for t in mine] == [3]

    ok(addr, "produce", "cli-topics", "a", "b", "c", "d")
    ok(addr, "produce", "cli-topics", "e", "--sharding-key", "k")  # a keyed one: its own queue
    plain = ok(addr, "topic", "describe", "cli-topics")
    assert "retention_ms=3600000" in plain
    assert all(word in plain for word in ("FIRST", "LAST", "END", "BYTES", "SEGMENTS"))
    table = plain.splitlines()[1:]
    assert any(row.split()[2] == "-" for row in table[1:]), plain  # an empty queue
    assert_right_aligned(table, ("QUEUE", "FIRST", "LAST", "END", "BYTES", "SEGMENTS"))
    desc = json.loads(ok(addr, "--json", "topic", "describe", "cli-topics"))
    assert [q["queue"] for q in desc["queues"]] == [0, 1, 2]
    assert sum(q["end_offset"] - q["first_offset"] for q in desc["queues"]) == 5
    for q in desc["queues"]:
        if q["end_offset"] > q["first_offset"]:
            assert q["last_offset"] == q["end_offset"] - 1
            assert q["bytes"] > 0 and q["segments"] >= 1 and q["last_append_ms"] > 0
        else:
            assert q["last_offset"] is None

    # no terminal and no --yes: refuse (usage error), topic still there
    res = ferrymq(addr, "topic", "delete", "cli-topics")
    assert res.returncode == 2
    assert "--yes" in res.stderr
    assert "cli-topics" in ok(addr, "topic", "list")

    assert "deleted" in ok(addr, "topic", "delete", "cli-topics", "--yes")
    assert "cli-topics" not in ok(addr, "topic", "list")


# -- produce / consume -----------------------------------------------------------------------


def test_produce_args_and_stdin_then_consume_from_earliest(broker: Broker) -> None:
    addr = broker.address
    ok(addr, "topic", "create", "cli-pc", "--queues", "2")
    out = ok(addr, "produce", "cli-pc", "first", "second", "--tag", "TagA", "--key", "k1",
             "--property", "color=blue")
    assert len(out.splitlines()) == 2
    assert all("queue=" in line and "offset=" in line for line in out.splitlines())

    lines = [f"line {i} ünïcode" for i in range(1, 2501)]
    out = ok(addr, "produce", "cli-pc", stdin="\n".join(lines) + "\n")
    assert len(out.splitlines()) == 2500

    out = ok(addr, "consume", "cli-pc", "--group", "g-pc", "--from", "earliest",
             "--count", "2502", "--timeout", "10")
    got = bodies(out)
    assert sorted(got) == sorted(["first", "second", *lines])
    tagged = [line.split("\t") for line in out.splitlines() if line.endswith(("first",
                                                                             "second"))]
    assert {t[2] for t in tagged} == {"TagA"}

    # a tag filter selects on the broker
    out = ok(addr, "consume", "cli-pc", "--group", "g-pc-tags", "--tags", "TagA",
             "--from", "earliest", "--count", "2", "--timeout", "5")
    assert sorted(bodies(out)) == ["first", "second"]


def test_json_output_and_group_describe_lag_zero(broker: Broker) -> None:
    addr = broker.address
    ok(addr, "topic", "create", "cli-json", "--queues", "2")
    produced = [json.loads(line) for line in ok(
        addr, "--json", "produce", "cli-json", "--key", "a", "--key", "b", "--sharding-key",
        "s1", "--property", "p=1", "x", "y\nz").splitlines()]
    assert [p["topic"] for p in produced] == ["cli-json", "cli-json"]
    assert len({p["queue"] for p in produced}) == 1  # one sharding key: one queue
    assert [p["offset"] for p in produced] == [0, 1]

    out = ok(addr, "--json", "consume", "cli-json", "-g", "g-json", "--from", "earliest",
             "--count", "2")
    msgs = [json.loads(line) for line in out.splitlines()]
    assert [m["body"] for m in msgs] == ["x", "y\nz"]
    assert msgs[0]["keys"] == ["a", "b"]
    assert msgs[0]["properties"] == {"p": "1"}
    assert msgs[0]["sharding_key"] == "s1"
    assert msgs[0]["msg_id"] == produced[0]["msg_id"]

    group = json.loads(ok(addr, "--json", "group", "describe", "g-json"))
    assert group["group"] == "g-json"
    assert {o["topic"] for o in group["offsets"]} == {"cli-json"}
    assert all(o["lag"] == 0 for o in group["offsets"])
    assert sum(o["committed"] or 0 for o in group["offsets"]) == 2

    plain = ok(addr, "group", "describe", "g-json")
    assert "LAG" in plain and "cli-json" in plain
    groups = json.loads(ok(addr, "--json", "group", "list"))["groups"]
    assert "g-json" in {g["group"] for g in groups}
    assert "g-json" in ok(addr, "group", "list")

    # a group continues from its committed offsets: nothing new
    assert ok(addr, "consume", "cli-json", "-g", "g-json", "--timeout", "0.5") == ""


def test_reset_offset_to_earliest_replays(broker: Broker) -> None:
    addr = broker.address
    ok(addr, "topic", "create", "cli-replay", "--queues", "2")
    sent = [f"m{i}" for i in range(10)]
    # five messages per queue: sharding key "a" goes to queue 0 of 2, "c" to queue 1
    ok(addr, "produce", "cli-replay", "--sharding-key", "a", *sent[:5])
    ok(addr, "produce", "cli-replay", "--sharding-key", "c", *sent[5:])
    first = bodies(ok(addr, "consume", "cli-replay", "-g", "g-replay", "--from", "earliest",
                      "--count", "10"))
    assert sorted(first) == sorted(sent)
    assert ok(addr, "consume", "cli-replay", "-g", "g-replay", "--timeout", "0.3") == ""

    out = ok(addr, "group", "reset-offset", "g-replay", "--topic", "cli-replay",
             "--to", "earliest")
    assert "OFFSET" in out
    replay = bodies(ok(addr, "consume", "cli-replay", "-g", "g-replay", "--count", "10"))
    assert sorted(replay) == sorted(sent)

    reset = json.loads(ok(addr, "--json", "group", "reset-offset", "g-replay", "--topic",
                          "cli-replay", "--to", "3"))
    assert [(o["queue"], o["offset"]) for o in reset["offsets"]] == [(0, 3), (1, 3)]
    assert len(bodies(ok(addr, "consume", "cli-replay", "-g", "g-replay", "--count", "4"))) == 4

    reset = json.loads(ok(addr, "--json", "group", "reset-offset", "g-replay", "--topic",
                          "cli-replay", "--to", "2000-01-01T00:00:00Z"))
    assert [o["offset"] for o in reset["offsets"]] == [0, 0]
    reset = json.loads(ok(addr, "--json", "group", "reset-offset", "g-replay", "--topic",
                          "cli-replay", "--to", "latest"))
    assert [o["offset"] for o in reset["offsets"]] == [5, 5]


def test_consume_from_time_and_latest(broker: Broker) -> None:
    addr = broker.address
    ok(addr, "topic", "create", "cli-time", "--queues", "1")
    ok(addr, "produce", "cli-time", "old")
    time.sleep(0.05)
    cut = time.time()
    time.sleep(0.05)
    ok(addr, "produce", "cli-time", "new")
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(cut)) + f".{int(cut * 1000) % 1000:03d}Z"
    out = ok(addr, "consume", "cli-time", "-g", "g-time", "--from", iso, "--count", "1",
             "--timeout", "5")
    assert bodies(out) == ["new"]
    assert ok(addr, "consume", "cli-time", "-g", "g-time2", "--from", "latest",
              "--timeout", "0.3") == ""


def test_ctrl_c_stops_consume_with_exit_0_and_commits(broker: Broker) -> None:
    addr = broker.address
    ok(addr, "topic", "create", "cli-sigint", "--queues", "1")
    proc = subprocess.Popen([*CLI, "--server", addr, "consume", "cli-sigint", "-g", "g-int",
                             "--from", "earliest"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ok(addr, "produce", "cli-sigint", "one", "two")
        assert proc.stdout is not None
        seen = [proc.stdout.readline(), proc.stdout.readline()]
        assert [line.rstrip("\n").split("\t")[3] for line in seen] == ["one", "two"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    group = json.loads(ok(addr, "--json", "group", "describe", "g-int"))
    assert [(o["committed"], o["lag"]) for o in group["offsets"]] == [(2, 0)]


# -- errors ------------------------------------------------------------------------------------


def test_unknown_topic_is_one_error_line(broker: Broker) -> None:
    res = ferrymq(broker.address, "topic", "describe", "no-such-topic")
    assert_one_error_line(res)
    assert "no-such-topic" in res.stderr

    res = ferrymq(broker.address, "--debug", "topic", "describe", "no-such-topic")
    assert res.returncode == 1
    assert "Traceback" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: ")


def test_no_broker_is_one_error_line() -> None:
    res = ferrymq(f"127.0.0.1:{free_port()}", "--connect-timeout", "0.5", "topic", "list")
    assert_one_error_line(res)


# -- the broker command --------------------------------------------------------------------------


def test_broker_command_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    addr = f"127.0.0.1:{port}"
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRYMQ_")}
    proc = subprocess.Popen([*CLI, "broker", "--port", str(port), "--data-dir", str(data),
                             "--flush", "async", "--log-level", "info", "--http-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        res = ferrymq(addr, "--connect-timeout", "10", "topic", "list")
        assert res.returncode == 0, (res.stderr, proc.poll())
        assert "TOPIC" in res.stdout

        # a second broker on the same data dir: refused with one line, exit 1
        second = subprocess.run([*CLI, "broker", "--port", str(free_port()), "--data-dir",
                                 str(data)], capture_output=True, text=True, timeout=30,
                                env=env)
        assert_one_error_line(second)
        assert "in use" in second.stderr
        # ... also on the same port: the data dir is named, not the port
        second = subprocess.run([*CLI, "broker", "--port", str(port), "--data-dir", str(data)],
                                capture_output=True, text=True, timeout=30, env=env)
        assert_one_error_line(second)
        assert f"data dir {data} is in use by another broker" in second.stderr

        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert (data / ".clean_shutdown").exists()


def test_broker_start_log_names_the_version_and_the_absolute_data_dir(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRYMQ_")}
    proc = subprocess.Popen([*CLI, "broker", "--port", str(port), "--data-dir", "rel-data",
                             "--http-port", "0"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        while not any("listening on" in line for line in lines):
            line = proc.stderr.readline()
            assert line, (lines, proc.poll())
            lines.append(line)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    started = lines[-1]
    assert f"FerryMQ {__version__} broker listening on 127.0.0.1:{port}" in started, started
    assert f"(data {(tmp_path / 'rel-data').resolve()}, flush sync)" in started, started


def test_broker_debug_log_shows_connections_handshakes_and_disconnects(tmp_path: Path) -> None:
    bp = BrokerProcess(tmp_path / "data", extra=["--log-level", "DEBUG"])
    with bp:
        with AdminClient(bp.address) as admin:
            admin.list_topics()
        with socket.create_connection(("127.0.0.1", bp.port)) as raw:
            raw.sendall(b"\x00\x00\x00\x01" + b"\x00" * 8)  # a frame shorter than a header
            raw.settimeout(5)
            while raw.recv(4096):
                pass
        wait_for(lambda: bp.log_text().count("DEBUG ferrymq.broker: connection 127.0.0.1:")
                 >= 3 and "closed (client ''" in bp.log_text())
        log = bp.log_text()
    debug = [line.split("DEBUG ferrymq.broker: ", 1)[1] for line in log.splitlines()
             if "DEBUG ferrymq.broker: " in line]
    peers = [line.split()[2] for line in debug if line.startswith("connection from ")]
    assert len(peers) == 2, debug
    admin_peer, raw_peer = peers
    assert f"connection {admin_peer}: hello from client 'ferrymq-admin', FerryMQ {__version__} " \
           "(authentication off: no user)" in debug
    assert f"connection {admin_peer} closed (client 'ferrymq-admin', user -): closed by the " \
           "client" in debug
    closed_raw = [line for line in debug if line.startswith(f"connection {raw_peer} closed")]
    assert len(closed_raw) == 1 and "frame" in closed_raw[0], debug


def test_broker_on_a_port_in_use_fails_in_one_line_and_creates_nothing(tmp_path: Path) -> None:
    data = tmp_path / "never" / "data"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run([*CLI, "broker", "--port", str(port), "--data-dir", str(data)],
                             capture_output=True, text=True, timeout=30)
    assert_one_error_line(res)
    assert res.stderr == (f"error: cannot listen on 127.0.0.1:{port}: address already in use "
                          "(another broker or program listens on it)\n")
    assert not (tmp_path / "never").exists()


def test_broker_bad_config_file_is_one_error_line(tmp_path: Path) -> None:
    conf = tmp_path / "broker.toml"
    conf.write_text('flush = "sometimes"\n')
    res = subprocess.run([*CLI, "broker", "--config", str(conf), "--data-dir",
                          str(tmp_path / "d")], capture_output=True, text=True, timeout=30)
    assert_one_error_line(res)
    assert "flush" in res.stderr


# -- argument parsing only (no broker) -------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["topic", "create", "t"],  # --queues is required
        ["topic", "create", "t", "--queues", "0"],
        ["topic", "create", "t", "--queues", "1", "--config", "novalue"],
        ["produce", "t", "body", "--property", "novalue"],
        ["consume", "t"],  # --group is required
        ["consume", "t", "-g", "g", "--from", "yesterday"],
        ["consume", "t", "-g", "g", "--from", "5"],  # offsets only for reset-offset
        ["consume", "t", "-g", "g", "--count", "0"],
        ["group", "reset-offset", "g", "--topic", "t", "--to", "bogus"],
        ["group", "reset-offset", "g", "--to", "earliest"],  # --topic is required
        ["topic", "delete", "t"],  # no --yes and stdin is not a terminal
        ["broker", "--flush", "sometimes"],
        ["nosuchcommand"],
    ],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    res = CliRunner().invoke(cli, ["--server", "127.0.0.1:1", *args])
    assert res.exit_code == 2, res.output


def test_position_parsing() -> None:
    with_offset = PositionType(allow_offset=True)
    assert with_offset.convert("earliest", None, None) == Position("earliest")
    assert with_offset.convert("latest", None, None) == Position("latest")
    assert with_offset.convert("42", None, None) == Position("offset", 42)
    assert with_offset.convert("2024-05-01T00:00:00Z", None, None) == Position(
        "time", 1714521600000)
    assert PositionType(allow_offset=False).convert("2024-05-01T02:00:00+02:00", None,
                                                    None) == Position("time", 1714521600000)
    assert parse_time_ms("2024-05-01T00:00:00.250+00:00") == 1714521600250


def test_help_lists_every_command() -> None:
    res = CliRunner().invoke(cli, ["--help"])
    assert res.exit_code == 0
    for name in ("broker", "topic", "produce", "consume", "group", "bench"):
        assert name in res.output
