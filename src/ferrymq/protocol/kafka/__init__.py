"""The Kafka wire protocol, sans-IO: framing and headers (:mod:`.frames`), message schemas
through ``kio`` and the versions served (:mod:`.apis`), Produce and Fetch by hand on the hot
path (:mod:`.produce_codec`, :mod:`.fetch_codec`), Kafka's record batch with its conversion to
and from FerryMQ's (:mod:`.records`) and its envelope in the log (:mod:`.envelope`). The
listener is :mod:`ferrymq.kafka`."""
