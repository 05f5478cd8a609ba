"""JSON log lines: the fields, ``extra=`` fields, tracebacks on one line, the setting's check."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from ferrymq.broker.config import load
from ferrymq.broker.logs import JsonFormatter
from ferrymq.errors import ConfigError


@pytest.fixture
def json_log() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("ferrymq.test.jsonlog")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield logger, out
    finally:
        logger.removeHandler(handler)


def _lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_record_is_one_json_object_with_time_level_logger_message(json_log) -> None:
    logger, out = json_log
    before = datetime.now(UTC)
    logger.warning("queue %s/%d is %d%% full", "orders", 3, 90)
    (rec,) = _lines(out)
    assert rec["level"] == "WARNING"
    assert rec["logger"] == "ferrymq.test.jsonlog"
    assert rec["message"] == "queue orders/3 is 90% full"
    stamp = str(rec["time"])
    assert stamp.endswith("Z") and "T" in stamp
    when = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    assert before - timedelta(seconds=1) <= when <= datetime.now(UTC)


def test_extra_fields_are_top_level_and_unserialisable_values_become_strings(json_log) -> None:
    logger, out = json_log

    class Peer:
        def __str__(self) -> str:
            return "10.0.0.7:51234"

    logger.info("group %s: %s joined", "billing", "m-1",
                extra={"group": "billing", "member": "m-1", "peer": Peer(), "queue": 2})
    (rec,) = _lines(out)
    assert rec["group"] == "billing" and rec["member"] == "m-1" and rec["queue"] == 2
    assert rec["peer"] == "10.0.0.7:51234"
    assert "args" not in rec and "msg" not in rec and "levelno" not in rec  # no record internals


def test_a_traceback_stays_on_one_line(json_log) -> None:
    logger, out = json_log
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        logger.exception("housekeeping failed")
    text = out.getvalue()
    assert text.count("\n") == 1  # one line, newlines inside escaped
    (rec,) = _lines(out)
    assert rec["level"] == "ERROR"
    assert "ValueError: bad\nvalue" in str(rec["exc_info"])


def test_log_format_is_text_by_default_and_checked() -> None:
    assert load().log_format == "text"
    assert load(env={"FERRYMQ_LOG_FORMAT": "json"}).log_format == "json"
    with pytest.raises(ConfigError, match="log_format must be one of"):
        load(overrides={"log_format": "xml"})
