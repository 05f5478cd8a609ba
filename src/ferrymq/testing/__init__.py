"""A public test kit for FerryMQ users: a real broker in this process (a pytest fixture) or in a
subprocess (:class:`BrokerProcess`, to kill -9 and restart, with :class:`Faults` injected),
etcd members for cluster tests (:class:`EtcdProcess`, :class:`EtcdCluster`), etcd with N brokers
(:class:`ClusterProcess`), free ports, a fake clock.

It is a pytest plugin, registered through the ``pytest11`` entry point: with FerryMQ installed,
its fixtures are there in every test, with no ``pytest_plugins`` line (an old
``pytest_plugins = ["ferrymq.testing"]`` still works; ``-p no:ferrymq`` turns it off)::

    def test_orders(ferrymq_broker):            # a new broker for this test
        with Producer(ferrymq_broker.address) as p:
            ...

    def test_reports(ferrymq_session_broker):   # one broker shared by the whole session
        ...

A session-scoped broker is faster when many tests need one; they then share its topics and
groups, so such tests should use names of their own (``f"orders-{uuid4()}"``).

The broker is real (real files in ``tmp_path``, a real socket on a free port); nothing is mocked.
Importing this module does not load the broker (a test that only needs :class:`FakeClock` stays
light): :func:`start_broker` imports it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ferrymq._cluster_launcher import ClusterProcess
from ferrymq._etcd_launcher import ETCD_INSTALL_HINT, EtcdCluster, EtcdProcess, etcd_binary
from ferrymq._faults import NO_FAULTS, Faults
from ferrymq._launcher import BrokerProcess, free_port

if TYPE_CHECKING:
    from ferrymq.broker.embedded import Broker

__all__ = ["ETCD_INSTALL_HINT", "NO_FAULTS", "BrokerProcess", "ClusterProcess", "EtcdCluster",
           "EtcdProcess", "FakeClock", "Faults", "etcd_binary", "ferrymq_broker",
           "ferrymq_session_broker", "free_port", "start_broker"]


@dataclass
class FakeClock:
    """A clock tests move by hand (``advance``); satisfies :class:`ferrymq._time.Clock`."""

    now_s: float = 1_000.0
    wall_offset_ms: int = 1_700_000_000_000

    def monotonic(self) -> float:
        """The fake monotonic time in seconds."""
        return self.now_s

    def wall_ms(self) -> int:
        """The fake wall time in ms."""
        return self.wall_offset_ms + int(self.now_s * 1000)

    def advance(self, seconds: float) -> None:
        """Move time forward."""
        self.now_s += seconds


def start_broker(data_dir: Path, **config: Any) -> Broker:
    """Start an in-process broker on a free port; stop it with ``.stop()``."""
    from ferrymq.broker.embedded import Broker

    return Broker(data_dir, port=0, **config).start()


@pytest.fixture
def ferrymq_broker(tmp_path: Path) -> Iterator[Broker]:
    """A real broker in this process on a free port, data in ``tmp_path``."""
    broker = start_broker(tmp_path / "ferrymq-data")
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def ferrymq_session_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One real broker for the whole test session (started on first use), data in a session
    temporary directory: tests using it share its topics and groups."""
    broker = start_broker(tmp_path_factory.mktemp("ferrymq-session") / "ferrymq-data")
    try:
        yield broker
    finally:
        broker.stop()
