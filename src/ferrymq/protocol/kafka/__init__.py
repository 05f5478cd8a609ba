"""The Kafka wire protocol, sans-IO: framing and headers (:mod:`.frames`), message schemas
through ``kio`` and the versions served (:mod:`.apis`), and Kafka's record batch with its
conversion to and from FerryMQ's (:mod:`.records`). The listener is :mod:`ferrymq.kafka`."""
