"""The one broker launcher of tests and benchmarks (:class:`ferrymq.testing.BrokerProcess`)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ferrymq import AdminClient
from ferrymq.testing import BrokerProcess, free_port

pytestmark = pytest.mark.integration


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_scratch_data_dir_is_removed_after_a_graceful_stop() -> None:
    bp = BrokerProcess(flush="async").start()
    scratch = bp.data_dir.parent
    with AdminClient(bp.address) as admin:
        admin.create_topic("t", queues=1)
    assert any(bp.data_dir.iterdir())
    assert "listening on" in bp.log_text()
    bp.stop()
    assert bp.proc is not None and bp.proc.returncode == 0
    assert not scratch.exists()


def test_quiet_broker_is_seen_listening_on_its_port(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data", log_level="WARNING") as bp:
        assert "listening on" not in bp.log_text()
        with AdminClient(bp.address) as admin:
            assert admin.list_topics() == []


def test_restart_after_kill9_keeps_port_and_log(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data") as bp:
        port, first = bp.port, bp.pid
        bp.kill9()
        bp.start()
        assert bp.port == port and bp.pid != first and bp.starts == 2
        assert bp.log_text().count("listening on") == 2
        assert "--- start 2" in bp.log_text()
    assert bp.proc is not None and bp.proc.poll() is not None  # the block killed it


def test_a_broker_that_cannot_start_is_reported_with_its_log(tmp_path: Path) -> None:
    bp = BrokerProcess(tmp_path / "data", extra=["--flush", "sometimes"])
    with pytest.raises(RuntimeError, match=r"(?s)broker exited with 2:.*sometimes"):
        bp.start(timeout=30)
