"""The Kafka port against the native port, on one broker in its own process (issue 23).

Each round produces ``--messages`` of ``--size`` bytes twice into fresh topics: with
confluent-kafka through the Kafka port (``acks=all``, librdkafka's batching: ``linger.ms`` 5,
``batch.size`` 1 MB, its local queue bounded to 64 MiB: ``--kafka-queue-kbytes``) and with
FerryMQ's native asyncio producer (``ferrymq bench produce``'s workload, ``acks="all"``,
batches of 1,000 messages or 1 MB, 8 in flight). The order alternates
from round to round (Kafka first in odd rounds), so neither side always gets the emptier disk.
After each produce, the same side's consumer reads the topic back from the start: a
confluent-kafka consumer (``assign()``) the Kafka-produced messages, FerryMQ's native pull
consumer (``ferrymq bench consume``'s reader) the native ones; each must see every one. Each
topic is deleted once its workloads are done: the page cache then holds no more of one side's
data than of the other's when the next workload starts (at 10 KB a run writes 2 GB, and
writing into a full page cache costs the broker far more system time). Each workload is timed
with the broker's CPU seconds (user and system) and the benchmark process's own
(``client_cpu_s``: the client's, librdkafka's threads included). One JSON object per workload
and round, then a summary of medians and ratios.

``--kafka-api`` picks how the benchmark hands messages to confluent-kafka:

- ``batch`` (default): ``Producer.produce_batch`` with 1,000 messages (or 1 MB) per call, as the
  native side sends 1,000 per ``send_batch``; delivery reports for errors only
  (``delivery.report.only.error``);
- ``produce``: one ``Producer.produce`` call and one delivery callback per message, as most
  applications write it (the Python loop, not the broker, is then the limit at 100 B).

Smoke run (seconds)::

    .venv/bin/python bench/kafka_port.py --messages 20000 --size 100 --rounds 1

Full run (record it in bench/README.md; not on a busy machine)::

    .venv/bin/python bench/kafka_port.py --messages 1000000 --size 100 --rounds 3
    .venv/bin/python bench/kafka_port.py --messages 200000 --size 10000 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import confluent_kafka

from ferrymq._launcher import BrokerProcess, free_port
from ferrymq.admin.bench_measure import CpuTime, cpu_seconds
from ferrymq.admin.bench_workloads import run_consume, run_produce
from ferrymq.client.sync import AdminClient

_PRODUCER = {"acks": "all", "linger.ms": 5, "batch.size": 1_000_000,
             "queue.buffering.max.messages": 1_000_000}

# librdkafka's local queue is bounded to 64 MiB by default here, as the native producer bounds
# what it holds (8 batches in flight). With 2 GB allowed (sessions 17-18), librdkafka held
# 1.3 GB of a 10 KB run, and on this VM writing into memory not touched for a while is slow
# (the guest hands free pages back to the host: virtio-balloon free page reporting): the
# broker's page-cache writes took 40-50 % more system time in those runs (bench/README.md,
# session 19). ``--kafka-queue-kbytes 1048576`` is librdkafka's own default.
QUEUE_KBYTES = 65_536


def _batch_of(size: int) -> int:
    """Messages per batch call on both sides: 1,000, or fewer to stay within 1 MB."""
    return max(1, min(1000, 1_000_000 // size))


class _SplitCpu:
    """The broker's user and system CPU seconds over a timed part (Linux /proc)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = self._read()
        self.user = self.system = 0.0

    def _read(self) -> tuple[float, float]:
        import os

        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tick, int(fields[12]) / tick

    def end(self) -> None:
        u, s = self._read()
        self.user, self.system = u - self.start[0], s - self.start[1]


def kafka_produce(address: str, topic: str, messages: int, size: int, pid: int | None,
                  partitions: int, api: str = "batch",
                  queue_kbytes: int = QUEUE_KBYTES) -> dict[str, Any]:
    """Produce ``messages`` with confluent-kafka to ``topic`` (created by the first, untimed
    message), round-robin over ``partitions``; the timed result."""
    body = b"x" * size
    failed = [0]

    def report(err: Any, _msg: Any) -> None:
        if err is not None:
            failed[0] += 1

    conf: dict[str, Any] = dict(_PRODUCER, **{"bootstrap.servers": address,
                                              "queue.buffering.max.kbytes": queue_kbytes})
    if api == "batch":
        conf.update({"delivery.report.only.error": True, "on_delivery": report})
    p = confluent_kafka.Producer(conf)
    p.produce(topic, body, partition=0)  # untimed: metadata, the topic's creation
    if p.flush(30):
        raise RuntimeError("confluent-kafka could not deliver the warm-up message")
    cpu = CpuTime(pid)
    split = _SplitCpu(pid) if pid is not None else None
    cpu.begin()
    t0 = time.perf_counter()
    if api == "batch":
        _send_batches(p, topic, messages, body, partitions)
    else:
        _send_one_by_one(p, topic, messages, body, partitions, report)
    if p.flush(120):
        raise RuntimeError("confluent-kafka did not deliver everything within 120 s")
    elapsed = time.perf_counter() - t0
    cpu.end()
    if split is not None:
        split.end()
    return _result(f"kafka-port produce (confluent-kafka, {api})", messages, size, elapsed, cpu,
                   split, failed=failed[0])


