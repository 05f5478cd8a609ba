"""The ``ferrymq`` commands' own parameter types: a position (``earliest``, ``latest``, an offset,
an ISO-8601 time) and ``KEY=VALUE``."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any, Literal

import click


@dataclass(frozen=True, slots=True)
class Position:
    """Where to start or move to: ``earliest``, ``latest``, an ``offset`` or a ``time`` (ms)."""

    kind: Literal["earliest", "latest", "offset", "time"]
    value: int = 0


def parse_time_ms(text: str) -> int:
    """ISO-8601 time to ms since the epoch; a time without a zone is local time.

    Raises:
        ValueError: not an ISO-8601 date or time.
    """
    dt = _dt.datetime.fromisoformat(text)
    if dt.tzinfo is None:
        dt = dt.astimezone()
    return int(dt.timestamp() * 1000)


class PositionType(click.ParamType[Position]):
    """``earliest``, ``latest``, an ISO-8601 time, and (if allowed) an offset."""

    def __init__(self, allow_offset: bool) -> None:
        self.allow_offset = allow_offset
        self.name = ("earliest|latest|OFFSET|ISO-TIME" if allow_offset
                     else "earliest|latest|ISO-TIME")

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Position:
        """Parse the option value."""
        if isinstance(value, Position):
            return value
        text = str(value).strip()
        if text in ("earliest", "latest"):
            return Position(text)  # type: ignore[arg-type]
        if self.allow_offset and text.isdigit():
            return Position("offset", int(text))
        try:
            return Position("time", parse_time_ms(text))
        except ValueError:
            self.fail(f"{text!r} is not {self.name.replace('|', ', ')}", param, ctx)


class KeyValueType(click.ParamType[tuple[str, str]]):
    """``key=value`` (the value may contain ``=``)."""

    name = "KEY=VALUE"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> tuple[str, str]:
        """Split at the first ``=``."""
        if isinstance(value, tuple):
            return value
        key, sep, val = str(value).partition("=")
        if not sep or not key:
            self.fail(f"{value!r} is not KEY=VALUE", param, ctx)
        return key, val


KEY_VALUE = KeyValueType()
