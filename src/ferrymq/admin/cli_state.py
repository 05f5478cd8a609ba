"""What every ``ferrymq`` command is given: the global options (:class:`CliState`) and the one
error a command fails with (:class:`CommandError`).

The root group (:mod:`ferrymq.admin.cli`) parses the global options (``--server``, ``--json``,
``--debug``, ``--connect-timeout``, ``--user``/``--password``, ``--tls*``) once into a
:class:`CliState` in the click context; the commands of every group take it with
:data:`pass_state` (or ``click.pass_obj``) and make their clients with :meth:`CliState.admin`
and :attr:`CliState.client_options`.
"""

from __future__ import annotations

import contextlib
import ssl
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import click

from ferrymq.admin.output import Printer
from ferrymq.client.sync import AdminClient

F = TypeVar("F", bound=Callable[..., Any])


class CommandError(click.ClickException):
    """A runtime failure (exit 1): printed as one ``error: ...`` line on stderr."""

    exit_code = 1

    def show(self, file: IO[Any] | None = None) -> None:
        """Print ``error: <message>`` to stderr."""
        click.echo(f"error: {self.format_message()}", file=file or sys.stderr)


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

    def printer_with(self, json_flag: bool) -> Printer:
        """A printer for this invocation, in JSON also when the command's own ``--json``
        (:func:`json_option`) was given."""
        return Printer(True) if json_flag and not self.json else self.printer

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


def json_option(f: F) -> F:
    """``--json`` after the command too (same as the global ``ferrymq --json``)."""
    return click.option("--json", "json_flag", is_flag=True,
                        help="Print JSON (same as the global --json).")(f)
