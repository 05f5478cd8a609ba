"""Which Python Spark's workers run: a job started as ``.venv/bin/python job.py`` without an
activated venv (``python3`` on PATH lacks FerryMQ) still finds ``format("ferrymq")``.

Spark's Python workers run ``PYSPARK_PYTHON``, else ``python3`` from PATH. The installed
``ferrymq-spark-python.pth`` sets ``PYSPARK_PYTHON`` to the interpreter itself when it is unset.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ferrymq import Broker
from tests.spark.helpers import produce


def _env_without_spark_python(tmp_path: Path) -> dict[str, str]:
    """The environment of a newcomer's shell: no PYSPARK_* variables, and ``python3`` on PATH
    is the base interpreter of this venv, which cannot import FerryMQ."""
    base = getattr(sys, "_base_executable", sys.executable)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(base)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYSPARK_") and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_interpreter_start_points_spark_workers_at_itself(tmp_path: Path) -> None:
    env = _env_without_spark_python(tmp_path)
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ['PYSPARK_PYTHON'])"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == sys.executable
    # an explicit setting wins
    env["PYSPARK_PYTHON"] = "/opt/cluster/python"
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ['PYSPARK_PYTHON'])"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "/opt/cluster/python"


def test_job_run_by_the_venv_python_without_activation_reads_ferrymq(tmp_path: Path) -> None:
    env = _env_without_spark_python(tmp_path)
    python3_on_path = subprocess.run(["python3", "-c", "import ferrymq"], env=env,
                                     capture_output=True, timeout=60)
    assert python3_on_path.returncode != 0, "python3 on PATH must lack FerryMQ for this test"
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent("""
        import sys
        from pyspark.sql import SparkSession
        spark = (SparkSession.builder.master("local[1]").appName("newcomer")
                 .config("spark.driver.host", "127.0.0.1")
                 .config("spark.driver.bindAddress", "127.0.0.1")
                 .config("spark.ui.enabled", "false").getOrCreate())
        df = (spark.read.format("ferrymq").option("servers", sys.argv[1])
              .option("subscribe", "newcomer").option("startingOffsets", "earliest").load())
        print("ROWS", df.count())
        spark.stop()
    """))
    with Broker(tmp_path / "data", port=0) as broker:
        produce(broker.address, "newcomer", [b"a", b"b", b"c"])
        env.update(SPARK_LOCAL_IP="127.0.0.1", SPARK_LOCAL_HOSTNAME="localhost")
        out = subprocess.run([sys.executable, str(job), broker.address], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ROWS 3" in out.stdout
