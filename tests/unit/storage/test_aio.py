"""Several fsyncs in one native AIO submission (ferrymq.storage.aio), and its fallback."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq.storage.aio import AioFsync

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux AIO")


@pytest.fixture
def aio() -> Iterator[AioFsync]:
    a = AioFsync.open(3)
    if a is None:
        pytest.skip("native AIO is not available here")
    try:
        yield a
    finally:
        a.close()


def _files(tmp_path: Path, n: int) -> list[int]:
    fds = []
    for i in range(n):
        fd = os.open(tmp_path / f"f{i}", os.O_CREAT | os.O_WRONLY | os.O_APPEND)
        os.write(fd, b"x" * 100)
        fds.append(fd)
    return fds


def _closed_fd(tmp_path: Path) -> int:
    fd = os.open(tmp_path / "closed", os.O_CREAT | os.O_WRONLY)
    os.close(fd)
    return fd


def test_every_descriptor_gets_its_own_result(aio: AioFsync, tmp_path: Path) -> None:
    fds = _files(tmp_path, 7)  # more than max_parallel: three submissions
    try:
        assert aio.fsync(fds) == [0] * 7
        assert aio.supported
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("where", [0, 1, 2])
def test_a_failed_fsync_is_reported_for_its_descriptor_only(
        aio: AioFsync, tmp_path: Path, where: int) -> None:
    fds = _files(tmp_path, 2)
    try:
        batch = list(fds)
        batch.insert(where, _closed_fd(tmp_path))  # io_submit stops at it; the rest go one by one
        expected = [0, 0]
        expected.insert(where, errno.EBADF)
        assert aio.fsync(batch) == expected
        assert aio.fsync(fds) == [0, 0]  # and the context still works
    finally:
        for fd in fds:
            os.close(fd)


def test_without_aio_support_fsyncs_run_one_by_one(aio: AioFsync, tmp_path: Path) -> None:
    fds = _files(tmp_path, 2)
    try:
        aio.supported = False  # as after the kernel refused IOCB_CMD_FSYNC
        assert aio.fsync([fds[0], _closed_fd(tmp_path), fds[1]]) == [0, errno.EBADF, 0]
    finally:
        for fd in fds:
            os.close(fd)


def test_open_refuses_a_context_of_no_slots() -> None:
    assert AioFsync.open(0) is None
