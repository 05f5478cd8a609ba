"""``Type=notify``: a real broker process tells a real AF_UNIX socket READY=1 once it serves
(after recovery) and STOPPING=1 when SIGTERM starts its shutdown."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ferrymq import AdminClient
from tests.helpers import BrokerProcess

pytestmark = pytest.mark.integration


def _receive(sock: socket.socket, timeout: float = 30.0) -> dict[str, str]:
    sock.settimeout(timeout)
    fields = {}
    for line in sock.recv(4096).decode().splitlines():
        key, _, value = line.partition("=")
        fields[key] = value
    return fields


def test_broker_says_ready_after_recovery_and_stopping_at_sigterm(tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        bp = BrokerProcess(tmp_path / "data", env={"NOTIFY_SOCKET": str(path)})
        with bp:
            ready = _receive(sock)
            assert ready["READY"] == "1"
            assert ready["STATUS"] == f"serving on 127.0.0.1:{bp.port}"
            with AdminClient(bp.address) as admin:  # ready means it answers
                admin.list_topics()
            sock.settimeout(0.2)
            with pytest.raises(TimeoutError):  # one READY, nothing else while it serves
                sock.recv(4096)
            assert bp.proc is not None
            bp.proc.send_signal(15)
            assert _receive(sock)["STOPPING"] == "1"
            assert bp.proc.wait(30) == 0
        # after a restart (recovery of the same files) it says READY again
        with bp:
            assert _receive(sock)["READY"] == "1"
