"""Exactly-once reading: a checkpointed streaming query is SIGKILLed and restarted while a
producer keeps writing; the committed output must equal what was produced (no duplicate, no gap).

The query runs in its own session (``start_new_session``) so the kill takes its JVM and its
Python workers and leaves the test process alone. The output is Spark's Parquet sink, whose
commit log makes it idempotent per micro-batch: what is measured is the source (offsets in the
checkpoint, replayed ranges)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ferrymq import Broker, Message, Producer
from tests.spark.helpers import SPARK_ENV, create_topic

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _start_job(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, **SPARK_ENV, "PYTHONPATH": str(ROOT)}
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "tests.spark.stream_job", *args],
                                cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL every process of the job's session (JVM, Python daemon and workers)."""
    sid = proc.pid
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of stat: session id
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait(30)


def _commits(chk: Path) -> int:
    d = chk / "commits"
    return sum(1 for p in d.iterdir() if p.name.isdigit()) if d.exists() else 0


def _run_kills(spark: Any, broker: Broker, tmp_path: Path, kills: int) -> None:
    addr = broker.address
    topic = f"eo-{kills}"
    create_topic(addr, topic, 3)
    chk, out, log = tmp_path / "chk", tmp_path / "out", tmp_path / "job.log"
    produced: list[str] = []
    stop = threading.Event()

    def produce() -> None:
        with Producer(addr) as p:
            i = 0
            while not stop.is_set():
                batch = [f"m{i + k}" for k in range(40)]
                p.send_batch([Message(topic, v.encode()) for v in batch])
                produced.extend(batch)
                i += 40
                time.sleep(0.05)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    rng = random.Random(kills)
    try:
        for _ in range(kills):
            before = _commits(chk)
            job = _start_job([addr, topic, str(chk), str(out), "processing"], log)
            try:
                deadline = time.monotonic() + 200
                while (_commits(chk) <= before and time.monotonic() < deadline
                       and job.poll() is None):
                    time.sleep(0.2)
                assert job.poll() is None, log.read_text()[-3000:]
                assert _commits(chk) > before, "the query made no progress before the kill"
                time.sleep(rng.uniform(0.0, 2.0))  # somewhere in a micro-batch
            finally:
                _kill_session(job)
    finally:
        stop.set()
        producer.join(30)
    final = _start_job([addr, topic, str(chk), str(out), "availableNow"], log)
    try:
        assert final.wait(300) == 0, log.read_text()[-3000:]
    finally:
        if final.poll() is None:
            _kill_session(final)
    rows = spark.read.parquet(str(out)).collect()
    got = [r.v for r in rows]
    assert len(got) == len(set(got)), "duplicates in the committed output"
    assert set(got) == set(produced), (
        f"missing {len(set(produced) - set(got))}, unexpected {len(set(got) - set(produced))}")
    by_queue: dict[int, list[int]] = {}
    for r in rows:
        by_queue.setdefault(r.queue, []).append(r.offset)
    for offsets in by_queue.values():
        assert sorted(offsets) == list(range(len(offsets)))  # no gap in any queue


@pytest.mark.timeout(900)
def test_sigkill_restart_exactly_once(spark: Any, module_broker: Broker, tmp_path: Path) -> None:
    _run_kills(spark, module_broker, tmp_path, kills=2)


@pytest.mark.slow
@pytest.mark.soak  # five kills cost minutes: `make soak`, not CI (the test above is in CI)
@pytest.mark.timeout(1500)
def test_sigkill_restart_exactly_once_many(spark: Any, module_broker: Broker, tmp_path: Path) -> None:
    _run_kills(spark, module_broker, tmp_path, kills=5)
