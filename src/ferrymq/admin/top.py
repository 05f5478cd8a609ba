"""``ferrymq top``: a live view of rates and lag in the terminal.

Theory of operation
-------------------
Every refresh takes a :class:`Sample` over the wire with the same admin operations as the rest
of the CLI (:class:`~ferrymq.client.admin.AsyncAdminClient`, as the ``--user`` given, through
the client's view of a cluster): LIST_TOPICS and DESCRIBE_TOPIC (each queue's end offset and
size, from the queue's leader on a cluster:
:meth:`~ferrymq.client.admin.AsyncAdminClient.describe_topic_from_leaders`), LIST_GROUPS (every
broker's, merged), then DESCRIBE_GROUP for each consumer group (committed offsets, lag) and
DESCRIBE_DELIVERY for each delivery group (in flight, retries, dead letters). The requests of
one sample go out together (``asyncio.gather``). The lag of a consumer group in seconds is the
age of its oldest unconsumed message, read with one FETCH per lagging queue, for the groups
shown only (the first ``--limit`` in ``--sort`` order).

Rates are differences between two samples divided by the time between them (the samples' own
monotonic times): messages/s from the end offsets, bytes/s from the queues' sizes (a size that
shrank, retention having deleted a segment, counts as no bytes). So the first view needs two
samples: ``--iterations N`` takes one, then N more ``--interval`` seconds apart and prints each
view after the first sample (``--once`` is ``--iterations 1``); without it the view refreshes
in place (rich ``Live``) until Ctrl-C. ``--json`` prints one JSON object per view (JSON lines).

Why not the broker's ``/metrics``: it needs the HTTP port reachable, has no authentication of
its own, and answers for one broker; the wire answers as the CLI does everywhere (see
docs/design.md, "``ferrymq top``'s data").
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import click
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from ferrymq.admin.cli_state import CliState, json_option
from ferrymq.admin.output import PLAIN_WIDTH
from ferrymq.client.admin import AsyncAdminClient, DeliveryGroupDescription, GroupDescription
from ferrymq.errors import InvalidRequestError, OffsetOutOfRangeError, UnknownTopicError
from ferrymq.protocol import messages as m
from ferrymq.protocol.records import encode_msg_id

__all__ = ["ConsumerGroupRow", "DeliveryGroupRow", "Sample", "TopicRow", "View", "build_view",
           "take_sample", "top"]

DEFAULT_INTERVAL_S = 2.0
"""Seconds between two refreshes unless ``--interval``."""
MIN_INTERVAL_S = 0.1
"""The shortest ``--interval``: each refresh costs a few requests per topic and group."""
DEFAULT_LIMIT = 20
"""Rows per table unless ``--limit``."""
SORT_KEYS = ("rate", "bytes", "lag", "name")


@dataclass(frozen=True, slots=True)
class ConsumerGroupRow:
    """A consumer group (pull, offsets) in a view."""

    group: str
    state: str
    members: int
    lag: int
    """Messages not consumed yet, over every queue it committed on."""
    lag_s: float
    """Age of its oldest unconsumed message (0: caught up)."""


@dataclass(frozen=True, slots=True)
class DeliveryGroupRow:
    """A delivery group (push, simple) in a view."""

    group: str
    members: int
    lag: int
    in_flight: int
    retry: int
    """Letters in its retry queue, waiting or delivered."""
    dlq: int
    oldest_unacked_s: float


@dataclass(frozen=True, slots=True)
class Sample:
    """What the brokers said at one moment (``at_s``, monotonic)."""

    at_s: float
    queues: dict[tuple[str, int], tuple[int, int]]
    """(topic, queue) -> (end offset, size in bytes)."""
    consumer_groups: list[ConsumerGroupRow] = field(default_factory=list)
    delivery_groups: list[DeliveryGroupRow] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TopicRow:
    """A topic in a view: its rates between two samples."""

    topic: str
    queues: int
    end_offset: int
    """The sum of its queues' end offsets: messages ever stored."""
    size_bytes: int
    messages_per_s: float
    bytes_per_s: float


