"""Model test (RELIABILITY T6): ``storage.Log`` against a list of batches.

Rules: append, read_from, flush, reopen (clean), crash (kill -9 plus a torn, possibly garbage
tail at or after the flushed size, then an unclean reopen), retention and truncate; small
segments make rolls frequent. Invariants: reads are the model's records, offsets contiguous,
everything flushed survives a crash.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ferrymq.protocol.records import RecordInput, decode_records, encode_batch, iter_batches
from ferrymq.storage import Log, LogConfig

CONFIG = LogConfig(segment_bytes=700, index_interval_bytes=96, retention_ms=None, retention_bytes=1500)


class LogModel(RuleBasedStateMachine):
    """Drives one ``Log`` and a list of ``(base_offset, bodies)`` batches side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="ferrymq-model-"))
        self.log, _ = Log.open(self.directory, CONFIG, clean_shutdown=False, now_ms=0)
        self.batches: list[tuple[int, list[bytes]]] = []
        self.start = 0
        self.end = 0
        self.synced = 0
        self.serial = 0
        self.now_ms = 0

    def teardown(self) -> None:
        self.log.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    # --- helpers ------------------------------------------------------------------------------

    def _records_from(self, offset: int) -> list[tuple[int, bytes]]:
        out = []
        for base, bodies in self.batches:
            if base + len(bodies) <= offset:
                continue
            out += [(base + i, body) for i, body in enumerate(bodies)]
        return out

    def _cut_model(self, end: int) -> None:
        assert any(base == end for base, _ in self.batches) or end == self.end, end
        self.batches = [(b, bodies) for b, bodies in self.batches if b < end]
        self.end = end
        self.synced = min(self.synced, end)

    # --- rules --------------------------------------------------------------------------------

    @rule(count=st.integers(1, 4), size=st.integers(0, 120), dt=st.integers(0, 50))
    def append(self, count: int, size: int, dt: int) -> None:
        self.now_ms += dt
        bodies = []
        for _ in range(count):
            self.serial += 1
            bodies.append(self.serial.to_bytes(4, "little") * (size // 4 + 1))
        batch = encode_batch([RecordInput(b, self.now_ms) for b in bodies])
        result = self.log.append(batch, now_ms=self.now_ms)
        assert result.base_offset == self.end
        assert result.last_offset == self.end + count - 1
        self.batches.append((self.end, bodies))
        self.end += count

    @rule(data=st.data(), max_bytes=st.integers(1, 2000))
    def read_from(self, data: st.DataObject, max_bytes: int) -> None:
        offset = data.draw(st.integers(self.start, self.end))
        raw = self.log.read(offset, max_bytes)
        if offset == self.end:
            assert raw == b""
            return
        got = [(r.offset, r.body) for r in decode_records(raw)]
        expected = self._records_from(offset)
        assert got, "at least one batch must be returned"
        assert got == expected[: len(got)]
        assert got[0][0] <= offset <= got[-1][0]
        batches = list(iter_batches(raw))
        assert sum(h.size for _p, h in batches) == len(raw)
        assert len(batches) == 1 or len(raw) <= max_bytes

    @rule()
    def flush(self) -> None:
        assert self.log.flush() == self.end
        assert self.log.durable_offset == self.end
        self.synced = self.end

    @rule()
    def reopen_clean(self) -> None:
        self.log.close()
        self.log, report = Log.open(self.directory, CONFIG, clean_shutdown=True, now_ms=0)
        assert report.truncated_bytes == 0
        self.synced = self.end

    @rule(data=st.data(), garbage=st.binary(max_size=100))
    def crash(self, data: st.DataObject, garbage: bytes) -> None:
        active = self.log.segments()[-1]
        active_path = self.directory / f"{active.base_offset:020d}.log"
        content = active_path.read_bytes()
        synced_pos = 0
        for pos, h in iter_batches(content):
            if h.base_offset < self.synced:
                synced_pos = pos + h.size
        for seg in self.log._segments:  # kill -9: no flush, no close, fds just vanish
            seg.close()
        cut = data.draw(st.integers(synced_pos, len(content)))
        with open(active_path, "r+b") as f:
            f.truncate(cut)
            f.seek(cut)
            f.write(garbage)
        expected_end = active.base_offset
        for _pos, h in iter_batches(content[:cut]):
            expected_end = h.last_offset + 1
        self.log, report = Log.open(self.directory, CONFIG, clean_shutdown=False, now_ms=0)
        assert report.end_offset == expected_end
        assert report.end_offset >= self.synced
        assert report.truncated_bytes == cut + len(garbage) - _valid_prefix(content[:cut])
        self._cut_model(expected_end)
        self.synced = self.end

    @rule(dt=st.integers(0, 1000))
    def retention(self, dt: int) -> None:
        self.now_ms += dt
        self.log.delete_old_segments(now_ms=self.now_ms)
        new_start = self.log.start_offset
        assert new_start >= self.start
        assert new_start == self.end or any(b == new_start for b, _ in self.batches)
        self.batches = [(b, bodies) for b, bodies in self.batches if b >= new_start]
        self.start = new_start

    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        offset = data.draw(st.integers(self.start, self.end))
        self.log.truncate_to(offset)
        expected = self.end
        for base, bodies in self.batches:
            if base <= offset < base + len(bodies):
                expected = base
        self._cut_model(min(expected, self.end))
        assert self.log.end_offset == self.end

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def offsets_match(self) -> None:
        assert self.log.start_offset == self.start
        assert self.log.end_offset == self.end
        assert self.log.durable_offset >= self.synced


def _valid_prefix(data: bytes) -> int:
    return sum(h.size for _p, h in iter_batches(data))


LogModel.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_log_model = LogModel.TestCase
