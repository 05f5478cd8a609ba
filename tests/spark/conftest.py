"""Fixtures of the Spark tests: one real local Spark (``local[2]``) and one real broker per
module (a JVM start costs seconds). Helpers are in ``tests/spark/helpers.py``."""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from ferrymq import Broker
from tests.helpers import REQUIRE_ALL_TESTS
from tests.spark.helpers import spark_session

_JVM_MODULES = ["test_read.py", "test_sink.py", "test_exactly_once.py", "test_sink_recovery.py",
                "test_workers_python.py", "test_example_pipeline.py",
                "test_security.py", "test_cluster.py"]
_MISSING = ("pyspark, pyarrow or numpy" if not all(
    importlib.util.find_spec(m) for m in ("pyspark", "pyarrow", "numpy"))
    else "java" if shutil.which("java") is None and not os.environ.get("JAVA_HOME") else "")
if _MISSING and REQUIRE_ALL_TESTS:
    raise RuntimeError(f"the Spark tests need {_MISSING}, and FERRYMQ_REQUIRE_ALL_TESTS is set")
if _MISSING.startswith("pyspark"):
    collect_ignore_glob = ["test_*.py"]  # pip install -e '.[test]' brings them
elif _MISSING:
    collect_ignore_glob = _JVM_MODULES  # Spark needs a JVM (Java 17+)


@pytest.fixture(scope="module")
def spark(request: pytest.FixtureRequest) -> Iterator[Any]:
    """One SparkSession per test module."""
    session = spark_session(request.module.__name__,
                            getattr(request.module, "SPARK_MASTER", "local[2]"))
    try:
        yield session
    finally:
        for q in session.streams.active:
            q.stop()
        session.stop()


@pytest.fixture(scope="module", autouse=True)
def _close_wire_connections() -> Iterator[None]:
    """The connector's per-process connection cache, emptied after each module (the tests call
    task and driver code in this process)."""
    yield
    from ferrymq.spark import _wire

    for config in list(_wire._CACHE):
        _wire.forget(config)


@pytest.fixture(scope="module")
def module_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A real in-process broker shared by a module's tests (each test uses its own topics)."""
    b = Broker(tmp_path_factory.mktemp("broker") / "data", port=0).start()
    try:
        yield b
    finally:
        b.stop()
