"""kill -9 the broker while a Kafka client (confluent-kafka, through the Kafka port) and a
FerryMQ producer write the same queue: its log holds both record formats (Kafka batches stored
as they came, FerryMQ batches) and a torn tail of either. After the restart every acknowledged
message of both is there, in order, read by a Kafka reader and by a FerryMQ reader alike."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ferrymq import AdminClient, Message, Producer, PullConsumer
from ferrymq.errors import FerryMQError
from tests.helpers import BrokerProcess, free_port

confluent_kafka = pytest.importorskip("confluent_kafka")

pytestmark = [pytest.mark.crash, pytest.mark.integration]

TOPIC = "both"


def _native_load(address: str, stop: threading.Event, acked: dict[int, bytes]) -> None:
    try:
        p = Producer(address, delivery_timeout_s=3, request_timeout_s=2, linger_ms=1)
    except FerryMQError:
        return
    n = 0
    try:
        while not stop.is_set():
            msgs = [Message(TOPIC, f"native-{n + i}") for i in range(10)]
            n += 10
            try:
                for m, r in zip(msgs, p.send_batch(msgs), strict=True):
                    acked[r.offset] = m.body
            except FerryMQError:
                time.sleep(0.05)
    finally:
        try:
            p.close()
        except FerryMQError:
            pass


def _kafka_load(address: str, stop: threading.Event, acked: dict[int, bytes]) -> None:
    p = confluent_kafka.Producer({"bootstrap.servers": address, "acks": "all", "linger.ms": 2,
                                  "compression.type": "lz4", "message.timeout.ms": 3000})

    def report(err: Any, msg: Any) -> None:
        if err is None:
            acked[msg.offset()] = msg.value()

    n = 0
    while not stop.is_set():
        try:
            p.produce(TOPIC, f"kafka-{n}".encode(), partition=0, on_delivery=report)
            n += 1
        except BufferError:
            pass
        p.poll(0.001 if n % 50 else 0.01)
    p.purge()
    p.flush(5)


def _read_kafka(address: str) -> list[tuple[int, bytes]]:
    c = confluent_kafka.Consumer({"bootstrap.servers": address, "group.id": "check",
                                  "enable.auto.commit": False})
    c.assign([confluent_kafka.TopicPartition(TOPIC, 0, confluent_kafka.OFFSET_BEGINNING)])
    out: list[tuple[int, bytes]] = []
    idle = 0
    try:
        while idle < 6:
            msg = c.poll(0.5)
            if msg is None:
                idle += 1
                continue
            assert msg.error() is None, msg.error()
            idle = 0
            out.append((msg.offset(), msg.value()))
    finally:
        c.close()
    return out


def _read_native(address: str) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    with PullConsumer(address, "check", auto_offset_reset="earliest", auto_commit=False) as c:
        c.assign([(TOPIC, 0)])
        idle = 0
        while idle < 3:
            got = c.poll(0.5, max_messages=5000)
            idle = 0 if got else idle + 1
            out += [(m.offset, m.body) for m in got]
    return out


def test_a_log_of_both_formats_keeps_every_acknowledged_message_across_kill9(
        tmp_path: Path) -> None:
    kafka_port = free_port()
    kafka_address = f"127.0.0.1:{kafka_port}"
    acked: dict[int, bytes] = {}
    with BrokerProcess(tmp_path / "data", flush="sync",
                       extra=["--kafka-port", str(kafka_port)]) as bp:
        with AdminClient(bp.address) as admin:
            admin.create_topic(TOPIC, 1)
        for cycle in range(2):
            stop = threading.Event()
            loads = [threading.Thread(target=f, args=(a, stop, acked)) for f, a in
                     ((_native_load, bp.address), (_kafka_load, kafka_address))]
            for th in loads:
                th.start()
            time.sleep(1.5 + cycle)
            bp.kill9()
            stop.set()
            for th in loads:
                th.join(30)
                assert not th.is_alive()
            bp.start()
        bodies = set(acked.values())
        assert any(b.startswith(b"kafka-") for b in bodies), "the Kafka client stored nothing"
        assert any(b.startswith(b"native-") for b in bodies), "the FerryMQ client stored nothing"
        kafka_read = _read_kafka(kafka_address)
        native_read = _read_native(bp.address)
    assert [o for o, _b in native_read] == list(range(len(native_read))), "holes or reuse"
    assert kafka_read == native_read
    stored = dict(native_read)
    for off, body in acked.items():
        assert stored.get(off) == body, f"acknowledged offset {off} lost or changed"
