"""``ferrymq bench``: produce, consume and end-to-end benchmarks (being written)."""

from __future__ import annotations

import click


@click.group()
def bench() -> None:
    """Measure produce, consume and end-to-end latency against a broker."""