@dataclass(frozen=True, slots=True)
class View:
    """One refresh: the rows shown, sorted and cut to the limit."""

    interval_s: float
    topics: list[TopicRow]
    consumer_groups: list[ConsumerGroupRow]
    delivery_groups: list[DeliveryGroupRow]

    def to_json(self) -> dict[str, Any]:
        """The view as JSON (``--json``): rates rounded to 3 decimals."""
        return {
            "interval_s": round(self.interval_s, 3),
            "topics": [{"topic": t.topic, "queues": t.queues, "end_offset": t.end_offset,
                        "size_bytes": t.size_bytes,
                        "messages_per_s": round(t.messages_per_s, 3),
                        "bytes_per_s": round(t.bytes_per_s, 3)} for t in self.topics],
            "consumer_groups": [{"group": g.group, "state": g.state, "members": g.members,
                                 "lag": g.lag, "lag_s": round(g.lag_s, 3)}
                                for g in self.consumer_groups],
            "delivery_groups": [{"group": g.group, "members": g.members, "lag": g.lag,
                                 "in_flight": g.in_flight, "retry": g.retry, "dlq": g.dlq,
                                 "oldest_unacked_s": round(g.oldest_unacked_s, 3)}
                                for g in self.delivery_groups],
        }


def build_view(before: Sample, after: Sample, *, sort: str = "rate",
               limit: int = DEFAULT_LIMIT) -> View:
    """The rates between two samples, sorted by ``sort`` (largest first; ``name``: A-Z) and
    cut to ``limit`` rows per table. A queue only in ``after`` counts from zero."""
    interval = max(after.at_s - before.at_s, 1e-9)
    per_topic: dict[str, list[tuple[int, int, int, int]]] = {}
    for (topic, queue), (end, size) in after.queues.items():
        end0, size0 = before.queues.get((topic, queue), (0, 0))
        # a queue that went back (its topic deleted and created again) counts as no traffic
        per_topic.setdefault(topic, []).append((end, size, max(0, end - end0),
                                                max(0, size - size0)))
    topics = [TopicRow(t, len(qs), sum(q[0] for q in qs), sum(q[1] for q in qs),
                       sum(q[2] for q in qs) / interval, sum(q[3] for q in qs) / interval)
              for t, qs in per_topic.items()]
    by_name = sort == "name"
    topics.sort(key=lambda t: (t.topic,) if by_name else (
        -(t.bytes_per_s if sort == "bytes" else t.messages_per_s), t.topic))
    consumers = sorted(after.consumer_groups, key=lambda g: _group_order(g.group, g.lag, sort))
    delivery = sorted(after.delivery_groups, key=lambda g: _group_order(g.group, g.lag, sort))
    return View(interval, topics[:limit], consumers[:limit], delivery[:limit])


def _matches(name: str, patterns: Sequence[str], internal: bool) -> bool:
    if not internal and m.is_internal_topic(name):
        return False
    return not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns)


async def take_sample(admin: AsyncAdminClient, *, topics: Sequence[str] = (),
                      groups: Sequence[str] = (), internal: bool = False, sort: str = "rate",
                      limit: int = DEFAULT_LIMIT) -> Sample:
    """Ask the brokers for every queue's end and size and every group's progress.

    Args:
        admin: a connected admin client.
        topics: glob patterns of the topics shown (empty: all).
        groups: glob patterns of the groups shown (empty: all).
        internal: also the internal ``%...`` topics.
        sort: the view's order (:func:`build_view`): with ``limit``, which consumer groups
            are shown, the only ones whose lag age is read (the others' ``lag_s`` is -1).
        limit: rows per table of the view.
    """
    listed = await admin.list_topics()
    ids = {t.name: t.topic_id for t in listed}
    names = [t.name for t in listed if _matches(t.name, topics, internal)]
    group_rows = [g for g in await admin.list_groups()
                  if not groups or any(fnmatch.fnmatchcase(g.group, p) for p in groups)]
    at = time.monotonic()
    described = await asyncio.gather(*(admin.describe_topic_from_leaders(n) for n in names),
                                      return_exceptions=True)
    queues: dict[tuple[str, int], tuple[int, int]] = {}
    for name, d in zip(names, described, strict=True):
        if isinstance(d, UnknownTopicError):
            continue  # deleted since the list
        if isinstance(d, BaseException):
            raise d
        for q in d.queues:
            queues[(name, q.queue)] = (q.end_offset, q.size_bytes)
    consumer = [g for g in group_rows if g.state != m.DELIVERY_GROUP_STATE]
    delivery = [g for g in group_rows if g.state == m.DELIVERY_GROUP_STATE]
    cdesc = await asyncio.gather(*(admin.describe_group(g.group) for g in consumer))
    ddesc = await asyncio.gather(*(admin.describe_delivery(g.group) for g in delivery))
    shown = {d.group for d in sorted(cdesc, key=lambda d: _group_order(
        d.group, sum(o.lag for o in d.offsets), sort))[:limit]}
    crows = await asyncio.gather(*(_consumer_row(admin, ids, d, age=d.group in shown)
                                   for d in cdesc))
    drows = [_delivery_row(g.members, d) for g, d in zip(delivery, ddesc, strict=True)]
    return Sample(at, queues, list(crows), drows)


