"""sd_notify over real AF_UNIX datagram sockets: a path, an abstract name, failures that do not
raise."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq.broker.sdnotify import READY, sd_notify


@pytest.fixture
def receiver() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.settimeout(5)
    try:
        yield sock
    finally:
        sock.close()


def test_notifies_a_socket_path(tmp_path: Path, receiver: socket.socket) -> None:
    path = str(tmp_path / "notify")
    receiver.bind(path)
    assert sd_notify(path, READY, "STATUS=serving")
    assert receiver.recv(4096) == b"READY=1\nSTATUS=serving"


def test_notifies_an_abstract_socket_written_with_at(receiver: socket.socket) -> None:
    name = f"ferrymq-test-{os.getpid()}-{id(receiver)}"
    receiver.bind(b"\0" + name.encode())
    assert sd_notify("@" + name, READY)
    assert receiver.recv(4096) == b"READY=1"


def test_no_socket_is_a_no_op_and_a_dead_one_is_logged_not_raised(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert not sd_notify(None, READY)
    assert not sd_notify("", READY)
    assert not sd_notify(str(tmp_path / "nobody-listens"), READY)
    assert "cannot notify systemd" in caplog.text
    assert not sd_notify("relative/path", READY)
    assert "neither a path nor an abstract socket name" in caplog.text