def _send_batches(p: Any, topic: str, messages: int, body: bytes, partitions: int) -> None:
    per_call = _batch_of(len(body))
    full = [{"value": body} for _ in range(per_call)]
    sent = 0
    q = 0
    while sent < messages:
        k = min(per_call, messages - sent)
        todo = full if k == per_call else full[:k]
        while True:
            queued = p.produce_batch(topic, todo, partition=q)
            if queued == len(todo):
                break
            todo = [{"value": body} for m in todo if "_error" in m]  # the queue was full
            p.poll(0.01)
        sent += k
        q = (q + 1) % partitions
        p.poll(0)


def _send_one_by_one(p: Any, topic: str, messages: int, body: bytes, partitions: int,
                     report: Any) -> None:
    for i in range(messages):
        while True:
            try:
                p.produce(topic, body, partition=i % partitions, on_delivery=report)
                break
            except BufferError:
                p.poll(0.01)
        if i % 10_000 == 0:
            p.poll(0)


def kafka_consume(address: str, topic: str, messages: int, size: int, pid: int | None,
                  partitions: int) -> dict[str, Any]:
    """Read ``topic`` from the beginning with a confluent-kafka consumer until ``messages``
    have come; the timed result."""
    # fetch.queue.backoff.ms: librdkafka parks a partition's fetching for this long once its
    # local queue holds queued.min.messages (100,000); its default, 1 s, made a 1M-message read
    # take 6.8 s of which the broker was busy 0.1 s: the benchmark timed librdkafka's timer
    c = confluent_kafka.Consumer({"bootstrap.servers": address, "group.id": "bench",
                                  "enable.auto.commit": False, "fetch.max.bytes": 8_000_000,
                                  "fetch.queue.backoff.ms": 10})
    c.assign([confluent_kafka.TopicPartition(topic, q, confluent_kafka.OFFSET_BEGINNING)
              for q in range(partitions)])
    got = 0
    cpu = CpuTime(pid)
    split = _SplitCpu(pid) if pid is not None else None
    cpu.begin()
    t0 = time.perf_counter()
    deadline = time.monotonic() + 300
    while got < messages and time.monotonic() < deadline:
        for msg in c.consume(min(10_000, messages - got), 1.0):  # not waiting for more
            if msg.error() is None:
                got += 1
    elapsed = time.perf_counter() - t0
    cpu.end()
    if split is not None:
        split.end()
    c.close()
    if got != messages:
        raise RuntimeError(f"the consumer read {got} of {messages} messages")
    return _result("kafka-port consume (confluent-kafka)", got, size, elapsed, cpu, split)


def native_produce(address: str, messages: int, size: int, pid: int,
                   partitions: int) -> dict[str, Any]:
    """Produce with FerryMQ's native producer (``ferrymq bench produce``); the timed result."""
    split = _SplitCpu(pid)
    res = run_produce(address, messages=messages, size=size, queues=partitions, broker_pid=pid,
                      batch=_batch_of(size), show_progress=False)
    split.end()  # includes the topic's creation: a few milliseconds
    return {"workload": "native produce (ferrymq AsyncProducer)", "topic": res["topic"],
            "messages": messages,
            "size": size, "seconds": res["seconds"], "msg_per_s": res["msg_per_s"],
            "broker_cpu_s": res["broker_cpu_s"], "broker_user_s": split.user,
            "broker_system_s": split.system,
            "broker_cpu_us_per_msg": (res["broker_cpu_s"] / messages * 1e6
                                      if res["broker_cpu_s"] else None)}


