"""``ferrymq message`` and ``ferrymq dlq``: message status, lookup by id or key, dead letters.

Theory of operation
-------------------
Like the rest of the CLI (:mod:`ferrymq.admin.cli`), every command makes a few calls on the
synchronous :class:`~ferrymq.client.sync.AdminClient` and hands the results to
:class:`~ferrymq.admin.output.Printer`. The global state (``--server``, ``--json``, ...) is the
root group's :class:`~ferrymq.admin.cli_state.CliState`.

``dlq redrive`` moves dead letters in chunks of DLQ_ADMIN requests. With ``--rate N`` each
chunk is at most a quarter second's worth and the next one starts only when the messages moved
so far, at ``N`` per second, are due: a large DLQ is fed back to the consumers gradually.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from ferrymq.admin.cli_state import CliState, CommandError, json_option
from ferrymq.admin.progress import Tracker, progress
from ferrymq.client.sync import AdminClient
from ferrymq.protocol import messages as m

REDRIVE_CHUNK = 1000
"""Most dead letters one DLQ_ADMIN request of ``dlq redrive`` moves (bounded broker work)."""
RATE_CHUNKS_PER_S = 4
"""With ``--rate``, chunks per second (each moves rate / 4 letters, at least one)."""
DEFAULT_FIND_LIMIT = 32
"""``message find``: messages shown unless ``--limit``."""
DEFAULT_DLQ_LIST_LIMIT = 100
"""``dlq list``: dead letters shown unless ``--limit``."""


class MessageIdType(click.ParamType[str]):
    """A message id: 28 hex digits (topic id, queue, offset)."""

    name = "MSG_ID"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        """Check the shape; the broker checks the rest."""
        text = str(value).strip()
        if len(text) != 28 or any(c not in "0123456789abcdefABCDEF" for c in text):
            self.fail(f"{text!r} is not a message id (28 hex digits)", param, ctx)
        return text.upper()


MSG_ID = MessageIdType()


# -- message -------------------------------------------------------------------------------------


@click.group()
def message() -> None:
    """Look at one message: its consume status per group, its content, or find it by key."""


@message.command("status")
@click.argument("msg_id", type=MSG_ID)
@json_option
@click.pass_obj
def message_status(state: CliState, msg_id: str, json_flag: bool) -> None:
    """Show MSG_ID's state in every delivery group that reads its topic.

    WAITING (not delivered yet), DELIVERED (to which member, lease until), CONSUMED (acked),
    FILTERED (skipped: its tag does not match the group's tag expression), RETRYING (attempts
    so far, next attempt at, last failure) or DEAD (in the group's dead-letter queue, with the
    reason).
    """
    with state.admin() as admin:
        resp = admin.message_status(msg_id)
    state.printer_with(json_flag).message_status(msg_id, resp)


@message.command("show")
@click.argument("msg_id", type=MSG_ID)
@json_option
@click.pass_obj
def message_show(state: CliState, msg_id: str, json_flag: bool) -> None:
    """Print the message MSG_ID: its fields, then its body."""
    with state.admin() as admin:
        msg = admin.get_message(msg_id)
    state.printer_with(json_flag).message(msg)


@message.command("cancel")
@click.argument("msg_id", type=MSG_ID)
@json_option
@click.pass_obj
def message_cancel(state: CliState, msg_id: str, json_flag: bool) -> None:
    """Cancel the scheduled (delayed) message MSG_ID: it is never delivered.

    Fails (exit 1) when MSG_ID is not a pending scheduled message: already delivered (or due),
    already cancelled, or not scheduled at all.
    """
    with state.admin() as admin:
        admin.cancel_scheduled(msg_id)
    state.printer_with(json_flag).cancelled(msg_id)


@message.command("find")
@click.argument("topic_name", metavar="TOPIC")
@click.option("--key", "-k", required=True, help="The business key to look for.")
@click.option("--limit", "-n", type=click.IntRange(min=1), default=DEFAULT_FIND_LIMIT,
              show_default=True, metavar="N", help="Show at most N messages.")
@json_option
@click.pass_obj
def message_find(state: CliState, topic_name: str, key: str, limit: int, json_flag: bool) -> None:
    """List the messages of TOPIC whose keys include KEY, newest first.

    Served by the broker's key index, which is built in the background: messages stored a
    moment ago are searched directly, and a note on stderr says when part of the topic could
    not be searched yet.
    """
    if not key or "\x00" in key:
        raise click.BadParameter("must be a non-empty key without NUL", param_hint="--key")
    with state.admin() as admin:
        resp = admin.find_by_key(topic_name, key, limit)
    state.printer_with(json_flag).found_by_key(topic_name, key, resp)


# -- dlq -----------------------------------------------------------------------------------------


@click.group()
def dlq() -> None:
    """List, show, redrive and purge a delivery group's dead letters (%DLQ%<group>)."""


@dlq.command("list")
@click.argument("group")
@click.option("--limit", "-n", type=click.IntRange(min=1), default=DEFAULT_DLQ_LIST_LIMIT,
              show_default=True, metavar="N", help="Show at most N dead letters (oldest first).")