def _group_order(group: str, lag: int, sort: str) -> tuple[int, str]:
    """Where a group goes in a view: by name, or most lag first."""
    return (0, group) if sort == "name" else (-lag, group)


async def _consumer_row(admin: AsyncAdminClient, ids: dict[str, int],
                        d: GroupDescription, *, age: bool) -> ConsumerGroupRow:
    """A consumer group's lag in messages, and in seconds: the age of the oldest message it has
    not consumed (one FETCH per lagging queue; only when ``age``, else -1)."""
    lag = sum(o.lag for o in d.offsets)
    if not age:
        return ConsumerGroupRow(d.group, d.state, len(d.members), lag, -1.0)
    now_ms = time.time() * 1000
    oldest = now_ms

    async def stored_ms(topic: str, queue: int, offset: int) -> float:
        if topic not in ids:
            return now_ms
        try:
            msg = await admin.get_message(encode_msg_id(ids[topic], queue, offset))
        except (OffsetOutOfRangeError, UnknownTopicError, InvalidRequestError):
            return now_ms  # gone meanwhile (retention, a delete)
        return float(msg.stored_ms)

    lagging = [o for o in d.offsets if o.lag > 0]
    if lagging:
        found = await asyncio.gather(*(stored_ms(o.topic, o.queue, o.end_offset - o.lag)
                                       for o in lagging))
        oldest = min(found)
    return ConsumerGroupRow(d.group, d.state, len(d.members), lag,
                            max(0.0, now_ms - oldest) / 1000)


def _delivery_row(members: int, d: DeliveryGroupDescription) -> DeliveryGroupRow:
    oldest = max((q.oldest_age_ms for q in d.queues), default=-1)
    return DeliveryGroupRow(d.group, members, sum(d.queue_lags()),
                            sum(q.in_flight for q in d.queues),
                            d.retry_pending + d.retry_in_flight, d.dlq_size,
                            max(0, oldest) / 1000)


# -- display ---------------------------------------------------------------------------------------


def _rate(x: float) -> str:
    return f"{x:,.1f}"


def render(view: View, server: str, *, terminal: bool = True) -> Group:
    """The view as three rich tables (without lines when not drawn on a terminal)."""
    style = box.SIMPLE_HEAD if terminal else None

    def table(title: str) -> Table:
        return Table(title=title, title_justify="left", box=style)

    topics = table(f"ferrymq top  {server}  (every {view.interval_s:.1f} s)")
    for col in ("topic", "queues", "end offset", "size bytes", "msg/s", "bytes/s"):
        topics.add_column(col, justify="left" if col == "topic" else "right")
    for t in view.topics:
        topics.add_row(t.topic, str(t.queues), str(t.end_offset), str(t.size_bytes),
                       _rate(t.messages_per_s), _rate(t.bytes_per_s))
    consumers = table("consumer groups")
    for col in ("group", "state", "members", "lag", "lag age s"):
        consumers.add_column(col, justify="left" if col in ("group", "state") else "right")
    for c in view.consumer_groups:
        consumers.add_row(c.group, c.state, str(c.members), str(c.lag), f"{c.lag_s:.1f}")
    delivery = table("delivery groups")
    for col in ("group", "members", "lag", "in flight", "retry", "dlq", "oldest unacked s"):
        delivery.add_column(col, justify="left" if col == "group" else "right")
    for g in view.delivery_groups:
        delivery.add_row(g.group, str(g.members), str(g.lag), str(g.in_flight), str(g.retry),
                         str(g.dlq), f"{g.oldest_unacked_s:.1f}")
    return Group(topics, consumers, delivery)


