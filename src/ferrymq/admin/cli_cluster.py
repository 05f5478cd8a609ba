"""``ferrymq cluster``: how the brokers share the queues.

Like every command (see :mod:`ferrymq.admin.cli`), it makes one call on the synchronous
:class:`~ferrymq.client.sync.AdminClient` and hands the answer to
:class:`~ferrymq.admin.output.Printer`.
"""

from __future__ import annotations

import time

import click

from ferrymq.admin.cli_state import CliState, CommandError, json_option, pass_state
from ferrymq.admin.progress import progress
from ferrymq.client.admin import ClusterDescription


@click.group()
def cluster() -> None:
    """Look at the cluster (brokers, leaders, in-sync replicas); move leaders and replicas."""


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


def _broker_ids(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        ids = [int(p) for p in value.split(",") if p.strip()]
    except ValueError:
        raise click.BadParameter(f"broker ids separated by commas (e.g. 2,3,4), not {value!r}"
                                 ) from None
    if not ids or any(not 0 <= i < 2**31 for i in ids):
        raise click.BadParameter(f"broker ids 0..2**31-1 separated by commas, not {value!r}")
    return ids


REASSIGN_POLL_S = 0.5
"""How often ``cluster reassign --wait`` looks at the queue's replicas."""


@cluster.command("reassign")
@click.argument("topic")
@click.argument("queue", type=click.IntRange(0))
@click.option("--replicas", "replicas", required=True, callback=_broker_ids, metavar="IDS",
              help="The new replicas, broker ids separated by commas; the first is the "
                   "preferred leader.")
@click.option("--wait", "wait_s", type=click.FloatRange(0), default=0.0, show_default=True,
              help="Wait up to this many seconds for the new replicas to catch up and the old "
                   "ones to leave (0: return once it started).")
@json_option
@pass_state
def cluster_reassign(state: CliState, topic: str, queue: int, replicas: list[int],
                     wait_s: float, json_flag: bool) -> None:
    """Move QUEUE of TOPIC to other brokers (to replace a machine, or spread load): the new
    replicas copy it as followers, then, once every one is in sync, they become the queue's
    replicas and the others leave it (leadership moves if the leader leaves). `cluster
    describe` shows old and new replicas until then."""
    with state.admin() as admin:
        started = admin.reassign_queue(topic, queue, replicas)
        done = False
        deadline = time.monotonic() + wait_s
        with progress(f"reassigning {topic}/{queue}",
                      json_mode=state.json or json_flag or not wait_s) as tracker:
            while wait_s:
                q = next((q for q in admin.cluster_describe().queues
                          if q.topic == topic and q.queue == queue), None)
                if q is not None and list(q.replicas) == replicas:
                    done = True
                    break
                isr = list(q.isr) if q is not None else []
                if time.monotonic() >= deadline:
                    raise CommandError(f"{topic}/{queue} is still being reassigned after "
                                       f"{wait_s:g} s (in sync: {isr}, wanted: {replicas}); it "
                                       "goes on: see `ferrymq cluster describe`")
                tracker.describe(f"reassigning {topic}/{queue} (in sync: {isr})")
                time.sleep(REASSIGN_POLL_S)
    state.printer_with(json_flag).reassigned(topic, queue, replicas, started, done)
