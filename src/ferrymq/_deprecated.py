"""Deprecated public names: each still works, with a ``DeprecationWarning`` naming its successor.

Issue 19 gave each feature one name in every layer (docs/design.md, "one name per feature"):
RocketMQ-style transactional messages are *half messages* (``HalfMessageProducer``), so that
"transaction" (``Txn``) names only the exactly-once transactions of ``transactional_id``. The
names users imported before keep working until a major release: module attributes through
:func:`module_getattr` (PEP 562), broker settings through :func:`renamed_setting`. Error classes
are served by :mod:`ferrymq.errors` itself and error code names by
:class:`~ferrymq.protocol.codes.ErrorCode` (the protocol layer imports nothing else); client
options renamed earlier are :mod:`ferrymq.client._renamed`'s.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

HALF_MESSAGE_CLIENT = {
    "AsyncTransactionProducer": "AsyncHalfMessageProducer",
    "TransactionProducer": "HalfMessageProducer",
    "TransactionResult": "HalfMessageResult",
    "TransactionState": "HalfState",
}
"""Old name -> new name in ``ferrymq`` and ``ferrymq.client``."""

HALF_MESSAGE_MODULE = {
    **HALF_MESSAGE_CLIENT,
    "AsyncTransaction": "AsyncHalfMessage",
    "Transaction": "HalfMessage",
    "transaction_id": "half_id",
}
"""Old name -> new name in ``ferrymq.client.transaction`` (now ``ferrymq.client.half_messages``)."""

SETTINGS = {
    "txn_check_after_ms": "half_check_after_ms",
    "txn_check_interval_ms": "half_check_interval_ms",
    "txn_max_checks": "half_max_checks",
    "txn_max_pending": "half_max_pending",
}
"""Old broker setting -> new one (config files, ``FERRYMQ_*`` variables, keyword arguments)."""


def warn(what: str, old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` (a ``what``) is deprecated in favour of ``new``."""
    warnings.warn(f"{what} {old} is deprecated; use {new} (same meaning)", DeprecationWarning,
                  stacklevel=stacklevel)


def module_getattr(module: str, renamed: dict[str, str], *,
                   target: str | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving each old name of ``renamed`` as its new name in
    ``target`` (default: ``module`` itself), with a warning."""

    def __getattr__(name: str) -> Any:
        new = renamed.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where = target or module
        warn("the name", f"{module}.{name}", f"{where}.{new}")
        return getattr(importlib.import_module(where), new)

    return __getattr__


def renamed_setting(name: str, *, source: str) -> str:
    """The current name of broker setting ``name`` (warning when it is an old one; ``source``
    says where it was given)."""
    new = SETTINGS.get(name)
    if new is None:
        return name
    warn(f"the broker setting ({source})", name, new, stacklevel=4)
    return new
