"""Shared fixtures: real brokers (in-process or subprocess) on free ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq import Broker
from tests.helpers import BrokerProcess


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    """A real in-process broker (sync flush) on a free port."""
    b = Broker(tmp_path / "data", port=0).start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def broker_process(tmp_path: Path) -> Iterator[BrokerProcess]:
    """A broker subprocess (``ferrymq broker``) that tests may kill -9 and restart."""
    bp = BrokerProcess(tmp_path / "data")
    try:
        yield bp
    finally:
        if bp.proc is not None and bp.proc.poll() is None:
            bp.proc.kill()
            bp.proc.wait(10)
