"""Order generator: JSON orders into the FerryMQ topic ``pipeline-orders``.

    python examples/pipeline/generator.py --servers 127.0.0.1:9876 --orders 20000

Each order is ``{"order_id", "category", "amount", "ts"}``; ``ts`` (the event time) runs over
``--minutes`` minutes from ``--start`` so that a short run still spans several one-minute
windows. The sharding key is the order id, so an order's events would stay in one queue.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random

from ferrymq import Message, Producer

CATEGORIES = ("books", "games", "garden", "kitchen", "music")


def make_orders(n: int, start: dt.datetime, minutes: int, seed: int = 1) -> list[dict[str, object]]:
    """``n`` orders with event times spread evenly over ``minutes`` minutes (reproducible)."""
    rng = random.Random(seed)
    span_ms = minutes * 60_000
    orders = []
    for i in range(n):
        ts = start + dt.timedelta(milliseconds=i * span_ms // n)
        orders.append({
            "order_id": f"o-{i}",
            "category": rng.choice(CATEGORIES),
            "amount": round(rng.uniform(1, 200), 2),
            "ts": ts.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z",
        })
    return orders


def produce(servers: str, orders: list[dict[str, object]], topic: str = "pipeline-orders") -> None:
    """Send the orders (batched; the producer is idempotent)."""
    with Producer(servers) as p:
        for i in range(0, len(orders), 1000):
            p.send_batch([Message(topic, json.dumps(o).encode(), sharding_key=str(o["order_id"]),
                                  tags=str(o["category"])) for o in orders[i:i + 1000]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--servers", default="127.0.0.1:9876")
    ap.add_argument("--orders", type=int, default=20_000)
    ap.add_argument("--minutes", type=int, default=6)
    ap.add_argument("--start", default="2026-11-21T10:00:00+00:00")
    args = ap.parse_args()
    produce(args.servers, make_orders(args.orders, dt.datetime.fromisoformat(args.start), args.minutes))
    print(f"produced {args.orders} orders to 'pipeline-orders'")


if __name__ == "__main__":
    main()
