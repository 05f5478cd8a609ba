"""Deprecated: the half-message producer is :mod:`ferrymq.client.half_messages` now.

Every name this module had is still served, with a ``DeprecationWarning`` naming its new name
there (``TransactionProducer`` is ``HalfMessageProducer``, ...; see :mod:`ferrymq._deprecated`).
"""

from typing import TYPE_CHECKING

from ferrymq import _deprecated

_NAMES = {**_deprecated.HALF_MESSAGE_MODULE, "Checker": "Checker",
          "LocalTransaction": "LocalTransaction"}

if not TYPE_CHECKING:
    __getattr__ = _deprecated.module_getattr(__name__, _NAMES,
                                             target="ferrymq.client.half_messages")
