"""kafkajs (a pure-JavaScript Kafka client from the npm registry, ``make kafkajs``) against a real
in-process FerryMQ broker's Kafka port: produce with keys and headers, consumer groups of the
classic protocol and their rebalances, the admin client, an idempotent producer whose answer is
lost, transactions with the group's offsets, gzip, SASL SCRAM. The client runs as
``node tests/kafka/node/kafkajs_client.js '<json>'``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ferrymq import Broker, Message, Producer
from tests.helpers import free_port, read_topic
from tests.kafka.conftest import ProduceAnswerDropper, assert_one_batch_per_sequence, kafka_address
from tests.security_helpers import make_user, write_users

NODE_DIR = Path(__file__).parent / "node"
NODE = shutil.which("node")
HAVE_KAFKAJS = (NODE_DIR / "node_modules" / "kafkajs" / "package.json").exists()

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(NODE is None or not HAVE_KAFKAJS,
                                 reason="needs node and kafkajs (make kafkajs)")]


def run_kafkajs(address: str, cmd: str, **args: Any) -> subprocess.CompletedProcess[str]:
    """Run one command of ``kafkajs_client.js`` against ``address``."""
    assert NODE is not None
    env = {**os.environ, "KAFKAJS_NO_PARTITIONER_WARNING": "1"}
    return subprocess.run([NODE, str(NODE_DIR / "kafkajs_client.js"),
                           json.dumps({"cmd": cmd, "brokers": [address], **args})],
                          capture_output=True, text=True, timeout=60, env=env)


def kafkajs(address: str, cmd: str, **args: Any) -> dict[str, Any]:
    """Run one command of ``kafkajs_client.js`` against ``address``; its JSON result."""
    res = run_kafkajs(address, cmd, **args)
    assert res.returncode == 0, res.stderr
    result: dict[str, Any] = json.loads(res.stdout)
    return result


def test_kafkajs_produces_with_keys_and_headers_and_a_group_consumes(kbroker: Broker) -> None:
    address = kafka_address(kbroker)
    kbroker.server.topics.create("orders", 2, {}, 0)
    sent = [{"key": f"cust-{i}", "value": f"order {i}", "partition": i % 2,
             "headers": {"source": "web", "ferrymq.tag": "created",
                         "ferrymq.key": [f"o-{i}", "batch-1"]}} for i in range(6)]
    out = kafkajs(address, "produce", topic="orders", messages=sent)
    assert out["records"] == [{"partition": i % 2, "baseOffset": i // 2} for i in range(6)]
    # stored as FerryMQ messages: keys are sharding keys, the documented headers tags and keys
    native = sorted(read_topic(kbroker.address, "orders", 6), key=lambda m: (m.queue, m.offset))
    assert [(m.queue, m.offset, m.body, m.sharding_key) for m in native] == [
        (q, o, f"order {2 * o + q}".encode(), f"cust-{2 * o + q}")
        for q in (0, 1) for o in range(3)]
    assert {(m.tags, m.keys[1], m.properties["source"]) for m in native} == {
        ("created", "batch-1", "web")}
    # a kafkajs consumer group (JoinGroup, SyncGroup, Heartbeat, OffsetCommit, LeaveGroup)
    got = kafkajs(address, "consume", topic="orders", groupId="billing", count=6)
    assert got["assignment"] == {"orders": [0, 1]}
    by_offset = sorted(got["messages"], key=lambda m: (m["partition"], m["offset"]))
    assert [(m["partition"], m["offset"], m["key"], m["value"]) for m in by_offset] == [
        (q, o, f"cust-{2 * o + q}", f"order {2 * o + q}") for q in (0, 1) for o in range(3)]
    assert by_offset[0]["headers"] == {"source": "web", "ferrymq.tag": "created",
                                       "ferrymq.key": ["o-0", "batch-1"]}
    # its commits are the FerryMQ group's offsets
    assert kbroker.server.consumer_groups.committed("billing") == {("orders", 0): 3,
                                                                   ("orders", 1): 3}


def test_a_kafkajs_group_rebalances_when_a_member_joins_and_leaves(kbroker: Broker) -> None:
    """Two kafkajs members of one group: the second's join rebalances the first (its heartbeat
    is answered REBALANCE_IN_PROGRESS), they split the partitions; when the second leaves the
    first takes them all back and reads what is produced to them, committing it."""
    kbroker.server.topics.create("split", 4, {}, 0)
    out = kafkajs(kafka_address(kbroker), "rebalance", topic="split", partitions=4,
                  groupId="pair")
    alone, split, alone_again = out["phases"]
    assert alone == alone_again == {"a": [0, 1, 2, 3], "b": None}
    assert split["a"] and split["b"] and sorted(split["a"] + split["b"]) == [0, 1, 2, 3]
    assert sorted((m["partition"], m["value"]) for m in out["readByA"]) == [
        (q, f"after-{q}") for q in range(4)]
    assert kbroker.server.consumer_groups.committed("pair") == {("split", q): 1
                                                                for q in range(4)}


def test_ferrymq_message_read_by_a_kafkajs_group(kbroker: Broker) -> None:
    with Producer(kbroker.address) as p:
        r = p.send(Message("native", b"from ferrymq", tags="paid", keys=["o-2", "c-9"],
                           sharding_key="cust-1", properties={"source": "batch"}))
    got = kafkajs(kafka_address(kbroker), "consume", topic="native", groupId="js", count=1)
    [m] = got["messages"]
    assert (m["partition"], m["offset"], m["key"], m["value"]) == (
        r.queue, r.offset, "cust-1", "from ferrymq")
    assert m["headers"] == {"ferrymq.tag": "paid", "ferrymq.key": ["o-2", "c-9"],
                            "source": "batch"}
    assert kbroker.server.consumer_groups.committed("js") == {("native", r.queue): r.offset + 1}


def test_kafkajs_idempotent_producer_retry_is_stored_once(
        dropper_broker: tuple[Broker, ProduceAnswerDropper]) -> None:
    """kafkajs ``idempotent: true``: InitProducerId, sequenced batches; the first batch's answer
    is lost, kafkajs sends it again with the same sequence, and FerryMQ stores it once and
    answers with its first offset."""
    b, proxy = dropper_broker
    b.server.topics.create("idem", 1, {}, 0)
    out = kafkajs(f"127.0.0.1:{proxy.port}", "produce", idempotent=True, topic="idem",
                  messages=[{"key": "k", "value": f"m{i}", "partition": 0} for i in range(3)])
    assert proxy.dropped and proxy.produce_requests == 4  # three batches, one sent twice
    assert out["records"] == [{"partition": 0, "baseOffset": i} for i in range(3)]
    assert_one_batch_per_sequence(b, "idem", [b"m0", b"m1", b"m2"])


def test_kafkajs_transaction_commits_messages_and_group_offsets(kbroker: Broker) -> None:
    """A kafkajs transactional producer (InitProducerId, AddPartitionsToTxn, AddOffsetsToTxn,
    TxnOffsetCommit, EndTxn): a committed transaction with the group's offsets (sendOffsets),
    then an aborted and a committed one; FerryMQ readers and a kafkajs consumer see the
    committed messages only, the group the committed offsets."""
    address = kafka_address(kbroker)
    kbroker.server.topics.create("tx-out", 1, {}, 0)
    kbroker.server.topics.create("tx-in", 1, {}, 0)
    with Producer(kbroker.address) as p:  # what the transaction "read": offsets 0 and 1
        for v in (b"in-0", b"in-1"):
            p.send(Message("tx-in", v))
    kafkajs(address, "transaction", transactionalId="js-tx", topic="tx-out",
            messages=[{"key": "a", "value": v, "partition": 0} for v in ("c1", "c2")],
            groupId="rpw", offsets=[{"topic": "tx-in", "partition": 0, "offset": 2}])
    kafkajs(address, "transaction", transactionalId="js-tx", topic="tx-out", abort=True,
            messages=[{"key": "a", "value": "aborted", "partition": 0}])
    kafkajs(address, "transaction", transactionalId="js-tx", topic="tx-out",
            messages=[{"key": "a", "value": "c3", "partition": 0}])
    assert [m.body for m in read_topic(kbroker.address, "tx-out", 3)] == [b"c1", b"c2", b"c3"]
    assert kbroker.server.consumer_groups.committed("rpw") == {("tx-in", 0): 2}
    everything = read_topic(kbroker.address, "tx-out", 4, isolation="read_uncommitted")
    assert [m.body for m in everything] == [b"c1", b"c2", b"aborted", b"c3"]
    # a kafkajs consumer (read_committed by default) skips the aborted one too
    got = kafkajs(address, "consume", topic="tx-out", groupId="after", count=3)
    assert [m["value"] for m in got["messages"]] == ["c1", "c2", "c3"]


def test_kafkajs_admin_creates_describes_and_deletes(kbroker: Broker) -> None:
    """kafkajs's admin client: CreateTopics with a setting, Metadata, DescribeConfigs,
    ListOffsets, ListGroups, DescribeGroups, OffsetFetch, DeleteGroups, DeleteTopics."""
    address = kafka_address(kbroker)
    made = kafkajs(address, "admin", phase="create", topic="adm")
    assert made == {"created": True, "topics": ["adm"], "partitions": [0, 1, 2],
                    "configs": {"retention.ms": "3600000"}}
    topic = kbroker.server.topics.topics["adm"]
    assert (len(topic.queues), topic.config) == (3, {"retention_ms": "3600000"})
    kafkajs(address, "produce", topic="adm", messages=[
        {"key": "a", "value": "1", "partition": 0}, {"key": "b", "value": "2", "partition": 2}])
    kafkajs(address, "consume", topic="adm", groupId="adm-readers", count=2)
    seen = kafkajs(address, "admin", phase="inspect", topic="adm", groupId="adm-readers")
    assert seen["offsets"] == [{"partition": 0, "low": 0, "high": 1},
                               {"partition": 1, "low": 0, "high": 0},
                               {"partition": 2, "low": 0, "high": 1}]
    # "consumer" while the Kafka port keeps the empty group's record, then "" (offsets only)
    assert [g["groupId"] for g in seen["groups"]] == ["adm-readers"]
    assert seen["described"] == [{"groupId": "adm-readers", "state": "Empty", "members": 0}]
    assert seen["groupOffsets"] == [{"partition": 0, "offset": 1}, {"partition": 1, "offset": -1},
                                    {"partition": 2, "offset": 1}]
    assert seen["deletedGroups"] == [{"groupId": "adm-readers", "errorCode": 0}]
    assert seen["topicsAfter"] == []
    assert "adm" not in kbroker.server.topics.topics
    assert "adm-readers" not in kbroker.server.consumer_groups.groups


def test_kafkajs_gzip_batches(kbroker: Broker) -> None:
    """GZIP, the one codec kafkajs has built in (the others are plugins)."""
    values = [f"compressed {i} " * 40 for i in range(3)]
    out = kafkajs(kafka_address(kbroker), "produce", topic="gz", compression="gzip",
                  messages=[{"key": "k", "value": v, "partition": 0} for v in values])
    assert [r["baseOffset"] for r in out["records"]] == [0, 1, 2]
    assert [m.body for m in read_topic(kbroker.address, "gz", 3)] == [v.encode() for v in values]


def test_kafkajs_sasl_scram_sha_256_with_the_users_file(tmp_path: Path) -> None:
    """kafkajs's own SCRAM-SHA-256 against the users file: the right password produces and
    consumes in a group the user may use, a wrong one is refused, and the ACLs apply."""
    users = write_users(tmp_path / "users.json", make_user(
        "alice", "s3cret-alice", produce=("orders",), consume=("orders",), groups=("billing",)))
    b = Broker(tmp_path / "data", port=0, kafka_port=free_port(), users_file=str(users),
               auth_failure_delay_ms=100).start()
    try:
        b.server.topics.create("orders", 1, {}, 0)
        b.server.topics.create("secret", 1, {}, 0)
        address = kafka_address(b)
        alice = {"username": "alice", "password": "s3cret-alice"}
        one = [{"key": "k", "value": "hello", "partition": 0}]
        assert kafkajs(address, "produce", sasl=alice, topic="orders",
                       messages=one)["records"] == [{"partition": 0, "baseOffset": 0}]
        got = kafkajs(address, "consume", sasl=alice, topic="orders", groupId="billing", count=1)
        assert [m["value"] for m in got["messages"]] == ["hello"]
        wrong = run_kafkajs(address, "produce", sasl={**alice, "password": "guess"},
                            topic="orders", messages=one)
        assert wrong.returncode != 0
        assert "SASL SCRAM SHA256 authentication failed" in wrong.stderr
        denied = run_kafkajs(address, "produce", sasl=alice, topic="secret", messages=one)
        assert denied.returncode != 0
        assert "Not authorized to access topics" in denied.stderr
        assert b.server.topics.queue("secret", 0).log.end_offset == 0
    finally:
        b.stop()
