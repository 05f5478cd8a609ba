"""The cluster: brokers coordinated through a metadata store (etcd), replicated queues, failover.

Without ``--metadata`` a broker is the single broker of today and nothing here runs. With it,
the consensus parts (membership, the controller, each queue's leader, epoch and in-sync replica
set) live in the :class:`~ferrymq.cluster.metadata.MetadataStore` (etcd in production, memory in
tests), every write of them a compare-and-swap; the logs replicate over FerryMQ's own wire
(REPLICA_FETCH, OFFSET_FOR_EPOCH). See ``docs/cluster.md``.
"""
