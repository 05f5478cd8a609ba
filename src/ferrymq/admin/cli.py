"""The ``ferrymq`` command line: broker, topics, groups, produce, consume, bench.

Theory of operation
-------------------
Each command parses its arguments, makes one or a few calls on the synchronous clients
(:class:`~ferrymq.client.sync.AdminClient`, :class:`~ferrymq.client.sync.Producer`,
:class:`~ferrymq.client.sync.PullConsumer`) and hands the result to
:class:`~ferrymq.admin.output.Printer`. Nothing here decides anything the clients or the broker
decide already.

Errors: every :class:`~ferrymq.errors.FerryMQError` that escapes a command is turned into
:class:`CommandError` (exit 1) by :class:`FerryGroup`, which prints ``error: <message>`` on one
line of stderr; ``--debug`` adds the traceback. Bad arguments are click usage errors (exit 2).

Security: ``--user``/``--password`` (or ``FERRYMQ_USER``/``FERRYMQ_PASSWORD``; prefer the
environment, a command line is visible to other local users) and ``--tls``/``--tls-ca``/
``--tls-cert``/``--tls-key`` apply to every command that talks to a broker. ``ferrymq user``
manages users over the wire (the broker at ``--server``; an admin ``--user``), or edits a users
file offline when ``--users-file`` is given (see docs/security.md).

``consume`` never interrupts a client call: SIGINT/SIGTERM only set a flag that the poll loop
checks between short polls, so the consumer's position always matches what was printed and the
commit on exit is exact.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import secrets
import signal
import ssl
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from types import FrameType
from typing import IO, Any, Literal

import click

from ferrymq._connect import client_tls_context
from ferrymq._hints import for_cli
from ferrymq.admin.bench import bench
from ferrymq.admin.cli_delivery import dlq, message
from ferrymq.admin.output import Printer
from ferrymq.broker.auth import User, read_users_file, update_users_file
from ferrymq.client.admin import (
    DeliveryGroupDescription,
    GroupDescription,
    GroupListing,
    QueueOffset,
    TopicDescription,
    TopicListing,
    UserInfo,
)
from ferrymq.client.message import Message, ReceivedMessage, SendResult
from ferrymq.client.sync import AdminClient, Producer, PullConsumer
from ferrymq.errors import FerryMQError, UnknownGroupError, UserAlreadyExistsError
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import SALT_BYTES, ScramCredential, check_user_name
from ferrymq.protocol.dedup import check_dedup_key

DEFAULT_SERVER = "127.0.0.1:9876"
DEFAULT_CONNECT_TIMEOUT_S = 5.0
"""How long a command keeps trying to reach the broker before it reports an error."""
PRODUCE_DELIVERY_TIMEOUT_S = 30.0
"""``produce``: give up on a message after this long (the producer's retries included)."""
STDIN_BATCH_LINES = 1000
"""``produce`` from a pipe: lines per ``send_batch`` (one per line when stdin is a terminal)."""
STDIN_BATCH_BYTES = 1024 * 1024
"""``produce`` from a pipe: also send a batch once its bodies reach this many bytes."""
POLL_SLICE_S = 0.5
"""``consume``: longest single poll, so that Ctrl-C and ``--timeout`` are noticed promptly."""


# -- errors ------------------------------------------------------------------------------------


class CommandError(click.ClickException):
    """A runtime failure (exit 1): printed as one ``error: ...`` line on stderr."""

    exit_code = 1

    def show(self, file: IO[Any] | None = None) -> None:
        """Print ``error: <message>`` to stderr."""
        click.echo(f"error: {self.format_message()}", file=file or sys.stderr)


def _describe(exc: BaseException) -> str:
    """One line for an error: its message in the CLI's words (its flags and environment
    variables, not the Python API's keyword arguments: :func:`ferrymq._hints.for_cli`)."""
    text = " ".join(str(exc).split())
    return for_cli(text) or type(exc).__name__


class FerryGroup(click.Group):
    """The root group: maps FerryMQ errors (and OSError, e.g. a port in use) to
    :class:`CommandError` (traceback with --debug)."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; translate FerryMQ errors at this one boundary."""
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            # the reader went away (``| head``): stop quietly, like other Unix tools
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(0)
        except (FerryMQError, OSError) as exc:
            state = ctx.find_object(CliState)
            if state is not None and state.debug:
                traceback.print_exc(file=sys.stderr)
            raise CommandError(_describe(exc)) from exc


# -- parameter types -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Position:
    """Where to start or move to: ``earliest``, ``latest``, an ``offset`` or a ``time`` (ms)."""

    kind: Literal["earliest", "latest", "offset", "time"]
    value: int = 0


def parse_time_ms(text: str) -> int:
    """ISO-8601 time to ms since the epoch; a time without a zone is local time.

    Raises:
        ValueError: not an ISO-8601 date or time.
    """
    dt = _dt.datetime.fromisoformat(text)
    if dt.tzinfo is None:
        dt = dt.astimezone()
    return int(dt.timestamp() * 1000)


class PositionType(click.ParamType[Position]):
    """``earliest``, ``latest``, an ISO-8601 time, and (if allowed) an offset."""

    def __init__(self, allow_offset: bool) -> None:
        self.allow_offset = allow_offset
        self.name = ("earliest|latest|OFFSET|ISO-TIME" if allow_offset
                     else "earliest|latest|ISO-TIME")

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Position:
        """Parse the option value."""
        if isinstance(value, Position):
            return value
        text = str(value).strip()
        if text in ("earliest", "latest"):
            return Position(text)  # type: ignore[arg-type]
        if self.allow_offset and text.isdigit():
            return Position("offset", int(text))
        try:
            return Position("time", parse_time_ms(text))
        except ValueError:
            self.fail(f"{text!r} is not {self.name.replace('|', ', ')}", param, ctx)


class KeyValueType(click.ParamType[tuple[str, str]]):
    """``key=value`` (the value may contain ``=``)."""

    name = "KEY=VALUE"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> tuple[str, str]:
        """Split at the first ``=``."""
        if isinstance(value, tuple):
            return value
        key, sep, val = str(value).partition("=")
        if not sep or not key:
            self.fail(f"{value!r} is not KEY=VALUE", param, ctx)
        return key, val


KEY_VALUE = KeyValueType()


# -- global state --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CliState:
    """Global options, shared by every command through the click context."""

    server: str
    json: bool
    debug: bool
    connect_timeout_s: float
    auth: tuple[str, str] | None = None
    tls: ssl.SSLContext | None = None
    password_pending_for: str | None = None
    """``--user`` given without a password to a ``user`` command: asked for only when the
    command talks to a broker (offline edits of a users file need none)."""

    @property
    def printer(self) -> Printer:
        """A printer for this invocation's output mode."""
        return Printer(self.json)

    @property
    def client_options(self) -> dict[str, Any]:
        """``auth=`` and ``tls=`` for every client this invocation creates."""
        return {"auth": self.auth, "tls": self.tls}

    @contextlib.contextmanager
    def admin(self) -> Iterator[AdminClient]:
        """An admin client for ``--server``, connected.

        Raises:
            ConnectionClosedError: no broker answered within ``--connect-timeout``.
        """
        with AdminClient(self.server, connect_timeout_s=self.connect_timeout_s,
                         reconnect_timeout_s=self.connect_timeout_s,
                         **self.client_options) as client:
            client.hello()  # connect first: a wrong address fails within connect_timeout_s
            yield client


pass_state = click.make_pass_decorator(CliState)


@click.group(cls=FerryGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--server", default=DEFAULT_SERVER, show_default=True, envvar="FERRYMQ_SERVER",
              metavar="HOST:PORT", help="Broker to talk to (env FERRYMQ_SERVER).")
@click.option("--json", "json_mode", is_flag=True, help="Print JSON instead of tables.")
@click.option("--debug", is_flag=True, help="Show tracebacks and client debug logs.")
@click.option("--connect-timeout", type=click.FloatRange(min=0.1), metavar="SECONDS",
              default=DEFAULT_CONNECT_TIMEOUT_S, show_default=True,
              envvar="FERRYMQ_CONNECT_TIMEOUT",
              help="How long to keep trying to reach the broker (env FERRYMQ_CONNECT_TIMEOUT).")
@click.option("--user", envvar="FERRYMQ_USER", metavar="NAME",
              help="Authenticate as this user (env FERRYMQ_USER).")
@click.option("--password", envvar="FERRYMQ_PASSWORD", metavar="SECRET",
              help="The user's secret (prefer env FERRYMQ_PASSWORD: arguments are visible to "
                   "other local users; prompted for when --user is given on a terminal).")
@click.option("--tls", "tls_on", is_flag=True, envvar="FERRYMQ_TLS",
              help="Connect with TLS, verifying the broker with the system's CAs (env FERRYMQ_TLS).")
@click.option("--tls-ca", type=click.Path(dir_okay=False), envvar="FERRYMQ_TLS_CA", metavar="FILE",
              help="Connect with TLS, verifying the broker with this CA bundle (implies --tls).")
@click.option("--tls-cert", type=click.Path(dir_okay=False), envvar="FERRYMQ_TLS_CERT",
              metavar="FILE", help="Client certificate (PEM) to present (with --tls-key).")
@click.option("--tls-key", type=click.Path(dir_okay=False), envvar="FERRYMQ_TLS_KEY",
              metavar="FILE", help="Private key of --tls-cert.")
@click.version_option(package_name="ferrymq", prog_name="ferrymq")
@click.pass_context
def cli(ctx: click.Context, server: str, json_mode: bool, debug: bool,
        connect_timeout: float, user: str | None, password: str | None, tls_on: bool,
        tls_ca: str | None, tls_cert: str | None, tls_key: str | None) -> None:
    """FerryMQ: run a broker, manage topics and consumer groups, produce and consume."""
    if debug:
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    auth: tuple[str, str] | None = None
    pending: str | None = None
    if user:
        if password is None and sys.stdin.isatty() and ctx.invoked_subcommand not in (
                "broker", "user"):
            password = click.prompt(f"password for {user}", hide_input=True, err=True)
        if password is None and ctx.invoked_subcommand == "user":
            pending = user
        elif not password:
            raise click.UsageError("--user needs a password (--password or FERRYMQ_PASSWORD)")
        else:
            auth = (user, password)
    elif password:
        raise click.UsageError("--password needs --user")
    if (tls_cert and not tls_key) or (tls_key and not tls_cert):
        raise click.UsageError("--tls-cert and --tls-key go together")
    tls = None
    if tls_on or tls_ca or tls_cert:
        try:
            tls = client_tls_context(tls_ca or True, cert_file=tls_cert, key_file=tls_key)
        except FerryMQError as exc:
            raise click.UsageError(str(exc)) from None
    ctx.obj = CliState(server, json_mode, debug, connect_timeout, auth, tls, pending)


# -- broker --------------------------------------------------------------------------------------


@cli.command()
@click.option("--host", help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=click.IntRange(0, 65535), help="TCP port (default 9876).")
@click.option("--data-dir", help="Directory for topics, offsets and state.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="TOML file with broker settings (top level or a [broker] table).")
@click.option("--flush", type=click.Choice(["sync", "async"]),
              help="sync: ack after fsync (group commit); async: ack after write, fsync later.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                                               case_sensitive=False),
              help="Broker log level (default INFO).")
@click.option("--users-file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Turn authentication on with this users file (see `ferrymq user add`).")
@click.option("--insecure", is_flag=True, default=None,
              help="Allow a non-loopback --host without authentication.")
@click.option("--tls-cert-file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Serve TLS with this certificate chain (PEM).")
@click.option("--tls-key-file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Private key (PEM) of --tls-cert-file.")
@click.option("--tls-ca-file", type=click.Path(dir_okay=False), metavar="FILE",
              help="CA bundle to verify client certificates with.")
@click.option("--tls-client-auth", type=click.Choice(["none", "optional", "required"]),
              help="Client certificates: none (default), optional or required.")
def broker(host: str | None, port: int | None, data_dir: str | None, config_file: str | None,
           flush: str | None, log_level: str | None, users_file: str | None,
           insecure: bool | None, tls_cert_file: str | None, tls_key_file: str | None,
           tls_ca_file: str | None, tls_client_auth: str | None) -> None:
    """Run a broker in the foreground until SIGTERM or Ctrl-C (graceful shutdown, exit 0).

    Settings come from, lowest to highest priority: defaults, --config FILE, FERRYMQ_<SETTING>
    environment variables, these flags. Logs go to stderr.
    """
    from ferrymq._faults import Faults
    from ferrymq.broker.config import load
    from ferrymq.broker.server import run

    overrides = {"host": host, "port": port, "data_dir": data_dir, "flush": flush,
                 "log_level": log_level.upper() if log_level else None,
                 "users_file": users_file, "insecure": insecure or None,
                 "tls_cert_file": tls_cert_file, "tls_key_file": tls_key_file,
                 "tls_ca_file": tls_ca_file, "tls_client_auth": tls_client_auth}
    config = load(config_file, os.environ, overrides)
    run(config, Faults.from_env(os.environ))  # tests' fault hooks; none in production


# -- topics --------------------------------------------------------------------------------------


@cli.group()
def topic() -> None:
    """Create, list, describe and delete topics."""


@topic.command("create")
@click.argument("name")
@click.option("--queues", type=click.IntRange(min=1), required=True, metavar="N",
              help="Number of queues (partitions).")
@click.option("--config", "config", type=KEY_VALUE, multiple=True,
              help="Topic setting (retention_ms, retention_bytes, segment_bytes, segment_ms); "
                   "repeatable.")
@pass_state
def topic_create(state: CliState, name: str, queues: int,
                 config: Sequence[tuple[str, str]]) -> None:
    """Create topic NAME with N queues."""
    with state.admin() as admin:
        resp: m.CreateTopicResponse = admin.create_topic(name, queues, dict(config))
    state.printer.topic_created(name, resp)


@topic.command("list")
@click.option("--internal", is_flag=True,
              help="Also list the broker's own topics (%RETRY%/%DLQ% of delivery groups, "
                   "transactions).")
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
    with state.admin() as admin:
        admin.delete_topic(name)
    state.printer.topic_deleted(name)


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


@cli.command()
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
@pass_state
def produce(state: CliState, topic_name: str, bodies: Sequence[str], tag: str | None,
            keys: Sequence[str], sharding_key: str | None,
            properties: Sequence[tuple[str, str]], dedup_key: str | None) -> None:
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
                  **state.client_options) as producer:
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


@cli.command()
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


# -- groups --------------------------------------------------------------------------------------


@cli.group()
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


# -- users ---------------------------------------------------------------------------------------

USERS_FILE_OPTION = click.option(
    "--users-file", type=click.Path(dir_okay=False), envvar="FERRYMQ_USERS_FILE",
    metavar="FILE", help="Edit this users file offline instead of asking the broker at --server "
                         "(env FERRYMQ_USERS_FILE); the broker reloads it when it changes.")


@cli.group()
def user() -> None:
    """Add, remove and list users (authentication and ACLs).

    Without --users-file the broker at --server makes the change (the global --user must be an
    admin; FERRYMQ_USER / FERRYMQ_PASSWORD); with --users-file the file is edited offline.
    """


def _over_the_wire(state: CliState) -> CliState:
    """``state`` ready to talk to the broker: the admin's password asked for on a terminal if
    ``--user`` came without one."""
    user_name = state.password_pending_for
    if user_name is None:
        return state
    if not sys.stdin.isatty():
        raise click.UsageError("--user needs a password (--password or FERRYMQ_PASSWORD)")
    password = str(click.prompt(f"password for {user_name}", hide_input=True, err=True))
    return replace(state, auth=(user_name, password), password_pending_for=None)


def _read_secret(password_stdin: bool, generate: bool, name: str) -> tuple[str, bool]:
    if password_stdin:
        secret = sys.stdin.readline().rstrip("\r\n")
        if not secret:
            raise click.UsageError("--password-stdin: empty secret")
        return secret, False
    if generate:
        return secrets.token_urlsafe(24), True
    if not sys.stdin.isatty():
        raise click.UsageError("no terminal to prompt on: use --password-stdin or --generate")
    secret = click.prompt(f"secret for {name}", hide_input=True, confirmation_prompt=True,
                          err=True)
    return str(secret), False


@user.command("add")
@click.argument("name")
@USERS_FILE_OPTION
@click.option("--password-stdin", is_flag=True, help="Read the secret from the first line of "
                                                     "stdin.")
@click.option("--generate", is_flag=True, help="Generate a random secret and print it once.")
@click.option("--admin", is_flag=True, help="May do everything (topics, users, offset resets, "
                                            "dead letters).")
@click.option("--produce", multiple=True, metavar="PATTERN",
              help="Topics the user may produce to (* and ? patterns); repeatable.")
@click.option("--consume", multiple=True, metavar="PATTERN",
              help="Topics the user may consume from; repeatable.")
@click.option("--group", "groups", multiple=True, metavar="PATTERN",
              help="Consumer/delivery/producer groups and transactional ids the user may use; "
                   "repeatable.")
@click.option("--produce-bytes-per-s", type=click.IntRange(min=0), default=0, show_default=True,
              help="Produce quota in bytes per second (0: none).")
@click.option("--replace", "replace_user", is_flag=True,
              help="Replace the user if it exists (new secret and rights).")
@pass_state
def user_add(state: CliState, name: str, users_file: str | None, password_stdin: bool,
             generate: bool, admin: bool, produce: Sequence[str], consume: Sequence[str],
             groups: Sequence[str], produce_bytes_per_s: int, replace_user: bool) -> None:
    """Add user NAME with a secret (prompted for, --password-stdin or --generate) and rights.

    Only a salted SCRAM-SHA-256 form of the secret is derived here and written or sent: the
    secret never leaves this process. Without any right the user may only connect (default
    deny). Over the wire the user can log in at once.
    """
    try:
        check_user_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from None
    if password_stdin and generate:
        raise click.UsageError("--password-stdin and --generate exclude each other")
    if users_file is None:
        broker_state = _over_the_wire(state)
        secret, generated = _read_secret(password_stdin, generate, name)
        try:
            with broker_state.admin() as client:
                created = client.add_user(
                    name, secret, admin=admin, produce=produce, consume=consume, groups=groups,
                    produce_bytes_per_s=produce_bytes_per_s, replace=replace_user)
        except UserAlreadyExistsError:
            raise CommandError(f"user {name!r} exists on {state.server} (use --replace)"
                               ) from None
        where: dict[str, Any] = {"server": state.server, "created": created}
        done = f"user {name} {'added' if created else 'replaced'} on {state.server}"
    else:
        if name in read_users_file(users_file) and not replace_user:
            raise CommandError(f"user {name!r} exists in {users_file} (use --replace)")
        secret, generated = _read_secret(password_stdin, generate, name)
        cred = ScramCredential.derive(secret, secrets.token_bytes(SALT_BYTES))
        update_users_file(users_file, {name: User(name, cred, admin, tuple(produce),
                                                  tuple(consume), tuple(groups),
                                                  produce_bytes_per_s)})
        where = {"users_file": users_file}
        done = f"user {name} written to {users_file}"
    if state.printer.json_mode:
        state.printer.json({"user": name, **where, **({"secret": secret} if generated else {})})
        return
    state.printer.line(done)
    if generated:
        state.printer.line(f"secret: {secret}  (shown once; it is not stored)")


@user.command("remove")
@click.argument("name")
@USERS_FILE_OPTION
@pass_state
def user_remove(state: CliState, name: str, users_file: str | None) -> None:
    """Remove user NAME.

    Over the wire the broker closes the user's open connections and refuses to remove the last
    admin. Offline (--users-file), open connections stay but lose every right once the broker
    reloads the file.
    """
    if users_file is None:
        with _over_the_wire(state).admin() as client:
            closed = client.remove_user(name)
        where: dict[str, Any] = {"server": state.server, "connections_closed": closed}
        done = (f"user {name} removed from {state.server} "
                f"({closed} open connection{'' if closed == 1 else 's'} closed)")
    else:
        if name not in read_users_file(users_file):
            raise CommandError(f"no user {name!r} in {users_file}")
        update_users_file(users_file, {name: None})
        where = {"users_file": users_file}
        done = f"user {name} removed from {users_file}"
    if state.printer.json_mode:
        state.printer.json({"user": name, "removed": True, **where})
    else:
        state.printer.line(done)


@user.command("list")
@USERS_FILE_OPTION
@pass_state
def user_list(state: CliState, users_file: str | None) -> None:
    """List the users with their rights (never secrets or keys): the broker's at --server, or
    those of --users-file."""
    if users_file is None:
        with _over_the_wire(state).admin() as client:
            rows: list[UserInfo] = client.list_users()
        state.printer.users(rows)
        return
    users = read_users_file(users_file).values()
    state.printer.users([UserInfo(u.name, u.admin, list(u.produce), list(u.consume),
                                  list(u.groups), u.produce_bytes_per_s) for u in users])


@cli.command()
@pass_state
def whoami(state: CliState) -> None:
    """Show the user the broker authenticated this client as, and its rights."""
    with state.admin() as admin:
        resp: m.WhoAmIResponse = admin.whoami()
    state.printer.whoami(resp)


cli.add_command(message)
cli.add_command(dlq)
cli.add_command(bench)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``ferrymq`` console script.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).
    """
    cli.main(args=list(argv) if argv is not None else None, prog_name="ferrymq")


if __name__ == "__main__":
    main()
