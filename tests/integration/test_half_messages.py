"""Half messages (RocketMQ's transactional messages) against a real broker: commit, rollback,
check-back, status, delay, ordering and bad input (RELIABILITY.md T16 1-2)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from ferrymq import (
    AdminClient,
    Broker,
    HalfMessageProducer,
    HalfState,
    Message,
    ReceivedMessage,
)
from ferrymq.client.half_messages import half_id
from ferrymq.errors import (
    BusyError,
    HalfMessageResolvedError,
    InvalidRequestError,
    UnknownHalfMessageError,
)
from tests.helpers import read_topic, wait_for

COMMIT, ROLLBACK, UNKNOWN = HalfState.COMMIT, HalfState.ROLLBACK, HalfState.UNKNOWN


def never(_msg: ReceivedMessage) -> HalfState:
    raise AssertionError("no check expected")


def test_commit_visible_only_after_commit(broker: Broker) -> None:
    with AdminClient(broker.address) as a:
        a.create_topic("orders", 2)
    with HalfMessageProducer(broker.address, "pg", never) as p:
        msg = Message("orders", b"o-1", tags="created", keys=["o-1"], sharding_key="cust-7",
                      properties={"k": "v"})
        with p.half_message(msg) as tx:
            assert read_topic(broker.address, "orders", quiet=0.3) == []
            st = AdminClient(broker.address).message_status(tx.half_id)
            assert st.statuses[0][1] == "PREPARED"
        assert tx.result is not None and tx.result.committed
        got = read_topic(broker.address, "orders")
        assert [g.body for g in got] == [b"o-1"]
        g = got[0]
        assert (g.tags, g.keys, g.sharding_key) == ("created", ("o-1",), "cust-7")
        assert g.properties["k"] == "v"
        assert half_id(g) == tx.half_id
        assert g.msg_id == tx.result.msg_id
        with AdminClient(broker.address) as a:
            st = a.message_status(tx.half_id)
        assert (st.topic, st.queue, st.offset) == ("orders", g.queue, g.offset)
        assert st.statuses[0][:2] == ("pg", "COMMITTED")
        # the same outcome again answers the first result; the other one is refused
        again = p.commit(tx.half_id)
        assert again.msg_id == tx.result.msg_id
        with pytest.raises(HalfMessageResolvedError):
            p.rollback(tx.half_id)
    assert len(read_topic(broker.address, "orders")) == 1


def test_deprecated_transaction_names_still_work(broker: Broker) -> None:
    """Code written against the names before issue 19 (``producer.transaction(msg)``,
    ``tx.txn_id``, ``result.txn_id``) still commits, with a DeprecationWarning each."""
    with HalfMessageProducer(broker.address, "pg", never) as p:
        with pytest.warns(DeprecationWarning, match=r"transaction\(\) is deprecated"):
            ctx = p.transaction(Message("old", b"x"))
        with ctx as tx:
            with pytest.warns(DeprecationWarning, match="txn_id is deprecated"):
                assert tx.txn_id == tx.half_id != ""
        assert tx.result is not None and tx.result.committed
        with pytest.warns(DeprecationWarning, match="txn_id is deprecated"):
            assert tx.result.txn_id == tx.half_id
    assert [m.body for m in read_topic(broker.address, "old")] == [b"x"]


def test_rollback_never_visible(broker: Broker) -> None:
    with HalfMessageProducer(broker.address, "pg", never) as p:
        with pytest.raises(RuntimeError), p.half_message(Message("t", b"x")) as tx:
            raise RuntimeError("local transaction failed")
        assert tx.result is not None and tx.result.state == "ROLLED_BACK"
        r = p.send_in_transaction(Message("t", b"y"), lambda _m: ROLLBACK)
        assert r.state == "ROLLED_BACK" and r.send_result is None
        with pytest.raises(HalfMessageResolvedError):
            p.commit(r.half_id)
    assert read_topic(broker.address, "t") == []
    with AdminClient(broker.address) as a:
        st = a.message_status(tx.half_id)
    assert st.statuses[0][1] == "ROLLED_BACK"
    assert "RuntimeError" in st.statuses[0][6]


def test_unknown_then_check_back_commits(broker: Broker) -> None:
    asked: list[str] = []

    def checker(msg: ReceivedMessage) -> HalfState:
        asked.append(msg.properties["%TXN_ID"])
        assert msg.body == b"pay" and msg.topic == "pay"
        return COMMIT

    with HalfMessageProducer(broker.address, "pg", checker, check_after=0.3,
                             check_interval=0.3, poll_wait_s=0.5) as p:
        r = p.send_in_transaction(Message("pay", b"pay"), lambda _m: UNKNOWN)
        assert r.state == "PREPARED"
        assert read_topic(broker.address, "pay", quiet=0.1) == []
        wait_for(lambda: len(read_topic(broker.address, "pay", quiet=0.1)) == 1, timeout=10)
    assert asked == [r.half_id]
    with AdminClient(broker.address) as a:
        st = a.message_status(r.half_id)
    assert st.statuses[0][1] == "COMMITTED" and "check" in st.statuses[0][6]


def test_max_checks_rolls_back_and_says_why(tmp_path: Path) -> None:
    with Broker(tmp_path / "d", half_check_after_ms=200, half_check_interval_ms=200,
                half_max_checks=2) as b:
        n = [0]

        def checker(_m: ReceivedMessage) -> HalfState:
            n[0] += 1
            return UNKNOWN

        with HalfMessageProducer(b.address, "pg", checker, check_after=0.2, check_interval=0.2,
                                 max_checks=2, poll_wait_s=0.3) as p:
            txn = p.prepare(Message("t", b"x"))

            def rolled_back() -> bool:
                with AdminClient(b.address) as a:
                    return a.message_status(txn).statuses[0][1] == "ROLLED_BACK"

            wait_for(rolled_back, timeout=10)
        assert n[0] == 2
        with AdminClient(b.address) as a:
            reason = a.message_status(txn).statuses[0][6]
        assert "max_checks" in reason and "2 check-backs" in reason and "UNKNOWN" in reason
        assert read_topic(b.address, "t", quiet=0.2) == []


def test_delayed_half_message(broker: Broker) -> None:
    with HalfMessageProducer(broker.address, "pg", never) as p:
        r = p.send_in_transaction(Message("d", b"later", delay=1.0), lambda _m: COMMIT)
        t0 = time.monotonic()
        assert r.committed
        assert read_topic(broker.address, "d", quiet=0.2) == []
        wait_for(lambda: len(read_topic(broker.address, "d", quiet=0.1)) == 1, timeout=10)
        assert time.monotonic() - t0 >= 0.7


def test_sharding_key_order_of_committed_messages(broker: Broker) -> None:
    with AdminClient(broker.address) as a:
        a.create_topic("seq", 4)
    with HalfMessageProducer(broker.address, "pg", never) as p:
        for i in range(20):
            key = f"k{i % 3}"
            state = ROLLBACK if i % 5 == 4 else COMMIT
            p.send_in_transaction(Message("seq", f"{key}:{i}".encode(), sharding_key=key),
                                  lambda _m, s=state: s)
    got = read_topic(broker.address, "seq")
    assert len(got) == 16
    for k in ("k0", "k1", "k2"):
        mine = [g for g in got if g.sharding_key == k]
        assert len({g.queue for g in mine}) == 1
        nums = [int(g.body.split(b":")[1]) for g in sorted(mine, key=lambda g: g.offset)]
        assert nums == sorted(nums)


def test_bad_input(tmp_path: Path) -> None:
    with Broker(tmp_path / "d", half_max_pending=2) as b:
        with HalfMessageProducer(b.address, "pg", never) as p, \
                HalfMessageProducer(b.address, "other", never) as q:
            t1 = p.prepare(Message("t", b"1"))
            with pytest.raises(UnknownHalfMessageError):
                q.commit(t1)  # another group's transaction
            with pytest.raises(UnknownHalfMessageError):
                p.commit("0000000100000000000000000005")  # not a half message id
            with pytest.raises(InvalidRequestError):
                p.commit("nope")
            p.prepare(Message("t", b"2"))
            with pytest.raises(BusyError):
                p.prepare(Message("t", b"3"))
            p.rollback(t1)
            p.prepare(Message("t", b"3"))  # room again
        beyond = f"{t1[:8]}0000{'0' * 15}9"  # a half-topic id with no half message
        with AdminClient(b.address) as a, pytest.raises(UnknownHalfMessageError):
            a.message_status(beyond)


def test_cli_message_status_of_a_half_message(broker: Broker) -> None:
    from click.testing import CliRunner

    from ferrymq.admin.cli import cli

    def run(*args: str) -> str:
        res = CliRunner().invoke(cli, ["--server", broker.address, *args])
        assert res.exit_code == 0, res.output
        return res.output

    with HalfMessageProducer(broker.address, "pg", never, check_after=60) as p:
        half = p.prepare(Message("t", b"x"))
        out = run("message", "status", half)
        assert "PREPARED" in out and "0 of 15 check-backs" in out and "next check-back" in out
        assert re.fullmatch(rf"message {half}: half message for t/\d+ \(not in the queue\)",
                            out.splitlines()[0]), out
        p.rollback(half, "customer cancelled")
        out = run("message", "status", half)
        assert "ROLLED_BACK" in out and "customer cancelled" in out
        assert re.fullmatch(rf"message {half}: half message for t/\d+ \(not in the queue\)",
                            out.splitlines()[0]), out
        doc = json.loads(run("message", "status", half, "--json"))
        assert doc["groups"][0]["state"] == "ROLLED_BACK"
        assert (doc["topic"], doc["offset"]) == ("t", None)
        committed = p.prepare(Message("t", b"y"))
        p.commit(committed)
        out = run("message", "status", committed)
        assert re.fullmatch(rf"message {committed}: t/\d+ offset \d+", out.splitlines()[0])
        assert json.loads(run("message", "status", committed, "--json"))["offset"] >= 0
