"""Fixtures for storage unit tests: batch factory and log opener on ``tmp_path``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from storage_support import BatchFactory, LogOpener, build_batch

from ferrymq.storage import Log, LogConfig, RecoveryReport


@pytest.fixture
def make_batch() -> BatchFactory:
    return build_batch


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "queue-0"


@pytest.fixture
def open_log(log_dir: Path) -> Iterator[LogOpener]:
    """Open the log in ``log_dir``; every log opened is closed at teardown."""
    opened: list[Log] = []

    def _open(
        config: LogConfig | None = None, *, clean: bool = True, now_ms: int = 0
    ) -> tuple[Log, RecoveryReport]:
        log, report = Log.open(log_dir, config or LogConfig(), clean_shutdown=clean, now_ms=now_ms)
        opened.append(log)
        return log, report

    yield _open
    for log in opened:
        log.close()
