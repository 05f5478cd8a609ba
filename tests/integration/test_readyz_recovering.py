"""``/readyz`` while a real broker process recovers its data directory: the HTTP listener
answers before recovery (503 "recovering", ``/healthz`` 200), readiness and systemd's READY=1
come only once the logs are recovered. The ``hold_recovery_file`` fault holds recovery."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ferrymq import AdminClient, Message, Producer
from ferrymq._faults import Faults
from tests.helpers import BrokerProcess, free_port, wait_for

pytestmark = pytest.mark.integration


def get(port: int, path: str) -> tuple[int, bytes] | None:
    """Status and body of GET ``path``; None while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError):
        return None


def test_readyz_says_recovering_until_the_logs_are_recovered(tmp_path: Path) -> None:
    http_port = free_port()
    bp = BrokerProcess(tmp_path / "data", extra=["--http-port", str(http_port)])
    with bp:
        with AdminClient(bp.address) as admin:
            admin.create_topic("rec", 2)
        with Producer(bp.address) as p:
            for i in range(20):
                p.send(Message("rec", f"m{i}", sharding_key=str(i)))
        bp.kill9()  # an unclean stop: the next start recovers the logs

    hold = tmp_path / "hold"
    hold.touch()
    notify = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(notify))
        bp.faults = Faults(hold_recovery_file=str(hold))
        bp.env = {"NOTIFY_SOCKET": str(notify)}
        started: list[BaseException | None] = []

        def start() -> None:
            try:
                bp.start(timeout=60)
                started.append(None)
            except BaseException as exc:  # reported by the assertion below
                started.append(exc)

        starter = threading.Thread(target=start)
        starter.start()
        try:
            wait_for(lambda: get(http_port, "/readyz") is not None, timeout=30)
            status, body = get(http_port, "/readyz") or (0, b"")
            assert status == 503
            answer = json.loads(body)
            assert answer["ready"] is False
            assert answer["reasons"] == ["recovering the data directory"]
            assert get(http_port, "/healthz") == (200, b"ok\n")  # the loop answers meanwhile
            assert (get(http_port, "/metrics") or (0, b""))[0] == 503
            sock.settimeout(0.3)
            with pytest.raises(TimeoutError):  # no READY=1 while recovering
                sock.recv(4096)
            assert not started

            hold.unlink()
            wait_for(lambda: (get(http_port, "/readyz") or (0, b""))[0] == 200, timeout=30)
            sock.settimeout(30)
            assert b"READY=1" in sock.recv(4096)
            starter.join(60)
            assert started == [None]
            with AdminClient(bp.address) as admin:
                assert sum(q.end_offset for q in admin.describe_topic("rec").queues) == 20
        finally:
            hold.unlink(missing_ok=True)
            starter.join(60)
            bp.terminate()
