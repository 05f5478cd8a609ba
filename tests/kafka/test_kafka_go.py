"""Sarama (a Go Kafka client: Debian's golang-github-shopify-sarama-dev 1.22, ``make sarama``)
against a real in-process FerryMQ broker's Kafka port: produce with keys and headers, a consumer
group and its rebalances, an idempotent producer whose answer is lost, compressed batches.
``tests/kafka/go/sarama_client`` is built once per session in GOPATH mode against Debian's
layout (``GO111MODULE=off``, ``GOPATH=/usr/share/gocode``) and run as
``sarama_client '<json>'``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ferrymq import Broker, Message, Producer
from tests.helpers import read_topic
from tests.kafka.conftest import ProduceAnswerDropper, assert_one_batch_per_sequence, kafka_address

GOPATH = Path("/usr/share/gocode")
SOURCE = Path(__file__).parent / "go" / "sarama_client"
GO = shutil.which("go")
HAVE_SARAMA = (GOPATH / "src" / "github.com" / "Shopify" / "sarama" / "sarama.go").exists()

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(GO is None or not HAVE_SARAMA,
                                 reason="needs go and Debian's Sarama (make sarama)")]


@pytest.fixture(scope="session")
def sarama_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The client program, built (Go's build cache makes a rebuild take a second)."""
    assert GO is not None
    out = tmp_path_factory.mktemp("sarama") / "sarama_client"
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": str(GOPATH), "GOFLAGS": ""}
    if not any(env.get(k) for k in ("GOCACHE", "XDG_CACHE_HOME", "HOME")):
        env["GOCACHE"] = str(tmp_path_factory.mktemp("go-cache"))  # Go needs one somewhere
    res = subprocess.run([GO, "build", "-o", str(out), "."], cwd=SOURCE, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return out


def sarama(program: Path, address: str, cmd: str, **args: Any) -> dict[str, Any]:
    """Run one command of the client against ``address``; its JSON result."""
    res = subprocess.run([str(program), json.dumps({"cmd": cmd, "brokers": [address], **args})],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    result: dict[str, Any] = json.loads(res.stdout)
    return result


def test_sarama_produces_with_keys_and_headers_and_a_group_consumes(
        kbroker: Broker, sarama_client: Path) -> None:
    address = kafka_address(kbroker)
    kbroker.server.topics.create("orders", 2, {}, 0)
    sent = [{"key": f"cust-{i}", "value": f"order {i}", "partition": i % 2,
             "headers": [{"key": "source", "value": "go"}, {"key": "ferrymq.tag", "value": "new"},
                         {"key": "ferrymq.key", "value": f"o-{i}"}]} for i in range(6)]
    out = sarama(sarama_client, address, "produce", topic="orders", messages=sent)
    assert out["records"] == [{"partition": i % 2, "offset": i // 2} for i in range(6)]
    native = sorted(read_topic(kbroker.address, "orders", 6), key=lambda m: (m.queue, m.offset))
    assert [(m.queue, m.offset, m.body, m.sharding_key, m.keys) for m in native] == [
        (q, o, f"order {2 * o + q}".encode(), f"cust-{2 * o + q}", (f"o-{2 * o + q}",))
        for q in (0, 1) for o in range(3)]
    assert {(m.tags, m.properties["source"]) for m in native} == {("new", "go")}
    # a Sarama consumer group: JoinGroup v1, SyncGroup/Heartbeat/LeaveGroup v0, OffsetCommit v2
    got = sarama(sarama_client, address, "consume", topic="orders", groupId="billing", count=6)
    assert got["claims"] == {"orders": [0, 1]}
    by_offset = sorted(got["messages"], key=lambda m: (m["partition"], m["offset"]))
    assert [(m["partition"], m["offset"], m["key"], m["value"]) for m in by_offset] == [
        (q, o, f"cust-{2 * o + q}", f"order {2 * o + q}") for q in (0, 1) for o in range(3)]
    assert sorted((h["key"], h["value"]) for h in by_offset[0]["headers"]) == [
        ("ferrymq.key", "o-0"), ("ferrymq.tag", "new"), ("source", "go")]
    assert kbroker.server.consumer_groups.committed("billing") == {("orders", 0): 3,
                                                                   ("orders", 1): 3}


def test_a_sarama_group_rebalances_when_a_member_joins_and_leaves(
        kbroker: Broker, sarama_client: Path) -> None:
    """Two Sarama members (JoinGroup v1, Heartbeat v0): the second's join rebalances the first,
    they split the partitions; when the second leaves the first takes them all back and reads
    what is produced to them, committing it."""
    kbroker.server.topics.create("split", 4, {}, 0)
    out = sarama(sarama_client, kafka_address(kbroker), "rebalance", topic="split",
                 partitions=4, groupId="pair")
    alone, split, alone_again = out["phases"]
    assert alone == alone_again == {"a": [0, 1, 2, 3]}
    assert split["a"] and split["b"] and sorted(split["a"] + split["b"]) == [0, 1, 2, 3]
    assert sorted((m["partition"], m["value"]) for m in out["readByA"]) == [
        (q, f"after-{q}") for q in range(4)]
    assert kbroker.server.consumer_groups.committed("pair") == {("split", q): 1
                                                                for q in range(4)}


def test_ferrymq_message_read_by_a_sarama_group(kbroker: Broker, sarama_client: Path) -> None:
    with Producer(kbroker.address) as p:
        r = p.send(Message("native", b"from ferrymq", tags="paid", keys=["o-2"],
                           sharding_key="cust-1", properties={"source": "batch"}))
    got = sarama(sarama_client, kafka_address(kbroker), "consume", topic="native", groupId="go",
                 count=1)
    [m] = got["messages"]
    assert (m["partition"], m["offset"], m["key"], m["value"]) == (
        r.queue, r.offset, "cust-1", "from ferrymq")
    assert sorted((h["key"], h["value"]) for h in m["headers"]) == [
        ("ferrymq.key", "o-2"), ("ferrymq.tag", "paid"), ("source", "batch")]
    assert kbroker.server.consumer_groups.committed("go") == {("native", r.queue): r.offset + 1}


def test_sarama_idempotent_producer_retry_is_stored_once(
        dropper_broker: tuple[Broker, ProduceAnswerDropper], sarama_client: Path) -> None:
    """Sarama's ``Producer.Idempotent``: the first batch's answer is lost, Sarama sends it
    again with the same sequence, and FerryMQ stores it once."""
    b, proxy = dropper_broker
    b.server.topics.create("idem", 1, {}, 0)
    out = sarama(sarama_client, f"127.0.0.1:{proxy.port}", "produce", idempotent=True,
                 topic="idem",
                 messages=[{"key": "k", "value": f"m{i}", "partition": 0} for i in range(3)])
    assert proxy.dropped and proxy.produce_requests == 4  # three batches, one sent twice
    assert out["records"] == [{"partition": 0, "offset": i} for i in range(3)]
    assert_one_batch_per_sequence(b, "idem", [b"m0", b"m1", b"m2"])


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_sarama_compressed_batches(kbroker: Broker, sarama_client: Path, codec: str) -> None:
    """Sarama's own codecs (Go's gzip, golang/snappy, pierrec/lz4, DataDog/zstd)."""
    values = [f"{codec} {i} " * 40 for i in range(3)]
    out = sarama(sarama_client, kafka_address(kbroker), "produce", topic="c", compression=codec,
                 messages=[{"key": "k", "value": v, "partition": 0} for v in values])
    assert [r["offset"] for r in out["records"]] == [0, 1, 2]
    assert [m.body for m in read_topic(kbroker.address, "c", 3)] == [v.encode() for v in values]
