"""Option hints in error messages: the Python API's words, and the command line's.

An error that tells its reader what to change names an option. The library's messages name the
clients' keyword arguments (``auth=``, ``tls=``); the ``ferrymq`` command line has flags and
environment variables instead. Messages that give such a hint build it from the constants here
(the broker's too: its messages travel as an error's text), and the CLI prints every error
through :func:`for_cli`, which puts the CLI's words in place of each Python hint. Python users
keep the messages as they are.
"""

from __future__ import annotations

AUTH_NEEDED = "auth=(user, secret)"
"""The broker needs credentials."""
AUTH_OFF = "connect without auth="
"""The broker has authentication off, and the client sent credentials."""
TLS_NEEDED = "pass tls="
"""The broker's port may be TLS, and the client spoke plain TCP."""
DELETE_DLQ = "delete_dlq=True"
"""A group's dead letters are deleted with it only when asked."""
CONNECT_TIMEOUT = "(connect_timeout_s)"
"""The budget of a client's first connection ran out."""
RECONNECT_TIMEOUT = "(reconnect_timeout_s)"
"""The budget of a reconnection ran out."""

CLI_HINTS: dict[str, str] = {
    AUTH_NEEDED: "--user NAME with --password, or env FERRYMQ_USER and FERRYMQ_PASSWORD",
    AUTH_OFF: "connect without --user (and unset env FERRYMQ_USER)",
    TLS_NEEDED: "use --tls, or --tls-ca FILE to trust its CA (env FERRYMQ_TLS, FERRYMQ_TLS_CA)",
    DELETE_DLQ: "--delete-dlq",
    CONNECT_TIMEOUT: "(--connect-timeout)",
    RECONNECT_TIMEOUT: "(--connect-timeout)",
}
"""Each Python hint and what the ``ferrymq`` command line says instead."""


def for_cli(message: str) -> str:
    """``message`` with every Python option hint replaced by the CLI's flags and variables."""
    for python, cli in CLI_HINTS.items():
        message = message.replace(python, cli)
    return message
