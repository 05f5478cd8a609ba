"""A read-process-write application for exactly-once crash tests.

Usage: python -m tests.workers.rpw_app ADDRESS IN_TOPIC OUT_TOPIC GROUP TRANSACTIONAL_ID

Reads IN_TOPIC (read_committed, every queue assigned, starting from GROUP's committed offsets),
writes each message to OUT_TOPIC with a ``src`` property naming the input message, and commits
the output and GROUP's offsets in one transaction per poll. Runs until killed (SIGKILL is the
crash case); prints "ready" once started.
"""

from __future__ import annotations

import sys

from ferrymq import AdminClient, Message, Producer, PullConsumer


def main() -> None:
    address, src, dst, group, tid = sys.argv[1:6]
    with AdminClient(address) as a:
        queues = a.describe_topic(src).queues
    with Producer(address, transactional_id=tid) as p, PullConsumer(
            address, group, auto_commit=False, auto_offset_reset="earliest") as c:
        c.assign([(src, q[0]) for q in queues])
        print("ready", flush=True)
        while True:
            batch = c.poll(timeout=0.5, max_messages=50)
            if not batch:
                continue
            p.begin()
            for msg in batch:
                p.send_async(Message(dst, msg.body, properties={"src": msg.msg_id}))
            p.send_offsets(group, c.position())
            p.commit()


if __name__ == "__main__":
    main()
