"""The transactional sink through real Spark when things fail: a driver killed between the
broker commit and Spark's checkpoint commit, and a task attempt that fails mid-write.

The session of this module gives every task two attempts (``local[2,2]``), so Spark retries a
failed task as it would on a cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ferrymq import Broker
from ferrymq.spark._wire import WireConfig
from ferrymq.spark.sink import last_committed_batch
from tests.helpers import read_topic
from tests.spark.helpers import SPARK_ENV, create_topic, produce

pytestmark = pytest.mark.integration
SPARK_MASTER = "local[2,2]"
ROOT = Path(__file__).resolve().parents[2]


def _run_job(args: list[str], log: Path, timeout: float = 240) -> int:
    env = {**os.environ, **SPARK_ENV, "PYTHONPATH": str(ROOT)}
    with open(log, "ab") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "tests.spark.sink_job", *args], cwd=ROOT,
                                env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            from tests.spark.test_exactly_once import _kill_session

            _kill_session(proc)


@pytest.mark.slow  # two Spark driver starts: about a minute
@pytest.mark.timeout(600)
def test_driver_killed_after_broker_commit_writes_each_row_once(
        module_broker: Broker, tmp_path: Path) -> None:
    addr = module_broker.address
    create_topic(addr, "kin", 3)
    create_topic(addr, "kout", 3)
    sent = [f"r{i}".encode() for i in range(3000)]
    produce(addr, "kin", sent)
    chk, marker, log = tmp_path / "chk", tmp_path / "crashed", tmp_path / "job.log"
    args = [addr, "kin", "kout", str(chk), "1", str(marker)]

    code = _run_job(args, log)  # dies inside the sink's commit of micro-batch 1
    assert code == -9 and marker.exists(), log.read_text()[-3000:]
    assert (chk / "offsets" / "1").exists() and not (chk / "commits" / "1").exists()
    assert last_committed_batch(WireConfig(addr), str(chk)) == 1  # the broker has batch 1
    assert len(read_topic(addr, "kout", expect=2000)) == 2000  # batches 0-1 (1000 rows each)

    assert _run_job(args, log) == 0, log.read_text()[-3000:]  # replays batch 1, then 2
    assert (chk / "commits" / "1").exists() and (chk / "commits" / "2").exists()
    got = Counter(m.body for m in read_topic(addr, "kout", expect=3000))
    assert set(got) == set(sent)
    assert max(got.values()) == 1, "the replayed micro-batch was written twice"


def test_failed_task_attempt_leaves_no_visible_rows(spark: Any, module_broker: Broker) -> None:
    from pyspark import TaskContext
    from pyspark.sql.functions import udf

    addr = module_broker.address
    create_topic(addr, "fout", 2)
    n = 90_000  # two tasks of ~5.5 MB of records each: the sink sends a request every ~4 MiB

    @udf("string", useArrow=False)
    def body(i: int) -> str:
        ctx = TaskContext.get()
        if ctx is not None and ctx.attemptNumber() == 0 and i == n // 2 - 1:
            raise RuntimeError("injected failure at the last row of task 0, attempt 0")
        return f"row-{i:07d}-" + "x" * 88

    df = spark.range(0, n, 1, 2).select(body("id").alias("value"))
    df.write.format("ferrymq").option("servers", addr).option("topic", "fout").mode(
        "append").save()
    rows = (spark.read.format("ferrymq").option("servers", addr).option("subscribe", "fout")
            .load().selectExpr("CAST(value AS STRING) AS v").collect())
    got = Counter(r.v[:11] for r in rows)
    assert len(got) == n and max(got.values()) == 1
    # the failed attempt did send rows before it failed; they are in the log, aborted
    everything = (spark.read.format("ferrymq").option("servers", addr)
                  .option("subscribe", "fout").option("isolationLevel", "read_uncommitted")
                  .load().count())
    assert everything >= n + 30_000
