"""The metadata store: the one place a cluster's consensus lives (see ``docs/cluster.md``).

:class:`MetadataStore` is FerryMQ's own small interface over a strictly serialisable key-value
store with revisions, leases and watches: etcd v3's model. Backends: ``memory``
(:class:`~ferrymq.cluster.metadata.memory.MemoryMetadataStore`, one process, a clock you can
drive: the tests of the controller and the ISR) and ``etcd``
(:mod:`ferrymq.cluster.metadata.etcd`). A broker without ``--metadata`` uses none (its metadata
stays in its data directory, as before clusters).
"""

from ferrymq.cluster.metadata.store import (
    Check,
    KeyValue,
    MetadataStore,
    Put,
    WatchEvent,
    open_store,
)

__all__ = ["Check", "KeyValue", "MetadataStore", "Put", "WatchEvent", "open_store"]
