"""The broker's own appends (a scheduled message falling due, a half message's commit, a
transaction marker) go only into queues it may write: a single broker's, its internal topics,
and of a cluster's queues only those it leads."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrymq.broker.topics import CLUSTER_TOPIC_ID_BASE, QueueState
from ferrymq.cluster.replication.manager import OfflineQueue
from ferrymq.errors import NotLeaderError
from ferrymq.storage import Log, LogConfig


@pytest.fixture
def log(tmp_path: Path) -> Log:
    lg, _ = Log.open(tmp_path / "q", LogConfig(), clean_shutdown=True, now_ms=0)
    return lg


def test_a_single_brokers_queue_and_an_internal_topic_are_written(log: Log) -> None:
    QueueState("orders", 1, 0, log, 0).check_own_write()
    QueueState("%TXN%state", 2, 0, log, 0).check_own_write()


def test_a_cluster_queue_without_a_role_here_is_refused(log: Log) -> None:
    qs = QueueState("orders", CLUSTER_TOPIC_ID_BASE, 0, log, 0)
    with pytest.raises(NotLeaderError):
        qs.check_own_write()


def test_a_cluster_queue_this_broker_does_not_lead_is_refused(log: Log) -> None:
    qs = QueueState("orders", CLUSTER_TOPIC_ID_BASE + 1, 0, log, 0)
    qs.replica = OfflineQueue(2, qs)
    with pytest.raises(NotLeaderError):
        qs.check_own_write()
