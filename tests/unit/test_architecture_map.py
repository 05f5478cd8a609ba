"""docs/architecture.md names only modules and packages that exist: every backticked path it
mentions (``storage/log.py``, ``delivery/``, ``tests/unit``) is a file or directory of the
repository, so the map cannot silently go stale when code moves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "ferrymq"
MAP = ROOT / "docs" / "architecture.md"

# `a/b.py`, `b.py`, `delivery/`, `tests/unit`, `docs/errors.md` (no spaces, no call syntax)
_PATH = re.compile(r"`([A-Za-z_][\w./-]*(?:\.py|\.md|/))`|`((?:tests|docs|bench|src)/[\w./-]*)`")


def _mentions(text: str) -> set[str]:
    return {a or b for a, b in _PATH.findall(text)}


def _exists(name: str, src_paths: list[str]) -> bool:
    if (ROOT / name).exists() or (ROOT / "src" / name).exists():
        return True
    name = name.rstrip("/")
    # a path relative to src/ferrymq, or to one of its packages (the map says `log.py` under
    # "storage/"): it must end an existing path on a component boundary
    return any(p == name or p.endswith("/" + name) for p in src_paths)


def test_every_module_the_map_names_exists() -> None:
    src_paths = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*")
                 if "__pycache__" not in p.parts]
    names = _mentions(MAP.read_text())
    assert len(names) > 40, "the map names modules in backticks"
    missing = sorted(n for n in names if not _exists(n, src_paths))
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_the_check_sees_a_missing_module() -> None:
    src_paths = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")]
    assert _mentions("see `broker/gone.py` and `storage/log.py`") == {
        "broker/gone.py", "storage/log.py"}
    assert not _exists("broker/gone.py", src_paths)
    assert _exists("storage/log.py", src_paths)
    assert _exists("log.py", src_paths)
    assert not _exists("og.py", src_paths)


def test_every_module_says_what_it_owns() -> None:
    """Each module's docstring opens with the one thing it owns (the package map prints it)."""
    from ferrymq.docgen import render_module_map

    rows = render_module_map().splitlines()[2:]
    assert len(rows) > 100
    empty = [row for row in rows if row.endswith("|  |")]
    assert not empty, f"modules without a docstring: {empty}"
