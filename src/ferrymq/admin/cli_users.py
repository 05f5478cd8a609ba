"""``ferrymq user`` and ``ferrymq whoami``: users and their rights, over the wire or in a users
file offline.

Without ``--users-file`` the broker at ``--server`` makes the change (the global ``--user`` must
be an admin); with it the file is edited here (see docs/security.md). Only a salted
SCRAM-SHA-256 form of a secret is derived here and written or sent.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import click

from ferrymq.admin.cli_state import CliState, CommandError, pass_state
from ferrymq.broker.auth import User, read_users_file, update_users_file
from ferrymq.client.admin import UserInfo
from ferrymq.errors import UserAlreadyExistsError
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import SALT_BYTES, SHA512_MECHANISM, ScramCredential, check_user_name

USERS_FILE_OPTION = click.option(
    "--users-file", type=click.Path(dir_okay=False), envvar="FERRYMQ_USERS_FILE",
    metavar="FILE", help="Edit this users file offline instead of asking the broker at --server "
                         "(env FERRYMQ_USERS_FILE); the broker reloads it when it changes.")


@click.group()
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
        sha512 = ScramCredential.derive(secret, secrets.token_bytes(SALT_BYTES),
                                        mechanism=SHA512_MECHANISM)
        update_users_file(users_file, {name: User(name, cred, admin, tuple(produce),
                                                  tuple(consume), tuple(groups),
                                                  produce_bytes_per_s, sha512)})
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


@click.command()
@pass_state
def whoami(state: CliState) -> None:
    """Show the user the broker authenticated this client as, and its rights."""
    with state.admin() as admin:
        resp: m.WhoAmIResponse = admin.whoami()
    state.printer.whoami(resp)
