"""``ferrymq cluster``: how the brokers share the queues.

Like every command (see :mod:`ferrymq.admin.cli`), it makes one call on the synchronous
:class:`~ferrymq.client.sync.AdminClient` and hands the answer to
:class:`~ferrymq.admin.output.Printer`.
"""

from __future__ import annotations

import click

from ferrymq.admin.cli_state import CliState, json_option, pass_state
from ferrymq.client.admin import ClusterDescription


@click.group()
def cluster() -> None:
    """Look at the cluster (brokers, leaders, in-sync replicas); move leaders back."""


@cluster.command("describe")
@json_option
@pass_state
def cluster_describe(state: CliState, json_flag: bool) -> None:
    """Show the brokers (alive, address), the controller and, per queue, its leader, leader
    epoch, replicas and in-sync replicas (ISR). Offline queues (no leader) come first, then
    under-replicated ones (ISR smaller than the replicas). A single broker shows itself as a
    cluster of one, leading every queue at epoch 0."""
    with state.admin() as admin:
        desc: ClusterDescription = admin.cluster_describe()
    state.printer_with(json_flag).cluster(desc)


@cluster.command("preferred-leaders")
@click.option("--topic", "topics", multiple=True, metavar="TOPIC",
              help="Only this topic's queues (repeatable; default: every topic).")
@json_option
@pass_state
def cluster_preferred_leaders(state: CliState, topics: tuple[str, ...], json_flag: bool) -> None:
    """Move each queue's leadership back to its preferred replica (the first of its replicas)
    where that broker is alive and in the ISR: after a failover and the broker's return, the
    leaders are spread evenly again. Queues whose preferred replica is down or behind stay as
    they are. A single broker moves nothing."""
    with state.admin() as admin:
        moved = admin.elect_preferred_leaders(list(topics) if topics else None)
    state.printer_with(json_flag).preferred_leaders(moved)


@cluster.command("drain")
@click.argument("broker_id", type=click.IntRange(0, 2**31 - 1))
@json_option
@pass_state
def cluster_drain(state: CliState, broker_id: int, json_flag: bool) -> None:
    """Move the leadership of every queue BROKER_ID leads to another replica alive and in sync,
    before maintenance of that broker; it stays a follower. Queues no other replica can take
    are named by count. `cluster preferred-leaders` moves leadership back afterwards."""
    with state.admin() as admin:
        result = admin.drain_broker(broker_id)
    state.printer_with(json_flag).drained(broker_id, result)
