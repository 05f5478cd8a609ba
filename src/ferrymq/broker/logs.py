"""The broker's log output: plain text lines (the default) or one JSON object per line.

``log_format = "json"`` writes each record as one JSON object on one line, for log shippers
(Loki, Elasticsearch, CloudWatch) that would otherwise parse text with regular expressions::

    {"time": "2026-11-26T22:40:01.123Z", "level": "INFO", "logger": "ferrymq.broker.server",
     "message": "retention deleted 2 segments of orders/0", "topic": "orders", "queue": 0}

``time`` is ISO 8601 in UTC with milliseconds, ``level`` the level's name, ``logger`` the
logger's dotted name, ``message`` the formatted message; a traceback goes in ``exc_info`` (one
string, newlines escaped, so the line stays one line). Every field a log call passes with
``extra={...}`` (``topic``, ``group``, ``peer``, ...) is added under its own name; a value JSON
cannot hold is written as its ``str()``. The standard library's :mod:`logging` does all of it:
no dependency.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# the attributes every LogRecord has; anything else on a record came from ``extra=``
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON (see the module docstring for the fields)."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one JSON object, without a newline."""
        seconds = int(record.created)
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure_logging(level: str, log_format: str = "text") -> None:
    """Send the process's logs to stderr at ``level``, as text lines or JSON lines.

    Replaces the root logger's handlers (the broker owns its process's logging).
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
