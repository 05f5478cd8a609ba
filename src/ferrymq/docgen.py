"""The generated reference tables of ``docs/``: ``python -m ferrymq.docgen errors`` prints the
error-code table of docs/errors.md, ``python -m ferrymq.docgen configuration`` the settings
table of docs/configuration.md, ``python -m ferrymq.docgen architecture`` the package map of
docs/architecture.md, ``python -m ferrymq.docgen metrics`` the metrics table of docs/metrics.md
(tests/unit/test_docs_in_sync.py checks that all are current).

The tables are rendered next to what they describe (:func:`ferrymq.errors._render_table`,
:func:`ferrymq.broker.config.render_docs`); only the entry point lives here, in a module the
package never imports itself. Running a module that ``import ferrymq`` has already imported
(``python -m ferrymq.errors``) executes it a second time under ``__main__``, which runpy warns
about (RuntimeWarning).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ferrymq.broker.config import render_docs
from ferrymq.errors import _render_table
from ferrymq.ops.metrics import render_docs as render_metrics


def render_module_map() -> str:
    """The package map of docs/architecture.md: one row per module of ``src/ferrymq`` in path
    order, with the first paragraph of its docstring (what it owns), read without importing."""
    root = Path(__file__).resolve().parent
    rows = ["| module | what it owns |", "|---|---|"]
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).parts):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        first = " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")
        rows.append(f"| `{path.relative_to(root).as_posix()}` | {first} |")
    return "\n".join(rows)


TABLES: dict[str, Callable[[], str]] = {
    "errors": _render_table,
    "configuration": render_docs,
    "architecture": render_module_map,
    "metrics": render_metrics,
}
"""Table name (the docs file without ``.md``) -> its renderer."""


def main(argv: Sequence[str] | None = None) -> int:
    """Print the tables named in ``argv`` (default ``sys.argv[1:]``); exit status 2 and a usage
    line on stderr for an unknown or missing name."""
    names = list(sys.argv[1:] if argv is None else argv)
    if not names or any(n not in TABLES for n in names):
        print(f"usage: python -m ferrymq.docgen {{{','.join(TABLES)}}} ...", file=sys.stderr)
        return 2
    for name in names:
        print(TABLES[name]())
    return 0


if __name__ == "__main__":
    sys.exit(main())
