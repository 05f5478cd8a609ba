"""A ``ferrymq`` sink that SIGKILLs its whole query (driver JVM, Python workers) right after the
broker committed micro-batch N, before Spark writes ``commits/N``: the crash window the
transactional sink's (sink id, batch id) fence is for. Used by ``sink_job.py``.

Options on top of the ferrymq sink's: ``test.crashAfterBatch`` (N) and ``test.crashMarker`` (a
file created just before the kill; no crash when it exists, so the restarted query runs on)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from ferrymq.spark.sink import FerryMQStreamWriter
from ferrymq.spark.source import FerryMQDataSource


def kill_my_session() -> None:
    """SIGKILL every process of this process's session, this one last."""
    sid, me = os.getsid(0), os.getpid()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        if int(fields[3]) == sid and pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    os.kill(me, signal.SIGKILL)


class CrashingStreamWriter(FerryMQStreamWriter):
    """Commits like the ferrymq sink, then dies at the configured batch."""

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        super().__init__(options, schema)
        self.crash_batch = int(options.get("test.crashafterbatch", "-1"))
        self.marker = Path(options.get("test.crashmarker", "/nonexistent/marker"))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        super().commit(messages, batchId)
        if batchId == self.crash_batch and not self.marker.exists():
            self.marker.write_text(str(batchId))
            kill_my_session()


class CrashingDataSource(FerryMQDataSource):
    """``format("ferrymq_crashing")``."""

    @classmethod
    def name(cls) -> str:
        return "ferrymq_crashing"

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamArrowWriter:
        opts: dict[str, Any] = {str(k).lower(): str(v) for k, v in self.options.items()}
        return CrashingStreamWriter(opts, schema)
