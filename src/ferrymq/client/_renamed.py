"""Deprecated names of client options: each still works, with a ``DeprecationWarning``.

Options carry their unit in their name (``reconnect_timeout_s``); an older name stays accepted
as an alias until a major release, so code written for it keeps working.
"""

from __future__ import annotations

import warnings
from typing import Any

RENAMED = {
    "reconnect_timeout": "reconnect_timeout_s",
    "request_timeout": "request_timeout_s",
    "session_timeout": "session_timeout_s",
}
"""Deprecated option name -> its current name (same meaning and unit): the push and simple
consumers' names before every client used the pull consumer's."""


def warn_renamed(old: str, *, stacklevel: int = 3) -> str:
    """Warn that option ``old`` is deprecated; return its current name."""
    new = RENAMED[old]
    warnings.warn(f"the option {old}= is deprecated; use {new}= (same meaning, in seconds)",
                  DeprecationWarning, stacklevel=stacklevel)
    return new


def renamed(old: str, old_value: float | None, value: float) -> float:
    """The value of an option whose deprecated name ``old`` a constructor also takes: the old
    name's value when it was given (warning), else the current name's ``value``."""
    if old_value is None:
        return value
    warn_renamed(old, stacklevel=4)
    return old_value


def rename_options(options: dict[str, Any], *, stacklevel: int = 3) -> dict[str, Any]:
    """``options`` with deprecated names replaced by current ones (warning for each); an option
    given under both names keeps the current name's value."""
    if not RENAMED.keys() & options.keys():
        return options
    out = dict(options)
    for old in RENAMED.keys() & options.keys():
        value = out.pop(old)
        out.setdefault(warn_renamed(old, stacklevel=stacklevel + 1), value)
    return out
