"""Generated reference tables in docs/ must match the code they were generated from, and the
command each docs file names to regenerate its table must print it cleanly."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ferrymq.broker.config import render_docs
from ferrymq.docgen import TABLES
from ferrymq.errors import _render_table

DOCS = Path(__file__).resolve().parents[2] / "docs"
COMMAND = re.compile(r"`(python -m ferrymq[\w.]*(?: \w+)?)`")


def test_error_table_is_current() -> None:
    assert _render_table() in (DOCS / "errors.md").read_text()


def test_configuration_table_is_current() -> None:
    assert render_docs() in (DOCS / "configuration.md").read_text()


@pytest.mark.parametrize("name", sorted(TABLES))
def test_the_documented_command_prints_the_table_without_warnings(name: str) -> None:
    """The command a generated docs file names (``Generated ... by `python -m ...```) prints
    exactly its table, and nothing on stderr: no RuntimeWarning about a module that the package
    had already imported being run as ``__main__``."""
    text = (DOCS / f"{name}.md").read_text()
    # the command naming this table (a page may quote other commands, e.g. the package map)
    found = {c for c in COMMAND.findall(text) if c.split()[-1] == name}
    assert len(found) == 1, found
    args = found.pop().split()[1:]  # "-m", module, table...
    res = subprocess.run([sys.executable, "-W", "error", *args], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert res.stdout.rstrip("\n") == TABLES[name]()
    assert res.stdout.rstrip("\n") in text


def test_docgen_refuses_an_unknown_table() -> None:
    res = subprocess.run([sys.executable, "-m", "ferrymq.docgen", "nope"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2
    assert "usage: python -m ferrymq.docgen" in res.stderr
