"""Generated reference tables in docs/ must match the code they were generated from."""

from __future__ import annotations

from pathlib import Path

from ferrymq.broker.config import render_docs
from ferrymq.errors import _render_table

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_error_table_is_current() -> None:
    assert _render_table() in (DOCS / "errors.md").read_text()


def test_configuration_table_is_current() -> None:
    assert render_docs() in (DOCS / "configuration.md").read_text()
