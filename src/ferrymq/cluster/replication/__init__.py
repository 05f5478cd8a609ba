"""Replication's data path: followers copy their leaders' logs; leaders keep the high watermark.

One :class:`ReplicaManager` per broker of a cluster (owned by the cluster node) holds this
broker's role for each replicated queue. Modules: ``manager`` (roles, the node's entry points),
``leader`` (a led queue: high watermark, ``acks="all"`` waits), ``isr`` (followers' positions,
ISR shrink and expand: pure), ``serving`` (the leader's REPLICA_FETCH and OFFSET_FOR_EPOCH),
``follower`` (fetchers, truncation by epoch, copying). See ``docs/cluster.md``.
"""

from ferrymq.cluster.replication.manager import IsrChange, ReplicaManager

__all__ = ["IsrChange", "ReplicaManager"]
