"""A Kafka read-process-write app (confluent-kafka, transactional), run as a subprocess by
tests/kafka/test_kafka_exactly_once.py: copies topic ``in`` to ``out`` upper-cased, ten messages
per transaction, the input offsets committed with each transaction. Usage: ADDRESS."""

from __future__ import annotations

import sys
import time

import confluent_kafka


def main(address: str) -> None:
    consumer = confluent_kafka.Consumer({
        "bootstrap.servers": address, "group.id": "rpw", "enable.auto.commit": False,
        "isolation.level": "read_committed", "auto.offset.reset": "earliest"})
    consumer.assign([confluent_kafka.TopicPartition("in", 0)])  # from the committed offset
    producer = confluent_kafka.Producer({"bootstrap.servers": address,
                                         "transactional.id": "rpw-app", "linger.ms": 2})
    producer.init_transactions(30)  # fences an earlier instance, aborts its open transaction
    while True:
        batch = [m for m in consumer.consume(10, 1.0) if m.error() is None]
        if not batch:
            continue
        producer.begin_transaction()
        for m in batch:
            producer.produce("out", m.value().upper(), partition=0)
        producer.send_offsets_to_transaction(
            [confluent_kafka.TopicPartition("in", 0, batch[-1].offset() + 1)],
            consumer.consumer_group_metadata(), 30)
        time.sleep(0.05)  # a window for the test's SIGKILL inside a transaction
        producer.commit_transaction(30)
        print("committed", batch[-1].offset() + 1, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
