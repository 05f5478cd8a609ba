"""Liveness and readiness: what ``/healthz`` and ``/readyz`` answer.

Theory of operation
-------------------
``/healthz`` is liveness: it is answered by the broker's event loop, so any answer means the
loop runs (a stuck loop times the probe out, which is what Kubernetes restarts on). ``/readyz``
is readiness, whether a load balancer should send clients here: the data directory recovered,
the broker serving (in a cluster: joined, registered with a lease and not fenced), not shutting
down, and no memory or disk watermark tripped (produce would be refused). Each failed
condition is one human-readable reason in the 503's JSON body.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ferrymq.broker.server import BrokerServer

__all__ = ["not_ready_reasons"]


def not_ready_reasons(srv: BrokerServer) -> list[str]:
    """Why ``srv`` should not get traffic now (empty: it is ready)."""
    reasons: list[str] = []
    if srv.shutting_down:
        reasons.append("shutting down")
    elif not srv.recovered:
        reasons.append("recovering the data directory")
    elif not srv.serving:
        reasons.append("starting: not accepting connections yet")
    refusing = srv.watermarks.refusing
    if refusing is not None:
        reasons.append(f"watermark tripped: {refusing}")
    if srv.config.metadata and not srv.shutting_down:
        link = srv.cluster
        if link is None or link.node.lease == 0:
            reasons.append("not registered in the cluster (no lease in the metadata store)")
        elif link.node.fenced:
            reasons.append("fenced: cannot renew its lease in the metadata store")
    return reasons
