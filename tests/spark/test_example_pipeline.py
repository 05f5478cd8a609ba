"""examples/pipeline/README.md step by step, as a newcomer runs it after the README: the venv's
programs called by path (no activated venv, no PYSPARK_* variables), on a broker where the
README's own ``orders`` topic exists already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ferrymq import AdminClient, Broker

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pipeline"
BIN = Path(sys.executable).parent


def _run(args: list[str], cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env.update(SPARK_LOCAL_IP="127.0.0.1", SPARK_LOCAL_HOSTNAME="localhost")
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{args}: {out.stderr[-3000:]}"
    return out.stdout


def test_pipeline_readme_steps(tmp_path: Path) -> None:
    with Broker(tmp_path / "data", port=0) as broker:
        addr = broker.address
        with AdminClient(addr) as admin:
            admin.create_topic("orders", 8)  # what following the main README left behind
        ferrymq = str(BIN / "ferrymq")
        _run([ferrymq, "--server", addr, "topic", "create", "pipeline-orders", "--queues", "3"],
             tmp_path)
        _run([ferrymq, "--server", addr, "topic", "create", "pipeline-revenue", "--queues", "2"],
             tmp_path)
        _run([sys.executable, str(EXAMPLE / "generator.py"), "--servers", addr, "--orders", "3000"],
             tmp_path)
        _run([sys.executable, str(EXAMPLE / "job.py"), "--servers", addr, "--work", "work",
              "--available-now"], tmp_path)
        printed = _run([sys.executable, str(EXAMPLE / "consumer.py"), "--servers", addr], tmp_path)
    windows = [line for line in printed.splitlines() if line.startswith("2026-11-21T10:")]
    # 6 minutes of orders, the watermark closes the first 4 (or 5) minutes; 5 categories
    assert len(windows) >= 4 * 3, printed
    # the aggregate's state was planned with the job's shuffle partitions, not Spark's 200
    first = (tmp_path / "work" / "chk-ferrymq" / "offsets" / "0").read_text().splitlines()
    conf = json.loads(first[1])["conf"]
    assert conf["spark.sql.shuffle.partitions"] == "4"
