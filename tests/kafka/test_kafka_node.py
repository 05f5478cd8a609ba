"""kafkajs (a pure-JavaScript Kafka client from the npm registry, ``make kafkajs``) against a real
in-process FerryMQ broker's Kafka port: produce with keys and headers, a consumer group of the
classic protocol, an idempotent producer whose answer is lost, and a transaction with the
group's offsets. The client runs as ``node tests/kafka/node/kafkajs_client.js '<json>'``."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ferrymq import Broker, Message, Producer
from ferrymq.protocol.records import decode_records, iter_batches
from tests.helpers import free_port, read_topic
from tests.kafka.conftest import kafka_address

NODE_DIR = Path(__file__).parent / "node"
NODE = shutil.which("node")
HAVE_KAFKAJS = (NODE_DIR / "node_modules" / "kafkajs" / "package.json").exists()

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(NODE is None or not HAVE_KAFKAJS,
                                 reason="needs node and kafkajs (make kafkajs)")]


def kafkajs(address: str, cmd: str, **args: Any) -> dict[str, Any]:
    """Run one command of ``kafkajs_client.js`` against ``address``; its JSON result."""
    assert NODE is not None
    env = {**os.environ, "KAFKAJS_NO_PARTITIONER_WARNING": "1"}
    res = subprocess.run([NODE, str(NODE_DIR / "kafkajs_client.js"),
                          json.dumps({"cmd": cmd, "brokers": [address], **args})],
                         capture_output=True, text=True, timeout=60, env=env)
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


class ProduceAnswerDropper:
    """A TCP proxy in front of a Kafka port that forwards everything, except that it cuts the
    connection instead of delivering the answer to the first Produce request: the broker has
    stored the batch, the client never hears so, and retries it."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self.produce_requests = 0
        self.dropped = False
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._writers: set[asyncio.StreamWriter] = set()

    def __enter__(self) -> ProduceAnswerDropper:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _close(self) -> None:
        self._server.close()
        for w in self._writers:
            w.transport.abort()
        await self._server.wait_closed()
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        self._writers.add(client_w)
        broker_r, broker_w = await asyncio.open_connection(*self.target)
        self._writers.add(broker_w)
        produce_ids: set[int] = set()

        async def requests() -> None:
            while frame := await read_frame(client_r):
                api_key, _version, correlation_id = struct.unpack_from(">hhi", frame, 4)
                if api_key == 0:  # Produce
                    self.produce_requests += 1
                    produce_ids.add(correlation_id)
                broker_w.write(frame)

        async def answers() -> None:
            while frame := await read_frame(broker_r):
                (correlation_id,) = struct.unpack_from(">i", frame, 4)
                if correlation_id in produce_ids and not self.dropped:
                    self.dropped = True
                    return
                client_w.write(frame)

        pumps = [asyncio.create_task(requests()), asyncio.create_task(answers())]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for w in (client_w, broker_w):
            w.transport.abort()
            self._writers.discard(w)
        for t in pumps:
            t.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def read_frame(r: asyncio.StreamReader) -> bytes:
    """One size-prefixed Kafka frame, size included (b"" at the end of the stream)."""
    try:
        head = await r.readexactly(4)
        return head + await r.readexactly(struct.unpack(">i", head)[0])
    except (asyncio.IncompleteReadError, OSError):
        return b""


@pytest.fixture
def dropper_broker(tmp_path: Path) -> Iterator[tuple[Broker, ProduceAnswerDropper]]:
    """A broker whose Kafka port is reached through a :class:`ProduceAnswerDropper` (Metadata
    names the proxy, ``kafka_advertised_address``)."""
    kafka_port = free_port()
    with ProduceAnswerDropper(("127.0.0.1", kafka_port)) as proxy:
        b = Broker(tmp_path / "data", port=0, kafka_port=kafka_port,
                   kafka_advertised_address=f"127.0.0.1:{proxy.port}").start()
        try:
            yield b, proxy
        finally:
            b.stop()


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
    data = b.server.topics.queue("idem", 0).log.read(0, 1 << 20)
    assert [r.body for r in decode_records(data)] == [b"m0", b"m1", b"m2"]
    headers = [h for _p, h in iter_batches(data)]
    assert len({h.producer_id for h in headers}) == 1 and headers[0].producer_id >= 0
    assert [h.base_sequence for h in headers] == [0, 1, 2]


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
