"""Per-message delivery for push and simple consumers: leases, acks, retries, dead letters.

See :mod:`ferrymq.broker.delivery.manager` for the theory of operation and ``docs/delivery.md``
for the semantics users rely on.
"""

from ferrymq.broker.delivery.group import DEFAULT_MAX_RECONSUME, DEFAULT_RETRY_DELAYS_MS
from ferrymq.broker.delivery.manager import DeliveryManager

__all__ = ["DEFAULT_MAX_RECONSUME", "DEFAULT_RETRY_DELAYS_MS", "DeliveryManager"]