def native_consume(address: str, topic: str, messages: int, size: int, pid: int,
                   partitions: int) -> dict[str, Any]:
    """Read ``topic`` (filled by :func:`native_produce`) with FerryMQ's native pull consumer
    (``ferrymq bench consume``'s reader); the timed result."""
    split = _SplitCpu(pid)
    res = run_consume(address, messages=messages - 1, size=size, queues=partitions,
                      broker_pid=pid, show_progress=False, topic=topic)
    split.end()
    return {"workload": "native consume (ferrymq AsyncPullConsumer)", "messages": res["messages"],
            "size": size, "seconds": res["seconds"], "msg_per_s": res["msg_per_s"],
            "broker_cpu_s": res["broker_cpu_s"], "broker_user_s": split.user,
            "broker_system_s": split.system,
            "broker_cpu_us_per_msg": (res["broker_cpu_s"] / res["messages"] * 1e6
                                      if res["broker_cpu_s"] else None)}


def _result(workload: str, messages: int, size: int, elapsed: float, cpu: CpuTime,
            split: _SplitCpu | None, **extra: Any) -> dict[str, Any]:
    return {"workload": workload, "messages": messages, "size": size, "seconds": elapsed,
            "msg_per_s": messages / elapsed, "broker_cpu_s": cpu.used,
            "broker_user_s": split.user if split else None,
            "broker_system_s": split.system if split else None,
            "broker_cpu_us_per_msg": cpu.used / messages * 1e6 if cpu.used else None, **extra}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per workload and the two ratios issue 23 sets targets for."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["workload"].split(" (")[0], []).append(r)
    med = {w: {"msg_per_s": statistics.median(r["msg_per_s"] for r in rs),
               "broker_cpu_us_per_msg": statistics.median(
                   r["broker_cpu_us_per_msg"] for r in rs if r["broker_cpu_us_per_msg"])
               if any(r["broker_cpu_us_per_msg"] for r in rs) else None,
               "rounds": len(rs)} for w, rs in by.items()}
    out: dict[str, Any] = {"summary": med}
    k, n = med.get("kafka-port produce"), med.get("native produce")
    if k and n:
        out["produce_throughput_kafka_over_native"] = k["msg_per_s"] / n["msg_per_s"]
        if k["broker_cpu_us_per_msg"] and n["broker_cpu_us_per_msg"]:
            out["broker_cpu_per_msg_kafka_over_native"] = (
                k["broker_cpu_us_per_msg"] / n["broker_cpu_us_per_msg"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kafka-api", choices=["batch", "produce"], default="batch")
    ap.add_argument("--flush", choices=["sync", "async"], default="sync")
    ap.add_argument("--no-consume", action="store_true", help="skip the Kafka consumer")
    ap.add_argument("--kafka-queue-kbytes", type=int, default=QUEUE_KBYTES,
                    help="librdkafka's queue.buffering.max.kbytes (its default: 1048576)")
    args = ap.parse_args()
    port = free_port()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        bp = BrokerProcess(Path(d) / "data", flush=args.flush,
                           extra=["--kafka-port", str(port)],
                           env={"FERRYMQ_DEFAULT_QUEUES": str(args.partitions)}).start()
        try:
            pid = bp.pid
            if pid is None or cpu_seconds(pid) is None:
                raise RuntimeError("the broker's CPU time cannot be read (Linux /proc)")
            kafka = f"127.0.0.1:{port}"
            admin = AdminClient(bp.address)
            for r in range(args.rounds):
                topic = f"bench-kafka-{r}"
                runs = [functools.partial(kafka_produce, kafka, topic, args.messages, args.size,
                                          pid, args.partitions, args.kafka_api,
                                          args.kafka_queue_kbytes),
                        functools.partial(native_produce, bp.address, args.messages, args.size,
                                          pid, args.partitions)]
                for run in runs if r % 2 == 0 else runs[::-1]:
                    client = time.process_time()
                    rows.append(dict(run(), round=r + 1))
                    rows[-1]["client_cpu_s"] = time.process_time() - client
                    print(json.dumps(rows[-1]), flush=True)
                    native_topic = rows[-1].pop("topic", None)
                    if native_topic is None:
                        reader = functools.partial(kafka_consume, kafka, topic)
                    else:
                        reader = functools.partial(native_consume, bp.address, native_topic)
                    if not args.no_consume:  # all it holds: the messages and the warm-up
                        client = time.process_time()
                        rows.append(dict(reader(args.messages + 1, args.size, pid,
                                                args.partitions), round=r + 1))
                        rows[-1]["client_cpu_s"] = time.process_time() - client
                        print(json.dumps(rows[-1]), flush=True)
                    admin.delete_topic(native_topic or topic)  # its pages leave the cache
        finally:
            bp.stop()
    print(json.dumps(summary(rows)))


if __name__ == "__main__":
    main()
