"""The Kafka port against the native port, on one broker in its own process (issue 23).

Produce ``--messages`` of ``--size`` bytes with confluent-kafka through the Kafka port
(``acks=all``, librdkafka's batching: ``linger.ms`` 5, ``batch.size`` 1 MB), then the same with
FerryMQ's native asyncio producer (``ferrymq bench produce``'s workload, ``acks="all"``), then
read the Kafka-produced messages back with a confluent-kafka consumer (``assign()``), each timed
with the broker's CPU seconds. Prints one JSON object per workload.

Smoke run (seconds)::

    .venv/bin/python bench/kafka_port.py --messages 20000 --size 100

Full run (record it in bench/README.md; not on a busy machine)::

    .venv/bin/python bench/kafka_port.py --messages 1000000 --size 100
    .venv/bin/python bench/kafka_port.py --messages 200000 --size 10000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import confluent_kafka

from ferrymq._launcher import BrokerProcess, free_port
from ferrymq.admin.bench_measure import CpuTime
from ferrymq.admin.bench_workloads import run_produce


def kafka_produce(address: str, topic: str, messages: int, size: int, pid: int | None,
                  partitions: int) -> dict[str, Any]:
    body = b"x" * size
    p = confluent_kafka.Producer({"bootstrap.servers": address, "acks": "all", "linger.ms": 5,
                                  "batch.size": 1_000_000, "queue.buffering.max.messages":
                                  1_000_000, "queue.buffering.max.kbytes": 2_000_000})
    failed = [0]

    def report(err: Any, _msg: Any) -> None:
        if err is not None:
            failed[0] += 1

    p.produce(topic, body, partition=0)  # untimed: metadata, the topic's creation
    p.flush(30)
    cpu = CpuTime(pid)
    cpu.begin()
    t0 = time.perf_counter()
    for i in range(messages):
        while True:
            try:
                p.produce(topic, body, partition=i % partitions, on_delivery=report)
                break
            except BufferError:
                p.poll(0.01)
        if i % 10_000 == 0:
            p.poll(0)
    if p.flush(120):
        raise RuntimeError("confluent-kafka did not deliver everything within 120 s")
    elapsed = time.perf_counter() - t0
    cpu.end()
    return _result("kafka-port produce (confluent-kafka)", messages, size, elapsed, cpu,
                   failed=failed[0])


def kafka_consume(address: str, topic: str, messages: int, size: int, pid: int | None,
                  partitions: int) -> dict[str, Any]:
    c = confluent_kafka.Consumer({"bootstrap.servers": address, "group.id": "bench",
                                  "enable.auto.commit": False, "fetch.max.bytes": 8_000_000})
    c.assign([confluent_kafka.TopicPartition(topic, q, confluent_kafka.OFFSET_BEGINNING)
              for q in range(partitions)])
    total = messages + 1  # and the untimed first one
    got = 0
    cpu = CpuTime(pid)
    cpu.begin()
    t0 = time.perf_counter()
    deadline = time.monotonic() + 300
    while got < total and time.monotonic() < deadline:
        for msg in c.consume(10_000, 1.0):
            if msg.error() is None:
                got += 1
    elapsed = time.perf_counter() - t0
    cpu.end()
    c.close()
    return _result("kafka-port consume (confluent-kafka)", got, size, elapsed, cpu)


def _result(workload: str, messages: int, size: int, elapsed: float, cpu: CpuTime,
            **extra: Any) -> dict[str, Any]:
    return {"workload": workload, "messages": messages, "size": size, "seconds": elapsed,
            "msg_per_s": messages / elapsed, "broker_cpu_s": cpu.used,
            "msgs_per_broker_cpu_s": messages / cpu.used if cpu.used else None, **extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--flush", choices=["sync", "async"], default="sync")
    args = ap.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        bp = BrokerProcess(Path(d) / "data", flush=args.flush,
                           extra=["--kafka-port", str(port)],
                           env={"FERRYMQ_DEFAULT_QUEUES": str(args.partitions)}).start()
        try:
            kafka = f"127.0.0.1:{port}"
            print(json.dumps(kafka_produce(kafka, "bench-kafka", args.messages, args.size,
                                           bp.pid, args.partitions)))
            native = run_produce(bp.address, messages=args.messages, size=args.size,
                                 queues=args.partitions, broker_pid=bp.pid,
                                 batch=max(1, min(1000, 1_000_000 // args.size)),  # 1 MB
                                 show_progress=False)
            native["workload"] = "native produce (ferrymq AsyncProducer)"
            print(json.dumps({k: native[k] for k in ("workload", "messages", "size", "seconds",
                                                     "msg_per_s", "broker_cpu_s",
                                                     "msgs_per_broker_cpu_s")}))
            print(json.dumps(kafka_consume(kafka, "bench-kafka", args.messages, args.size,
                                           bp.pid, args.partitions)))
        finally:
            bp.stop()


if __name__ == "__main__":
    main()
