"""Per-topic settings: their names, allowed ranges and parsing, checked before a topic exists.

A topic's config travels as a ``str -> str`` map (CREATE_TOPIC, ``ferrymq topic create
--config``) and is stored as sent. Each key must be one of :data:`TOPIC_SETTINGS` and each value
a plain decimal integer (ASCII digits, an optional minus sign) inside the setting's range;
anything else is refused with INVALID_CONFIG naming the setting, the value and the allowed
range, before anything is created. The ranges are those the log and the broker can honour
(:class:`ferrymq.storage.LogConfig`, ``MAX_DEDUP_WINDOW_MS``); ``-1`` means "no limit" where
the broker setting of the same name says so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ferrymq.errors import InvalidConfigError
from ferrymq.protocol.dedup import MAX_DEDUP_WINDOW_MS
from ferrymq.storage.log import MAX_SEGMENT_BYTES

__all__ = ["BOOLEAN_TOPIC_SETTINGS", "LOG_SETTINGS", "MAX_SETTING_VALUE", "TOPIC_SETTINGS", "TopicSetting",
           "parse_topic_config"]

MAX_SETTING_VALUE = (1 << 63) - 1
"""Largest value of any topic setting: an i64 (millisecond and byte counts)."""
_INTEGER = re.compile(r"-?[0-9]{1,19}")


@dataclass(frozen=True, slots=True)
class TopicSetting:
    """One per-topic setting.

    Attributes:
        name: its key in the topic's config.
        low: smallest value allowed.
        high: largest value allowed.
        minus_one_unlimited: ``-1`` is allowed too and means no limit.
        why_high: where ``high`` comes from, when it is not just an i64.
    """

    name: str
    low: int
    high: int
    minus_one_unlimited: bool = False
    why_high: str = ""

    def describe_range(self) -> str:
        """The allowed values, as an error message says them."""
        text = f"an integer in {self.low}..{self.high}"
        if self.why_high:
            text += f" ({self.why_high})"
        return f"{text}, or -1 for no limit" if self.minus_one_unlimited else text

    def parse(self, value: object) -> int:
        """The value as an int.

        Raises:
            InvalidConfigError: not a plain decimal integer, or out of range (the message
                names the setting, the value and the range).
        """
        if isinstance(value, str) and _INTEGER.fullmatch(value):
            n = int(value)
            if self.low <= n <= self.high or (self.minus_one_unlimited and n == -1):
                return n
        shown = repr(value)[:40]
        raise InvalidConfigError(
            f"topic setting {self.name}={shown} is not valid: use {self.describe_range()}")


TOPIC_SETTINGS: dict[str, TopicSetting] = {
    s.name: s for s in (
        TopicSetting("retention_ms", 0, MAX_SETTING_VALUE, minus_one_unlimited=True),
        TopicSetting("retention_bytes", 0, MAX_SETTING_VALUE, minus_one_unlimited=True),
        TopicSetting("segment_bytes", 1, MAX_SEGMENT_BYTES,
                     why_high="MAX_SEGMENT_BYTES: index positions are u32"),
        TopicSetting("segment_ms", 1, MAX_SETTING_VALUE),
        TopicSetting("dedup_window_ms", 0, MAX_DEDUP_WINDOW_MS,
                     why_high="MAX_DEDUP_WINDOW_MS, one day"),
    )
}
"""Every per-topic setting, by name."""
BOOLEAN_TOPIC_SETTINGS = frozenset(("unclean_leader_election",))
"""Per-topic settings whose value is ``true`` or ``false`` (parsed as 1 or 0). On a cluster,
``unclean_leader_election=true`` lets the controller give an offline queue to a live replica
outside the ISR (it may lack acknowledged messages: Kafka's setting of the same name)."""
LOG_SETTINGS = frozenset(("retention_ms", "retention_bytes", "segment_bytes", "segment_ms"))
"""The topic settings that are :class:`~ferrymq.storage.LogConfig` fields."""


def parse_topic_config(config: Mapping[str, str]) -> dict[str, int]:
    """Check a topic's config; its values as ints.

    Raises:
        InvalidConfigError: an unknown key (naming the known ones) or an invalid value.
    """
    out: dict[str, int] = {}
    for key, value in config.items():
        if key in BOOLEAN_TOPIC_SETTINGS:
            if not isinstance(value, str) or value.lower() not in ("true", "false"):
                raise InvalidConfigError(f"topic setting {key}={repr(value)[:40]} is not valid: "
                                         f"use true or false")
            out[key] = int(value.lower() == "true")
            continue
        setting = TOPIC_SETTINGS.get(key)
        if setting is None:
            known = ", ".join([*TOPIC_SETTINGS, *sorted(BOOLEAN_TOPIC_SETTINGS)])
            raise InvalidConfigError(f"unknown topic setting {repr(key)[:64]}; known: {known}")
        out[setting.name] = setting.parse(value)
    return out
