"""Orderly delivery groups: one message per sharding key at a time, in send order; a failing
message is retried in place and blocks only its own key."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq import AdminClient, Broker, Message, Producer, SimpleConsumer
from ferrymq.client.simple import LeasedMessage
from ferrymq.errors import InvalidRequestError
from ferrymq.protocol.records import encode_msg_id

pytestmark = pytest.mark.integration


@pytest.fixture
def fast_broker(tmp_path: Path) -> Iterator[Broker]:
    """A broker whose orderly retries come back after 100 ms."""
    b = Broker(tmp_path / "data", port=0, orderly_retry_ms=100).start()
    try:
        yield b
    finally:
        b.stop()


def produce_keys(addr: str, topic: str, keys: list[str], per_key: int, queues: int = 1) -> None:
    with AdminClient(addr) as admin:
        admin.create_topic(topic, queues)
    with Producer(addr) as p:
        for i in range(per_key):
            p.send_batch([Message(topic, f"{k}:{i}", sharding_key=k) for k in keys])


def seq(msg: LeasedMessage) -> tuple[str, int]:
    k, i = msg.body.decode().split(":")
    return k, int(i)


def receive(c: SimpleConsumer, n: int = 100, wait: float = 0.5) -> list[LeasedMessage]:
    return c.receive(n, wait=wait)


def test_one_message_per_key_at_a_time_in_send_order(fast_broker: Broker) -> None:
    addr = fast_broker.address
    produce_keys(addr, "o1", ["a", "b", "c"], 4)
    with SimpleConsumer(addr, "g", orderly=True, invisible_duration=30) as c:
        c.subscribe("o1")
        first = receive(c)
        assert sorted(seq(m) for m in first) == [("a", 0), ("b", 0), ("c", 0)]
        assert receive(c, wait=0.2) == []  # every key is busy
        by_key = {seq(m)[0]: m for m in first}
        c.ack(by_key["a"])
        a1 = receive(c)
        assert [seq(m) for m in a1] == [("a", 1)]  # only a moved on
        seen = [seq(m) for m in first + a1]
        c.ack_batch([m for m in first if seq(m)[0] != "a"] + a1)
        deadline = time.monotonic() + 10
        while len(seen) < 12 and time.monotonic() < deadline:
            got = receive(c, wait=0.3)
            keys = [seq(m)[0] for m in got]
            assert len(keys) == len(set(keys)), f"two messages of one key at once: {keys}"
            seen.extend(seq(m) for m in got)
            c.ack_batch(got)
        for k in "abc":
            assert [i for kk, i in seen if kk == k] == [0, 1, 2, 3]


def test_failing_key_retried_in_place_blocks_only_itself(fast_broker: Broker) -> None:
    addr = fast_broker.address
    produce_keys(addr, "o2", ["bad", "k1", "k2"], 3)
    with SimpleConsumer(addr, "g", orderly=True, max_reconsume=2) as c, \
            AdminClient(addr) as admin:
        c.subscribe("o2")
        good: list[tuple[str, int]] = []
        bad: list[tuple[tuple[str, int], int, float]] = []  # (seq, reconsume, time)
        deadline = time.monotonic() + 15
        while len(good) < 8 and time.monotonic() < deadline:
            for msg in receive(c, wait=0.2):
                if seq(msg)[0] == "bad" and seq(msg)[1] == 0:
                    bad.append((seq(msg), msg.reconsume_times, time.monotonic()))
                    c.nack(msg, reason="poison")
                else:
                    good.append(seq(msg))
                    c.ack(msg)
                    if seq(msg)[0] == "bad":
                        bad.append((seq(msg), msg.reconsume_times, time.monotonic()))
        # the other keys flowed while "bad" was failing
        assert sorted(k for k in good if k[0] != "bad") == [
            ("k1", 0), ("k1", 1), ("k1", 2), ("k2", 0), ("k2", 1), ("k2", 2)]
        # bad:0 was delivered 3 times in place (max_reconsume 2), then dead-lettered, then
        # bad:1 and bad:2 followed in order
        attempts = [(s, r) for s, r, _ in bad]
        assert attempts[:3] == [(("bad", 0), 0), (("bad", 0), 1), (("bad", 0), 2)]
        times = [t for _, _, t in bad[:3]]
        assert all(b - a >= 0.09 for a, b in itertools.pairwise(times))  # backoff
        assert [k for k in good if k[0] == "bad"] == [("bad", 1), ("bad", 2)]
        dead = admin.dlq_list("g")
        assert [d.body for d in dead] == [b"bad:0"]
        assert "poison" in dead[0].reason


def test_describe_shows_blocked_keys_and_skip_moves_on(fast_broker: Broker) -> None:
    addr = fast_broker.address
    produce_keys(addr, "o3", ["stuck", "fine"], 2)
    with SimpleConsumer(addr, "g", orderly=True, max_reconsume=100) as c, \
            AdminClient(addr) as admin:
        c.subscribe("o3")
        msgs = {seq(m): m for m in receive(c)}
        t0 = time.time() * 1000
        c.nack(msgs[("stuck", 0)], delay=60, reason="db down")
        c.ack(msgs[("fine", 0)])
        d = admin.describe_delivery("g")
        assert d.orderly
        ((topic, queue, key, msg_id, attempts, since, next_at, reason),) = d.blocked
        assert (topic, queue, key, msg_id, attempts, reason) == (
            "o3", 0, "stuck", msgs[("stuck", 0)].msg_id, 1, "db down")
        assert t0 - 1000 <= since <= t0 + 1000
        assert t0 + 50_000 < next_at < t0 + 70_000
        st = admin.message_status(msgs[("stuck", 0)].msg_id)
        assert [(s[0], s[1], s[4], s[6]) for s in st.statuses] == [("g", "RETRYING", 1, "db down")]
        assert [seq(m) for m in receive(c)] == [("fine", 1)]  # stuck:1 waits behind stuck:0
        with pytest.raises(InvalidRequestError, match="behind"):
            admin.skip_message("g", _id_of(addr, "o3", 2))  # stuck:1
        admin.skip_message("g", msgs[("stuck", 0)].msg_id)
        got = receive(c)
        assert [seq(m) for m in got] == [("stuck", 1)]
        assert admin.describe_delivery("g").blocked == []
        dead = admin.dlq_list("g")
        assert [d.body for d in dead] == [b"stuck:0"]
        assert "skipped on purpose" in dead[0].reason and "db down" in dead[0].reason
        with pytest.raises(InvalidRequestError, match="not pending"):
            admin.skip_message("g", msgs[("stuck", 0)].msg_id)


def _id_of(addr: str, topic: str, offset: int) -> str:
    """The message id of ``topic``/0 at ``offset``."""
    with AdminClient(addr) as admin:
        tid = next(t[1] for t in admin.list_topics() if t[0] == topic)
    return encode_msg_id(tid, 0, offset)


def test_unkeyed_messages_flow_freely_and_mode_is_fixed(fast_broker: Broker) -> None:
    addr = fast_broker.address
    with AdminClient(addr) as admin:
        admin.create_topic("o4", 1)
    with Producer(addr) as p:
        p.send_batch([Message("o4", f"x{i}") for i in range(5)])
    with SimpleConsumer(addr, "g", orderly=True) as c:
        c.subscribe("o4")
        assert [m.body for m in receive(c)] == [b"x0", b"x1", b"x2", b"x3", b"x4"]
    with pytest.raises(InvalidRequestError, match="orderly"):
        join(addr, "g", orderly=False)
    join(addr, "g2", orderly=False)
    with pytest.raises(InvalidRequestError, match="not orderly"):
        join(addr, "g2", orderly=True)


def join(addr: str, group: str, *, orderly: bool) -> None:
    with SimpleConsumer(addr, group, orderly=orderly) as c:
        c.subscribe("o4")
        c.receive(1, wait=0)


def test_cli_group_describe_and_skip(fast_broker: Broker) -> None:
    from click.testing import CliRunner

    from ferrymq.admin.cli import cli

    addr = fast_broker.address

    def run(*args: str) -> tuple[int, str, str]:
        res = CliRunner().invoke(cli, ["--server", addr, *args])
        return res.exit_code, res.stdout, res.stderr

    produce_keys(addr, "o5", ["slow", "quick"], 2)
    with SimpleConsumer(addr, "cg", orderly=True, max_reconsume=50) as c:
        c.subscribe("o5")
        msgs = {seq(m): m for m in receive(c)}
        c.nack(msgs[("slow", 0)], delay=60, reason="upstream 503")
        code, out, _ = run("group", "describe", "cg")
        assert code == 0
        assert "orderly" in out
        row = next(line for line in out.splitlines() if "upstream 503" in line)
        assert "slow" in row and msgs[("slow", 0)].msg_id in row
        code, out, _ = run("--json", "group", "describe", "cg")
        d = json.loads(out)
        assert d["orderly"] is True
        (blocked,) = d["blocked_keys"]
        assert (blocked["key"], blocked["attempts"]) == ("slow", 1)
        code, out, _ = run("group", "skip", "cg", msgs[("slow", 0)].msg_id)
        assert code == 0 and "%DLQ%cg" in out
        code, _, err = run("group", "skip", "cg", msgs[("slow", 0)].msg_id)
        assert code == 1 and "not pending" in err
        assert ("slow", 1) in [seq(m) for m in receive(c)]
