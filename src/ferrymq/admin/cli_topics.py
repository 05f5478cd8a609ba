"""``ferrymq topic``: create, list, describe and delete topics.

Like every command (see :mod:`ferrymq.admin.cli`), each makes one call on the synchronous
:class:`~ferrymq.client.sync.AdminClient` and hands the answer to
:class:`~ferrymq.admin.output.Printer`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from ferrymq.admin.cli_params import KEY_VALUE
from ferrymq.admin.cli_state import CliState, pass_state
from ferrymq.admin.progress import progress
from ferrymq.client.admin import TopicDescription, TopicListing
from ferrymq.protocol import messages as m


@click.group()
def topic() -> None:
    """Create, list, describe and delete topics."""


@topic.command("create")
@click.argument("name")
@click.option("--queues", type=click.IntRange(min=1), required=True, metavar="N",
              help="Number of queues (partitions).")
@click.option("--config", "config", type=KEY_VALUE, multiple=True,
              help="Topic setting (retention_ms, retention_bytes, segment_bytes, segment_ms); "
                   "repeatable.")
@click.option("--replicas", type=click.IntRange(min=1), metavar="R",
              help="On a cluster: copies of each queue, on R brokers (default: the brokers' "
                   "default_replicas).")
@click.option("--min-insync", type=click.IntRange(min=1), metavar="M",
              help="On a cluster: in-sync replicas an acks=\"all\" send needs (default: the "
                   "brokers' default_min_insync).")
@pass_state
def topic_create(state: CliState, name: str, queues: int,
                 config: Sequence[tuple[str, str]], replicas: int | None,
                 min_insync: int | None) -> None:
    """Create topic NAME with N queues (and, on a cluster, R replicas of each)."""
    with state.admin() as admin:
        resp: m.CreateTopicResponse = admin.create_topic(
            name, queues, dict(config), replicas=replicas, min_insync=min_insync)
    state.printer.topic_created(name, resp)


@topic.command("list")
@click.option("--internal", is_flag=True,
              help="Also list the broker's own topics (%RETRY%/%DLQ% of delivery groups, "
                   "half messages, transactions).")
@pass_state
def topic_list(state: CliState, internal: bool) -> None:
    """List topics with their ids and queue counts (the broker's own %-named topics only with
    --internal)."""
    with state.admin() as admin:
        topics: list[TopicListing] = admin.list_topics()
    if not internal:
        topics = [t for t in topics if not m.is_internal_topic(t.name)]
    state.printer.topics(topics, internal)


@topic.command("describe")
@click.argument("name")
@pass_state
def topic_describe(state: CliState, name: str) -> None:
    """Show per-queue offsets (first, last = end-1, end), bytes, segments, last append time."""
    with state.admin() as admin:
        described: TopicDescription = admin.describe_topic(name)
    state.printer.topic(described)


@topic.command("delete")
@click.argument("name")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@pass_state
def topic_delete(state: CliState, name: str, yes: bool) -> None:
    """Delete topic NAME with all its data and the groups' offsets on it.

    Asks for confirmation unless --yes; without a terminal, --yes is required.
    """
    if not yes:
        if not sys.stdin.isatty():
            raise click.UsageError("refusing to delete without --yes (stdin is not a terminal)")
        click.confirm(f"Delete topic {name!r} and all its messages?", abort=True, err=True)
    with state.admin() as admin, progress(f"deleting {name}", json_mode=state.json):
        admin.delete_topic(name)
    state.printer.topic_deleted(name)
