"""Print the revenue windows from the FerryMQ topic ``pipeline-revenue``.

    python examples/pipeline/consumer.py --servers 127.0.0.1:9876
"""

from __future__ import annotations

import argparse
import json

from ferrymq import PullConsumer


def read_revenue(servers: str, expect: int = 0, timeout: float = 10.0) -> list[dict[str, object]]:
    """Every revenue row in the topic, sorted by window and category."""
    import time

    rows: list[dict[str, object]] = []
    with PullConsumer(servers, f"revenue-printer-{time.time_ns()}", auto_offset_reset="earliest",
                      auto_commit=False) as c:
        c.subscribe("pipeline-revenue")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = c.poll(timeout=0.5)
            rows += [json.loads(m.body) for m in got]
            if not got and len(rows) >= expect:
                break
    return sorted(rows, key=lambda r: (str(r["window_start"]), str(r["category"])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--servers", default="127.0.0.1:9876")
    args = ap.parse_args()
    for r in read_revenue(args.servers):
        print(f"{r['window_start']}  {r['category']:<8} {r['revenue']:>10.2f}  ({r['orders']} orders)")


if __name__ == "__main__":
    main()
