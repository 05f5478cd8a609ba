"""The Kafka-protocol listener (``kafka_port``): Kafka clients produce to and consume from
FerryMQ topics. :mod:`.listener` owns the port and its connections, :mod:`.handlers` maps each
Kafka API onto FerryMQ's handlers; the wire format is :mod:`ferrymq.protocol.kafka`. See
docs/kafka.md."""
