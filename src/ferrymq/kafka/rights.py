"""What a Kafka request may do: the FerryMQ ACL rule of the request it becomes
(:mod:`ferrymq.broker.acl`), for the user SASL authenticated (nothing to check when
authentication is off)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ferrymq.broker.acl import authorize as _authorize
from ferrymq.broker.acl import may

if TYPE_CHECKING:
    from ferrymq.kafka.handlers import KafkaPeer
    from ferrymq.protocol.messages import ApiKey

log = logging.getLogger("ferrymq.kafka")


def authorize(peer: KafkaPeer, api_key: ApiKey, req: Any) -> None:
    """Check the FerryMQ request a Kafka request became against the user's ACLs, as the native
    port checks it (nothing when authentication is off).

    Raises:
        AccessDeniedError: a right is missing (logged with the user and the right).
    """
    conn = peer.conn
    if conn.principal is not None:
        _authorize(conn.server, conn.principal, conn.peer, api_key, req)


def group_denied(peer: KafkaPeer, group: str) -> bool:
    """Whether the user lacks the group right on ``group`` (logged)."""
    conn = peer.conn
    if may(conn.server, conn.principal, ("group", group)):
        return False
    log.warning("access denied: user %r from %s: Kafka group %r needs the group right",
                conn.principal, conn.peer, group)
    return True
