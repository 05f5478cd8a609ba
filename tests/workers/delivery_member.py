"""A delivery-group member process for churn tests: receive, record, ack; history as JSON lines.

Usage: python -m tests.workers.delivery_member ADDRESS GROUP TOPIC HISTORY_FILE MEMBER_NAME

Every event is one flushed JSON line with ``time.monotonic_ns()`` (one clock for every process
on the machine): ``recv`` (t_inv before the request, t after, id, off, q, lease end),
``acking`` (t, ids: written before the ack request is sent), ``ack`` (t_inv, t, ids, ok).
SIGTERM closes gracefully (leave the group); SIGKILL is the crash case: a member killed with an
ack in flight leaves an ``acking`` line without its ``ack`` (the broker may have acked).
"""

from __future__ import annotations

import json
import signal
import sys
import time

from ferrymq import SimpleConsumer
from ferrymq.errors import InvalidReceiptError


def main() -> None:
    address, group, topic, path, name = sys.argv[1:6]
    invisible = 3.0
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    out = open(path, "a", buffering=1)  # noqa: SIM115 - line-buffered for the life of the process
    c = SimpleConsumer(address, group, session_timeout_s=4.0, invisible_duration=invisible)
    c.subscribe(topic)
    out.write(json.dumps({"f": "start", "w": name, "t": time.monotonic_ns()}) + "\n")
    while not stop:
        t_inv = time.monotonic_ns()
        msgs = c.receive(16, wait=0.2)
        t = time.monotonic_ns()
        for x in msgs:
            out.write(json.dumps({"f": "recv", "w": name, "t_inv": t_inv, "t": t, "id": x.msg_id,
                                  "body": x.body.decode(), "att": x.reconsume_times,
                                  "end": t_inv + int(invisible * 1e9)}) + "\n")
        if msgs:
            time.sleep(0.15)  # some work: a kill now strands leased messages
            t_inv = time.monotonic_ns()
            # before the request: a kill between the broker's ack and the "ack" line below
            # leaves this line, so the checker knows the outcome is the broker's to tell
            out.write(json.dumps({"f": "acking", "w": name, "t": t_inv,
                                  "ids": [x.msg_id for x in msgs]}) + "\n")
            try:
                c.ack_batch(msgs)
                ok = True
            except InvalidReceiptError:
                ok = False  # some leases were not current: which ones is unknown
            out.write(json.dumps({"f": "ack", "w": name, "t_inv": t_inv,
                                  "t": time.monotonic_ns(), "ok": ok,
                                  "ids": [x.msg_id for x in msgs]}) + "\n")
    c.close()
    out.write(json.dumps({"f": "left", "w": name, "t": time.monotonic_ns()}) + "\n")
    out.close()


if __name__ == "__main__":
    main()