# -- the command -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Options:
    interval_s: float
    iterations: int | None
    topics: tuple[str, ...]
    groups: tuple[str, ...]
    internal: bool
    sort: str
    limit: int
    json: bool


async def _run(state: CliState, opts: _Options) -> None:
    out = Console(highlight=False)
    plain = Console(highlight=False, no_color=True, width=PLAIN_WIDTH)
    async with AsyncAdminClient(state.server, connect_timeout_s=state.connect_timeout_s,
                                reconnect_timeout_s=state.connect_timeout_s,
                                **state.client_options) as admin:
        await admin.hello()  # a wrong address or user fails here, within --connect-timeout

        async def sample() -> Sample:
            return await take_sample(admin, topics=opts.topics, groups=opts.groups,
                                     internal=opts.internal, sort=opts.sort, limit=opts.limit)

        before = await sample()
        live = opts.iterations is None and not opts.json and out.is_terminal
        if live:
            with Live(console=out, auto_refresh=False, screen=False) as screen:
                while True:
                    await asyncio.sleep(opts.interval_s)
                    after = await sample()
                    view = build_view(before, after, sort=opts.sort, limit=opts.limit)
                    screen.update(render(view, state.server), refresh=True)
                    before = after
        n = 0
        while opts.iterations is None or n < opts.iterations:
            await asyncio.sleep(opts.interval_s)
            after = await sample()
            view = build_view(before, after, sort=opts.sort, limit=opts.limit)
            if opts.json:
                click.echo(_json_line(view))
            elif out.is_terminal:
                out.print(render(view, state.server))
            else:  # plain columns for grep and awk, as the other commands print (output.py)
                with plain.capture() as captured:
                    plain.print(render(view, state.server, terminal=False))
                for line in captured.get().splitlines():
                    click.echo(line.rstrip())
            before = after
            n += 1


def _json_line(view: View) -> str:
    return json.dumps(view.to_json(), ensure_ascii=False)


@click.command()
@click.option("--interval", "interval_s", type=click.FloatRange(min=MIN_INTERVAL_S),
              default=DEFAULT_INTERVAL_S, show_default=True, metavar="SECONDS",
              help="Time between two refreshes (rates are per second over it).")
@click.option("--iterations", "-n", type=click.IntRange(min=1), metavar="N",
              help="Print N views (one per interval) and exit, instead of a live view.")
@click.option("--once", is_flag=True, help="Print one view and exit (same as --iterations 1).")
@click.option("--topic", "topics", multiple=True, metavar="PATTERN",
              help="Only topics matching this glob (repeatable).")
@click.option("--group", "groups", multiple=True, metavar="PATTERN",
              help="Only groups matching this glob (repeatable).")
@click.option("--internal", is_flag=True, help="Also show the internal %... topics.")
@click.option("--sort", type=click.Choice(SORT_KEYS), default="rate", show_default=True,
              help="Order: topics by msg/s (rate) or bytes/s (bytes), groups by lag; or by name.")
@click.option("--limit", type=click.IntRange(min=1), default=DEFAULT_LIMIT, show_default=True,
              metavar="N", help="At most N rows per table.")
@json_option
@click.pass_obj
def top(state: CliState, interval_s: float, iterations: int | None, once: bool,
        topics: tuple[str, ...], groups: tuple[str, ...], internal: bool, sort: str, limit: int,
        json_flag: bool) -> None:
    """Live rates and lag: per topic messages/s and bytes/s, per consumer group lag in messages
    and seconds, per delivery group in flight, retries and dead letters.

    Refreshes in place until Ctrl-C; with --once or --iterations N (or --json, or when stdout
    is not a terminal) prints views one after another instead.
    """
    if once and iterations is not None and iterations != 1:
        raise click.UsageError("--once and --iterations N go one or the other")
    opts = _Options(interval_s, 1 if once else iterations, topics, groups, internal, sort, limit,
                    json_flag or state.json)
    try:
        asyncio.run(_run(state, opts))
    except KeyboardInterrupt:
        pass  # Ctrl-C ends the view: exit 0
