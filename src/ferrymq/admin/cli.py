"""The ``ferrymq`` command line's root: the global options, the one error boundary, ``ferrymq
broker``, and the command groups it gathers.

Theory of operation
-------------------
Each command parses its arguments, makes one or a few calls on the synchronous clients
(:class:`~ferrymq.client.sync.AdminClient`, :class:`~ferrymq.client.sync.Producer`,
:class:`~ferrymq.client.sync.PullConsumer`) and hands the result to
:class:`~ferrymq.admin.output.Printer`. Nothing here decides anything the clients or the broker
decide already. The commands live in one module per group: :mod:`~ferrymq.admin.cli_topics`
(``topic``), :mod:`~ferrymq.admin.cli_cluster` (``cluster``),
:mod:`~ferrymq.admin.cli_produce_consume` (``produce``, ``consume``),
:mod:`~ferrymq.admin.cli_groups` (``group``), :mod:`~ferrymq.admin.cli_users` (``user``,
``whoami``), :mod:`~ferrymq.admin.cli_delivery` (``message``, ``dlq``), :mod:`~ferrymq.admin.top`
(``top``) and
:mod:`~ferrymq.admin.bench` (``bench``); what they share is :mod:`~ferrymq.admin.cli_state` (the
global options, :class:`~ferrymq.admin.cli_state.CommandError`) and
:mod:`~ferrymq.admin.cli_params` (parameter types).

Errors: every :class:`~ferrymq.errors.FerryMQError` that escapes a command is turned into
:class:`~ferrymq.admin.cli_state.CommandError` (exit 1) by :class:`FerryGroup`, which prints
``error: <message>`` on one line of stderr; ``--debug`` adds the traceback. Bad arguments are
click usage errors (exit 2).

Security: ``--user``/``--password`` (or ``FERRYMQ_USER``/``FERRYMQ_PASSWORD``; prefer the
environment, a command line is visible to other local users) and ``--tls``/``--tls-ca``/
``--tls-cert``/``--tls-key`` apply to every command that talks to a broker. ``ferrymq user``
manages users over the wire (the broker at ``--server``; an admin ``--user``), or edits a users
file offline when ``--users-file`` is given (see docs/security.md).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import click

from ferrymq._connect import client_tls_context
from ferrymq._hints import for_cli
from ferrymq.admin.bench import bench
from ferrymq.admin.cli_cluster import cluster
from ferrymq.admin.cli_delivery import dlq, message
from ferrymq.admin.cli_dev_cluster import dev_cluster
from ferrymq.admin.cli_groups import group
from ferrymq.admin.cli_params import KEY_VALUE, KeyValueType, Position, PositionType, parse_time_ms
from ferrymq.admin.cli_produce_consume import consume, produce
from ferrymq.admin.cli_state import CliState, CommandError, pass_state
from ferrymq.admin.cli_topics import topic
from ferrymq.admin.cli_users import user, whoami
from ferrymq.admin.top import top
from ferrymq.errors import FerryMQError

__all__ = ["KEY_VALUE", "CliState", "CommandError", "FerryGroup", "KeyValueType", "Position",
           "PositionType", "cli", "main", "parse_time_ms", "pass_state"]

DEFAULT_SERVER = "127.0.0.1:9876"
DEFAULT_CONNECT_TIMEOUT_S = 5.0
"""How long a command keeps trying to reach the broker before it reports an error."""


# -- errors ------------------------------------------------------------------------------------


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
@click.option("--http-port", type=click.IntRange(0, 65535),
              help="Port of /metrics, /healthz and /readyz on --host (default 9877; 0: off).")
@click.option("--kafka-port", type=click.IntRange(0, 65535),
              help="Port of the Kafka-protocol listener on --host (default 0: off).")
@click.option("--data-dir", help="Directory for topics, offsets and state.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="TOML file with broker settings (top level or a [broker] table).")
@click.option("--flush", type=click.Choice(["sync", "async"]),
              help="sync: ack after fsync (group commit); async: ack after write, fsync later.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                                               case_sensitive=False),
              help="Broker log level (default INFO).")
@click.option("--log-format", type=click.Choice(["text", "json"]),
              help="Log lines as text (default) or one JSON object per line.")
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
@click.option("--metadata", metavar="URL",
              help="Join a cluster whose metadata lives in etcd://host:port[,host:port...].")
@click.option("--cluster", "cluster_name", metavar="NAME",
              help="The cluster's name (default ferrymq).")
@click.option("--broker-id", type=click.IntRange(0, 2**31 - 1),
              help="This broker's id in the cluster (unique).")
@click.option("--advertised-address", metavar="HOST:PORT",
              help="Address clients and brokers reach this broker at (default: --host:--port).")
def broker(host: str | None, port: int | None, http_port: int | None, kafka_port: int | None,
           data_dir: str | None,
           config_file: str | None,
           flush: str | None, log_level: str | None, log_format: str | None,
           users_file: str | None,
           insecure: bool | None, tls_cert_file: str | None, tls_key_file: str | None,
           tls_ca_file: str | None, tls_client_auth: str | None, metadata: str | None,
           cluster_name: str | None, broker_id: int | None,
           advertised_address: str | None) -> None:
    """Run a broker in the foreground until SIGTERM or Ctrl-C (graceful shutdown, exit 0).

    Settings come from, lowest to highest priority: defaults, --config FILE, FERRYMQ_<SETTING>
    environment variables, these flags. Logs go to stderr.
    """
    from ferrymq._faults import Faults
    from ferrymq.broker.config import load
    from ferrymq.broker.server import run

    overrides = {"host": host, "port": port, "http_port": http_port, "kafka_port": kafka_port,
                 "data_dir": data_dir,
                 "flush": flush,
                 "log_level": log_level.upper() if log_level else None, "log_format": log_format,
                 "users_file": users_file, "insecure": insecure or None,
                 "tls_cert_file": tls_cert_file, "tls_key_file": tls_key_file,
                 "tls_ca_file": tls_ca_file, "tls_client_auth": tls_client_auth,
                 "metadata": metadata, "cluster": cluster_name, "broker_id": broker_id,
                 "advertised_address": advertised_address}
    config = load(config_file, os.environ, overrides)
    run(config, Faults.from_env(os.environ),  # tests' fault hooks; none in production
        notify_socket=os.environ.get("NOTIFY_SOCKET"))  # systemd Type=notify


for command in (topic, cluster, produce, consume, group, user, whoami, message, dlq, top, bench,
                dev_cluster):
    cli.add_command(command)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``ferrymq`` console script.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).
    """
    cli.main(args=list(argv) if argv is not None else None, prog_name="ferrymq")


if __name__ == "__main__":
    main()
