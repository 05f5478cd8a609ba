"""``ferrymq broker --log-format json``: every line the broker writes is one JSON object, the start
lines carry the data directory, flush mode and address, and connection logs carry the peer."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.helpers import BrokerProcess, wait_for

pytestmark = pytest.mark.integration


def _records(text: str) -> list[dict[str, object]]:
    lines = [line for line in text.splitlines() if not line.startswith("--- start")]  # launcher's
    return [json.loads(line) for line in lines if line.strip()]


def test_json_logs_from_start_to_clean_stop(tmp_path: Path) -> None:
    bp = BrokerProcess(tmp_path / "data", flush="async", extra=["--log-format", "json"])
    with bp:
        with socket.create_connection(("127.0.0.1", bp.port)) as raw:
            raw.sendall(b"\x00\x00\x00\x01" + b"\x00" * 8)  # a frame shorter than a header
            raw.settimeout(5)
            while raw.recv(4096):
                pass
        wait_for(lambda: "closing connection" in bp.log_text())
        bp.stop()
        records = _records(bp.log_text())  # raises if any line is not JSON
    assert {"time", "level", "logger", "message"} <= set(records[0])
    (started,) = [r for r in records if "listening on" in str(r["message"])]
    assert started["address"] == f"127.0.0.1:{bp.port}"
    assert started["data_dir"] == str((tmp_path / "data").resolve())
    assert started["flush"] == "async"
    assert started["logger"] == "ferrymq.broker" and started["level"] == "INFO"
    closing = [r for r in records if str(r["message"]).startswith("closing connection")]
    assert closing and str(closing[0]["peer"]).startswith("127.0.0.1:")
    assert records[-1]["message"] == "stopped cleanly"