@json_option
@click.pass_obj
def dlq_list(state: CliState, group: str, limit: int, json_flag: bool) -> None:
    """List GROUP's dead letters not yet redriven or purged, oldest first."""
    with state.admin() as admin:
        letters = admin.dlq_list(group, limit)
    state.printer_with(json_flag).dead_letters(group, letters)


@dlq.command("show")
@click.argument("group")
@click.argument("msg_id", type=MSG_ID)
@json_option
@click.pass_obj
def dlq_show(state: CliState, group: str, msg_id: str, json_flag: bool) -> None:
    """Print one dead letter of GROUP: MSG_ID is the message's original id (or its id in the
    dead-letter queue)."""
    with state.admin() as admin:
        letter = admin.dlq_get(group, msg_id)
    if letter is None:
        raise CommandError(f"message {msg_id} is not in the dead-letter queue of group {group}")
    state.printer_with(json_flag).dead_letter(letter)


@dlq.command("redrive")
@click.argument("group")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), metavar="N",
              help="Move at most N messages per second (default: as fast as possible).")
@click.option("--max", "max_messages", type=click.IntRange(min=1), metavar="N",
              help="Move at most N messages (the oldest; default: all).")
@click.option("--offset", type=click.IntRange(min=0), metavar="N",
              help="Only the dead letter at offset N of the dead-letter queue (see dlq list), "
              "wherever it is.")
@click.option("--dry-run", is_flag=True, help="Only say how many would be moved.")
@json_option
@click.pass_obj
def dlq_redrive(state: CliState, group: str, rate: float | None, max_messages: int | None,
                offset: int | None, dry_run: bool, json_flag: bool) -> None:
    """Send GROUP's dead letters back to the group, oldest first (or only the one at
    --offset).

    They are delivered again at once (from the group's retry queue) with a fresh attempt count,
    with their original topic, id and properties.
    """
    printer = state.printer_with(json_flag)
    if offset is not None and (rate is not None or max_messages is not None):
        raise click.UsageError("--offset names one dead letter: it takes no --rate or --max")
    with state.admin() as admin:
        if offset is not None:
            resp = admin.dlq_redrive(group, dry_run=dry_run, offset=offset)
            printer.dlq_done("redrive", group, resp.count, resp.first, resp.end, dry_run)
            return
        if dry_run:
            resp = admin.dlq_redrive(group, max_messages or 0, dry_run=True)
            printer.dlq_done("redrive", group, resp.count, resp.first, resp.end, True)
            return
        with progress(f"redriving {group}", json_mode=printer.json_mode) as tracker:
            if tracker.shown:  # the bar's total; read-only, and only for people
                tracker.set_total(admin.dlq_redrive(group, max_messages or 0,
                                                    dry_run=True).count)
            count, first, end = _redrive(admin, group, rate, max_messages, tracker)
    printer.dlq_done("redrive", group, count, first, end, False)


def _redrive(admin: AdminClient, group: str, rate: float | None,
             max_messages: int | None, tracker: Tracker) -> tuple[int, int, int]:
    """Redrive in chunks (paced to ``rate``); return (moved, first offset, end offset)."""
    chunk = REDRIVE_CHUNK
    if rate is not None:
        chunk = max(1, min(REDRIVE_CHUNK, int(rate / RATE_CHUNKS_PER_S)))
    moved = 0
    covered = 0
    first = end = -1
    started = time.monotonic()
    while max_messages is None or covered < max_messages:
        if rate is not None:
            due = started + moved / rate
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        n = chunk if max_messages is None else min(chunk, max_messages - covered)
        resp: m.DlqAdminResponse = admin.dlq_redrive(group, n)
        if resp.end <= resp.first:
            break
        first = resp.first if first < 0 else first
        end = resp.end
        covered += resp.end - resp.first
        moved += resp.count
        tracker.advance(resp.count)
    return moved, max(first, 0), max(end, 0)


@dlq.command("purge")
@click.argument("group")
@click.option("--offset", type=click.IntRange(min=0), metavar="N",
              help="Only the dead letter at offset N of the dead-letter queue (see dlq list), "
              "wherever it is.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--dry-run", is_flag=True, help="Only say how many would be dropped.")
@json_option
@click.pass_obj
def dlq_purge(state: CliState, group: str, offset: int | None, yes: bool, dry_run: bool,
              json_flag: bool) -> None:
    """Drop every dead letter of GROUP (or only the one at --offset).

    Asks for confirmation unless --yes or --dry-run; without a terminal, --yes is required.
    """
    printer = state.printer_with(json_flag)
    ask = not dry_run and not yes
    if ask and not sys.stdin.isatty():
        raise click.UsageError("refusing to purge without --yes (stdin is not a terminal)")
    with state.admin() as admin:
        if ask:
            would = admin.dlq_purge(group, dry_run=True, offset=offset)
            what = (f"the dead letter at offset {offset}" if offset is not None
                    else f"{would.count} dead letters")
            click.confirm(f"Drop {what} of group {group!r}?", abort=True, err=True)
        with progress(f"purging {group}", json_mode=printer.json_mode):
            resp = admin.dlq_purge(group, dry_run=dry_run, offset=offset)
    printer.dlq_done("purge", group, resp.count, resp.first, resp.end, dry_run)
