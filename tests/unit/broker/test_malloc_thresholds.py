"""glibc malloc's thresholds, as the ``ferrymq broker`` process sets them: megabyte blocks
allocated and freed per request come from the heap and are reused, not mapped again each time
(each mapping costs a page fault per page on first touch)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from ferrymq.broker.config import BrokerConfig
from ferrymq.broker.heap import MAX_MALLOC_MMAP_THRESHOLD, tune_malloc
from ferrymq.errors import ConfigError

_FAULTS = """
import resource, sys
from ferrymq.broker.heap import tune_malloc
if sys.argv[1] == "tuned":
    assert tune_malloc(32 * 1024 * 1024, 64 * 1024 * 1024)
def request():  # what a Kafka fetch does: four 1 MB reads of the log, a 4 MB answer, all freed
    reads = [bytearray(1 << 20) for _ in range(4)]
    answer = bytearray(4 << 20)
    del reads, answer
for _ in range(3):  # warm up: the heap grows once
    request()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    request()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="needs glibc's malloc")


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True,
                         check=True, timeout=60)
    return int(out.stdout)


@glibc
def test_tuned_thresholds_reuse_large_blocks_instead_of_faulting_them_in_again() -> None:
    untuned, tuned = _faults("default"), _faults("tuned")
    assert untuned > 20 * 1000  # 8 MB freed at the top of the heap is given back each time
    assert tuned < 500


def test_nothing_asked_nothing_set() -> None:
    assert tune_malloc(0, 0) is False


def test_the_thresholds_are_checked() -> None:
    BrokerConfig(malloc_mmap_threshold_bytes=0, malloc_trim_threshold_bytes=0).validate()
    with pytest.raises(ConfigError, match=r"malloc_mmap_threshold_bytes must be 0\.\.33554432"):
        BrokerConfig(malloc_mmap_threshold_bytes=MAX_MALLOC_MMAP_THRESHOLD + 1).validate()
    with pytest.raises(ConfigError, match="malloc_trim_threshold_bytes"):
        BrokerConfig(malloc_trim_threshold_bytes=-1).validate()
