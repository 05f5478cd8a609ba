"""``ferrymq group``: list, describe and delete consumer and delivery groups, skip a stuck
message, move committed offsets (replay)."""

from __future__ import annotations

import contextlib
import sys

import click

from ferrymq.admin.cli_params import Position, PositionType
from ferrymq.admin.cli_state import CliState, CommandError, pass_state
from ferrymq.client.admin import (
    DeliveryGroupDescription,
    GroupDescription,
    GroupListing,
    QueueOffset,
)
from ferrymq.errors import UnknownGroupError
from ferrymq.protocol import messages as m


@click.group()
def group() -> None:
    """List, describe and delete consumer groups; move their offsets (replay)."""


@group.command("list")
@pass_state
def group_list(state: CliState) -> None:
    """List consumer groups (state STABLE, ...) and delivery groups (state DELIVERY) with their
    number of live members."""
    with state.admin() as admin:
        groups: list[GroupListing] = admin.list_groups()
    state.printer.groups(groups)


@group.command("describe")
@click.argument("name", metavar="GROUP")
@pass_state
def group_describe(state: CliState, name: str) -> None:
    """Describe a consumer group, a delivery group, or both when both have this name.

    Consumer group: state, generation, members with their queues, and per queue the committed
    offset, end offset and lag. Delivery group: members (client, host, last heartbeat, messages
    in flight), retry policy, retry and dead-letter sizes, and per queue the offset everything
    below is acked, the next new offset, the end, in flight, lag (messages not finished) and the
    age of the oldest unfinished message; also when no member is online.
    """
    with state.admin() as admin:
        consumer: GroupDescription | None = None
        delivery: DeliveryGroupDescription | None = None
        with contextlib.suppress(UnknownGroupError):
            consumer = admin.describe_group(name)
        with contextlib.suppress(UnknownGroupError):
            delivery = admin.describe_delivery(name)
    if consumer is None and delivery is None:
        raise CommandError(f"unknown group {name!r}: no consumer group or delivery group has "
                           "this name")
    state.printer.groups_described(consumer, delivery)


@group.command("delete")
@click.argument("name", metavar="GROUP")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--delete-dlq", is_flag=True,
              help="Also delete the delivery group's dead letters (refused otherwise while it "
                   "has some).")
@pass_state
def group_delete(state: CliState, name: str, yes: bool, delete_dlq: bool) -> None:
    """Delete GROUP once no consumer of it is running: a consumer group's committed offsets,
    a delivery group's state, retry queue and dead-letter queue.

    Refused while the group has live members, and while a delivery group has dead letters
    unless --delete-dlq. A consumer that later uses the name starts afresh. Asks for
    confirmation unless --yes; without a terminal, --yes is required.
    """
    if not yes:
        if not sys.stdin.isatty():
            raise click.UsageError("refusing to delete without --yes (stdin is not a terminal)")
        what = " and its dead letters" if delete_dlq else ""
        click.confirm(f"Delete group {name!r}{what}?", abort=True, err=True)
    with state.admin() as admin:
        resp: m.DeleteGroupResponse = admin.delete_group(name, delete_dlq=delete_dlq)
    state.printer.group_deleted(name, resp)


@group.command("skip")
@click.argument("name", metavar="GROUP")
@click.argument("msg_id", metavar="MSG_ID")
@pass_state
def group_skip(state: CliState, name: str, msg_id: str) -> None:
    """Send a stuck message of an orderly delivery group to its dead-letter queue on purpose, so
    that its sharding key moves on (it must be the first pending message of its key: see the
    blocked keys of `group describe`)."""
    with state.admin() as admin:
        admin.skip_message(name, msg_id)
    if state.printer.json_mode:
        state.printer.json({"group": name, "msg_id": msg_id, "skipped": True})
    else:
        state.printer.line(f"{msg_id}: sent to %DLQ%{name}; its key moves on")


@group.command("reset-offset")
@click.argument("name", metavar="GROUP")
@click.option("--topic", "topic_name", required=True, metavar="TOPIC",
              help="Topic whose offsets to move (every queue).")
@click.option("--to", "target", type=PositionType(allow_offset=True), required=True,
              help="earliest, latest, an offset (clamped to each queue) or an ISO-8601 time.")
@pass_state
def group_reset_offset(state: CliState, name: str, topic_name: str, target: Position) -> None:
    """Move GROUP's committed offsets on TOPIC (replay or skip) and print the new offsets.

    Live members pick the new offsets up when they rejoin.
    """
    with state.admin() as admin:
        if target.kind == "time":
            offsets: list[QueueOffset] = admin.reset_offsets_to_time(
                name, topic_name, target.value)
        elif target.kind == "offset":
            offsets = admin.reset_offsets(name, topic_name, to=target.value)
        else:
            offsets = admin.reset_offsets(name, topic_name, to=target.kind)
    state.printer.offsets_reset(name, topic_name, offsets)
