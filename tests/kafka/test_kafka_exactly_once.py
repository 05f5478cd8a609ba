"""Exactly once through the Kafka port: a confluent-kafka read-process-write app killed with
SIGKILL mid-way and restarted; read_committed readers see every input once in the output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ferrymq import Broker
from tests.helpers import free_port, wait_for

confluent_kafka = pytest.importorskip("confluent_kafka")

pytestmark = pytest.mark.integration

APP = Path(__file__).with_name("rpw_app.py")
N = 300


def test_read_process_write_killed_and_restarted_is_exactly_once(tmp_path: Path) -> None:
    b = Broker(tmp_path / "data", port=0, kafka_port=free_port()).start()
    assert b.server.kafka is not None
    address = "{}:{}".format(*b.server.kafka.address)
    try:
        b.server.topics.create("in", 1, {}, 0)
        b.server.topics.create("out", 1, {}, 0)
        p = confluent_kafka.Producer({"bootstrap.servers": address, "acks": "all"})
        for i in range(N):
            p.produce("in", f"m{i}".encode(), partition=0)
        assert p.flush(30) == 0

        def committed() -> int:
            return b.server.consumer_groups.committed("rpw").get(("in", 0), 0)

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        app = subprocess.Popen([sys.executable, str(APP), address], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: committed() >= 30, timeout=60)
        finally:
            app.send_signal(signal.SIGKILL)  # inside a transaction, most likely
            app.wait(10)
        killed_at = committed()
        assert killed_at < N, "the app finished before it was killed: make it slower"
        app = subprocess.Popen([sys.executable, str(APP), address], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: committed() == N, timeout=90)
        finally:
            app.send_signal(signal.SIGKILL)
            app.wait(10)
        c = confluent_kafka.Consumer({"bootstrap.servers": address, "group.id": "reader",
                                      "isolation.level": "read_committed",
                                      "enable.auto.commit": False})
        c.assign([confluent_kafka.TopicPartition("out", 0, 0)])
        out: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(out) < N and time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is not None and msg.error() is None:
                out.append(msg.value())
        assert c.poll(2.0) is None  # and nothing more: no duplicate
        c.close()
        assert out == [f"M{i}".encode() for i in range(N)]
    finally:
        b.stop()
