"""``ferrymq produce`` and ``ferrymq consume``: messages into a topic and out of it, from a shell.

``produce`` sends its BODY arguments in one batch, or stdin line by line (batched when stdin is
a pipe). ``consume`` never interrupts a client call: SIGINT/SIGTERM only set a flag that the
poll loop checks between short polls, so the consumer's position always matches what was
printed and the commit on exit is exact.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import IO, Any

import click

from ferrymq.admin.cli_params import KEY_VALUE, Position, PositionType
from ferrymq.admin.cli_state import CliState, pass_state
from ferrymq.client.message import Message, ReceivedMessage, SendResult
from ferrymq.client.producer import ACKS
from ferrymq.client.sync import Producer, PullConsumer
from ferrymq.protocol.dedup import check_dedup_key

PRODUCE_DELIVERY_TIMEOUT_S = 30.0
"""``produce``: give up on a message after this long (the producer's retries included)."""
STDIN_BATCH_LINES = 1000
"""``produce`` from a pipe: lines per ``send_batch`` (one per line when stdin is a terminal)."""
STDIN_BATCH_BYTES = 1024 * 1024
"""``produce`` from a pipe: also send a batch once its bodies reach this many bytes."""
POLL_SLICE_S = 0.5
"""``consume``: longest single poll, so that Ctrl-C and ``--timeout`` are noticed promptly."""


# -- produce -------------------------------------------------------------------------------------


def _dedup_key_option(ctx: click.Context, param: click.Parameter,
                      value: str | None) -> str | None:
    """``--dedup-key``: checked like ``Message(dedup_key=...)`` (a usage error, exit 2)."""
    if value is None:
        return None
    try:
        return check_dedup_key(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _stdin_batches(stream: IO[bytes], lines_per_batch: int) -> Iterator[list[bytes]]:
    """Lines of ``stream`` (without their line ending), grouped for ``send_batch``."""
    batch: list[bytes] = []
    size = 0
    for raw in stream:
        line = raw[:-1] if raw.endswith(b"\n") else raw
        if line.endswith(b"\r"):
            line = line[:-1]
        batch.append(line)
        size += len(line)
        if len(batch) >= lines_per_batch or size >= STDIN_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


@click.command()
@click.argument("topic_name", metavar="TOPIC")
@click.argument("bodies", metavar="[BODY]...", nargs=-1)
@click.option("--tag", help="Tag of every message (consumers filter on it).")
@click.option("--key", "keys", multiple=True, help="Business key; repeatable.")
@click.option("--sharding-key", help="Messages with the same sharding key go to one queue, "
                                     "in order.")
@click.option("--property", "properties", type=KEY_VALUE, multiple=True,
              help="User property KEY=VALUE; repeatable.")
@click.option("--dedup-key", callback=_dedup_key_option,
              help="Dedup key of the message (one BODY only): a topic with a dedup window "
                   "stores it once.")
@click.option("--acks", type=click.Choice(sorted(ACKS)), default="all", show_default=True,
              help="On a cluster: answered once every in-sync replica has the message (all), "
                   "or once the leader has it (leader: losable on a failover).")
@pass_state
def produce(state: CliState, topic_name: str, bodies: Sequence[str], tag: str | None,
            keys: Sequence[str], sharding_key: str | None,
            properties: Sequence[tuple[str, str]], dedup_key: str | None, acks: str) -> None:
    """Send each BODY to TOPIC, or, without BODY, one message per line of stdin.

    Prints the message id, queue and offset of every stored message ("duplicate" after a
    message the topic had already stored under the same --dedup-key).
    """
    props = dict(properties) or None
    if dedup_key is not None and len(bodies) != 1:
        raise click.UsageError("--dedup-key needs exactly one BODY")

    def make(body: bytes | str) -> Message:
        return Message(topic_name, body, tags=tag, keys=keys, sharding_key=sharding_key,
                       properties=props, dedup_key=dedup_key)

    printer = state.printer
    with Producer(state.server, connect_timeout_s=state.connect_timeout_s,
                  delivery_timeout_s=max(PRODUCE_DELIVERY_TIMEOUT_S, state.connect_timeout_s),
                  acks=acks, **state.client_options) as producer:
        if bodies:
            results: list[SendResult] = list(producer.send_batch([make(b) for b in bodies]))
            printer.sent(results)
            return
        stdin = sys.stdin.buffer
        per_batch = 1 if stdin.isatty() else STDIN_BATCH_LINES
        for lines in _stdin_batches(stdin, per_batch):
            printer.sent(producer.send_batch([make(b) for b in lines]))


# -- consume -------------------------------------------------------------------------------------


class _StopFlag:
    """Set by SIGINT/SIGTERM while installed; the poll loop checks it between polls."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.event.set()

    def __enter__(self) -> _StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


@click.command()
@click.argument("topic_name", metavar="TOPIC")
@click.option("--group", "-g", required=True, help="Consumer group (offsets are committed per "
                                                  "group).")
@click.option("--tags", default="*", show_default=True, metavar="EXPR",
              help="Tag filter, e.g. 'created || paid'.")
@click.option("--from", "start", type=PositionType(allow_offset=False),
              help="Start this run at earliest, latest or an ISO-8601 time instead of the "
                   "group's committed offset.")
@click.option("--count", "-n", type=click.IntRange(min=1), metavar="N",
              help="Stop after N messages.")
@click.option("--timeout", type=click.FloatRange(min=0), metavar="SECONDS",
              help="Stop when nothing new arrived for this long.")
@pass_state
def consume(state: CliState, topic_name: str, group: str, tags: str, start: Position | None,
            count: int | None, timeout: float | None) -> None:
    """Print messages of TOPIC as a member of consumer group GROUP.

    One line per message: queue, offset, tag, body (UTF-8; newlines escaped). Without --from,
    a group continues from its committed offsets (a new group starts at the end). A topic that
    does not exist yet is waited for (said on stderr) and read from its first message once
    created. Runs until --count messages, --timeout seconds without news, or Ctrl-C; commits
    its position on exit.
    """
    printer = state.printer
    received = 0
    with _StopFlag() as stop, PullConsumer(
        state.server, group=group, auto_offset_reset="latest",
        connect_timeout_s=state.connect_timeout_s,
        reconnect_timeout_s=max(state.connect_timeout_s, 1.0), **state.client_options,
    ) as consumer:
        # a missing topic: the consumer says on stderr that it waits, and reads the topic from
        # its first message once created (seeks find no queue of it to move)
        consumer.subscribe(topic_name, tags)
        if start is not None:
            _seek(consumer, topic_name, start)
        last_news = time.monotonic()
        while not stop.event.is_set():
            wait = POLL_SLICE_S
            if timeout is not None:
                left = last_news + timeout - time.monotonic()
                if left <= 0:
                    break
                wait = min(wait, left)
            limit = 500 if count is None else min(500, count - received)
            msgs: list[ReceivedMessage] = consumer.poll(timeout=wait, max_messages=limit)
            if msgs:
                last_news = time.monotonic()
                printer.received(msgs)
                received += len(msgs)
                if count is not None and received >= count:
                    break
        consumer.commit()


def _seek(consumer: PullConsumer, topic_name: str, start: Position) -> None:
    seeks: dict[str, Callable[[], None]] = {
        "earliest": consumer.seek_to_beginning,
        "latest": consumer.seek_to_end,
    }
    if start.kind == "time":
        consumer.seek_to_time(topic_name, start.value)
    else:
        seeks[start.kind]()
