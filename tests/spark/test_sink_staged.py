"""The transactional sink's broker protocol, called the way Spark calls it (task-side ``write``
on one writer, ``commit``/``abort`` on fresh writers, as Spark's driver does), against a real
broker; no JVM needed. The Spark runs are in ``test_sink.py`` and ``test_sink_recovery.py``."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql.types import BinaryType, StructField, StructType

from ferrymq import AdminClient, Broker
from ferrymq.errors import StagedTxnExpiredError
from ferrymq.protocol.messages import TxnState
from ferrymq.spark.sink import (
    FerryMQStreamWriter,
    SinkCommitMessage,
    TaskInfo,
    last_committed_batch,
    transactional_id,
    write_rows,
)
from tests.helpers import read_topic
from tests.spark.helpers import create_topic

pytestmark = pytest.mark.integration
SCHEMA = StructType([StructField("value", BinaryType())])


def _rows(*values: str) -> Any:
    return iter([pa.record_batch([pa.array([v.encode() for v in values])], names=["value"])])


def _task(options: dict[str, str], batch: int, partition: int, *values: str,
          attempt: int = 0) -> SinkCommitMessage:
    writer = FerryMQStreamWriter(options, SCHEMA)  # Spark pickles one per micro-batch
    return write_rows(writer.opts, _rows(*values), fence=writer.fence, sink=writer.sink,
                      task=TaskInfo(partition, attempt, batch))


def _bodies(addr: str, topic: str, *, isolation: str = "read_committed") -> list[bytes]:
    return sorted(m.body for m in read_topic(addr, topic, quiet=0.4, isolation=isolation))


def test_staged_rows_are_invisible_until_the_driver_commits(module_broker: Broker) -> None:
    addr = module_broker.address
    create_topic(addr, "st1", 2)
    opts = {"servers": addr, "topic": "st1", "checkpointlocation": "/chk/st1"}
    a = _task(opts, 0, 0, "a1", "a2")
    b = _task(opts, 0, 1, "b1")
    assert a.handle is not None and a.handle[0] == transactional_id("/chk/st1", 0, 0)
    assert _bodies(addr, "st1") == []  # staged: durable but invisible to read_committed
    assert _bodies(addr, "st1", isolation="read_uncommitted") == [b"a1", b"a2", b"b1"]
    FerryMQStreamWriter(opts, SCHEMA).commit([a, b], 0)
    assert _bodies(addr, "st1") == [b"a1", b"a2", b"b1"]
    assert last_committed_batch(FerryMQStreamWriter(opts, SCHEMA).opts.wire, "/chk/st1") == 0
    # the next batch reuses the transactional ids (one per partition and attempt)
    c = _task(opts, 1, 0, "c1")
    assert c.handle is not None and c.handle[0] == a.handle[0] and c.handle[2] > a.handle[2]
    FerryMQStreamWriter(opts, SCHEMA).commit([c, SinkCommitMessage(1)], 1)
    assert _bodies(addr, "st1") == [b"a1", b"a2", b"b1", b"c1"]


def test_replayed_batch_is_dropped_whole(module_broker: Broker) -> None:
    addr = module_broker.address
    create_topic(addr, "st2", 2)
    opts = {"servers": addr, "topic": "st2", "checkpointlocation": "/chk/st2"}
    first = [_task(opts, 5, 0, "x1"), _task(opts, 5, 1, "x2")]
    FerryMQStreamWriter(opts, SCHEMA).commit(first, 5)
    # a replay of batch 5 (driver killed after the broker commit, before Spark's commit log):
    # its tasks see the batch committed and write nothing
    replay = _task(opts, 5, 0, "x1")
    assert replay.skipped and replay.handle is None
    FerryMQStreamWriter(opts, SCHEMA).commit([replay], 5)
    # tasks that staged before the first commit landed (a zombie run of batch 6 racing this
    # one): the second commit of the batch is refused by the broker, which the sink takes as
    # success, and its rows are dropped
    run1 = [_task(opts, 6, 0, "y1"), _task(opts, 6, 1, "y2")]
    run2 = [_task(opts, 6, 0, "y1", attempt=1), _task(opts, 6, 1, "y2", attempt=1)]
    FerryMQStreamWriter(opts, SCHEMA).commit(run1, 6)
    FerryMQStreamWriter(opts, SCHEMA).commit(run2, 6)  # BATCH_ALREADY_COMMITTED: no error
    assert _bodies(addr, "st2") == [b"x1", b"x2", b"y1", b"y2"]
    # run2's rows did reach the log, and stay invisible (aborted)
    assert _bodies(addr, "st2", isolation="read_uncommitted").count(b"y1") == 2


def test_abort_drops_staged_rows_and_never_committed_ones(module_broker: Broker) -> None:
    addr = module_broker.address
    create_topic(addr, "st3", 1)
    opts = {"servers": addr, "topic": "st3", "checkpointlocation": "/chk/st3"}
    done = _task(opts, 0, 0, "kept")
    FerryMQStreamWriter(opts, SCHEMA).commit([done], 0)
    FerryMQStreamWriter(opts, SCHEMA).abort([done], 0)  # Spark may abort after a commit
    staged = [_task(opts, 1, 0, "gone1"), _task(opts, 1, 1, "gone2")]
    FerryMQStreamWriter(opts, SCHEMA).abort([staged[0], None], 1)
    with pytest.raises(StagedTxnExpiredError):  # nothing of an aborted batch can commit later
        FerryMQStreamWriter(opts, SCHEMA).commit(staged, 1)
    assert _bodies(addr, "st3") == [b"kept"]
    assert _bodies(addr, "st3", isolation="read_uncommitted") == [b"gone1", b"gone2", b"kept"]
    with AdminClient(addr) as admin:  # no transaction of the sink is left open
        txns = [t for p in (0, 1) for t in admin.describe_transactions(
            transactional_id("/chk/st3", p, 0)).txns]
    assert len(txns) == 2 and all(t[3] == TxnState.COMPLETE_ABORT for t in txns), txns


def test_retry_aborts_the_open_transaction_of_a_dead_attempt(module_broker: Broker) -> None:
    """A worker killed mid-write leaves its transaction open, holding back read_committed
    readers of the queue; the retried attempt aborts it before writing."""
    from ferrymq.spark.sink import TaskProducer

    addr = module_broker.address
    create_topic(addr, "st4", 1)
    opts = {"servers": addr, "topic": "st4", "checkpointlocation": "/chk/st4"}
    writer = FerryMQStreamWriter(opts, SCHEMA)
    assert writer.sink is not None
    dead = TaskProducer(writer.opts, 0, transactional_id=transactional_id(writer.sink, 0, 0))
    for rb in _rows("half1", "half2"):
        dead.add(rb)
    dead.flush()  # sent, never staged: the "worker" dies here
    assert _bodies(addr, "st4", isolation="read_uncommitted") == [b"half1", b"half2"]
    retry = _task(opts, 0, 0, "whole", attempt=1)
    FerryMQStreamWriter(opts, SCHEMA).commit([retry], 0)
    assert _bodies(addr, "st4") == [b"whole"]  # the LSO is not held by the dead attempt
