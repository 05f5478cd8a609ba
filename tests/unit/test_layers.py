"""Layering rules, checked on the source with ``ast`` (nothing is imported).

* ``ferrymq.protocol`` is sans-IO: no asyncio, socket, os, time (nor their submodules), and of
  FerryMQ itself only ``ferrymq.protocol`` and ``ferrymq.errors``.
* ``ferrymq.storage`` does not import the broker or the clients.
* ``ferrymq.client`` does not import the broker.
* ``ferrymq.spark`` imports neither the clients nor the broker nor the CLI: it speaks the
  protocol through its core (``ferrymq.protocol.client``), as the asyncio clients do.
* The broker's request handlers, authorisation and handshake see the broker through
  ``ferrymq.broker.context`` (narrow protocols), never the server or the connection class, and
  no broker module below the server imports the server: its import graph is a tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ferrymq

PKG = Path(ferrymq.__file__).parent


def _modules(sub: str) -> list[Path]:
    files = sorted((PKG / sub).rglob("*.py"))
    assert files, f"no modules under {sub}"
    return files


def _imports(path: Path) -> set[str]:
    """Absolute names of every module imported anywhere in ``path`` (including in functions
    and ``TYPE_CHECKING`` blocks)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = path.relative_to(PKG.parent).with_suffix("")
    package = list(rel.parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            names.add("<dynamic __import__>")
        elif (isinstance(node, ast.Attribute) and node.attr == "import_module"):
            names.add("<dynamic importlib>")
    return names


def _top(name: str) -> str:
    return name.split(".")[0]


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(PKG)) for p in paths]


PROTOCOL = _modules("protocol")
STORAGE = _modules("storage")
CLIENT = _modules("client")
SPARK = _modules("spark")
BELOW_SERVER = [p for p in _modules("broker") if p.relative_to(PKG).as_posix() not in (
    "broker/server.py", "broker/__init__.py", "broker/__main__.py", "broker/embedded.py",
    "broker/cluster_link.py")]  # the server's own part in a cluster: built only by the server
HANDLER_SIDE = [*_modules("broker/handlers"),
                *(PKG / "broker" / f"{name}.py" for name in ("acl", "auth", "context"))]
BANNED_IN_PROTOCOL = {"asyncio", "socket", "os", "time", "selectors", "threading",
                      "subprocess", "<dynamic __import__>", "<dynamic importlib>"}


def test_import_parser_sees_imports() -> None:
    names = _imports(PKG / "protocol" / "frames.py")
    assert "struct" in names
    assert "ferrymq.errors" in names


@pytest.mark.parametrize("path", PROTOCOL, ids=_ids(PROTOCOL))
def test_protocol_is_sans_io(path: Path) -> None:
    names = _imports(path)
    bad = {n for n in names if _top(n) in BANNED_IN_PROTOCOL or n in BANNED_IN_PROTOCOL}
    assert not bad, f"{path.name} imports {sorted(bad)}"
    ferry = {n for n in names if _top(n) == "ferrymq"}
    outside = {
        n for n in ferry
        if not (n == "ferrymq.protocol" or n.startswith(("ferrymq.protocol.", "ferrymq.errors")))
    }
    assert not outside, f"{path.name} imports {sorted(outside)}"


def test_errors_module_is_sans_io() -> None:
    # protocol/ imports ferrymq.errors, so it must be pure too
    names = _imports(PKG / "errors.py")
    assert not {n for n in names if _top(n) in BANNED_IN_PROTOCOL}
    assert {n for n in names if _top(n) == "ferrymq"} <= {
        "ferrymq.protocol.codes", "ferrymq.protocol.codes.ErrorCode"
    }


def _broker_client_or_cli(path: Path) -> set[str]:
    """What ``path`` imports of the broker, the clients or the CLI."""
    return {n for n in _imports(path)
            if n.startswith(("ferrymq.broker", "ferrymq.client", "ferrymq.admin"))
            or n in ("ferrymq.Broker", "ferrymq.Producer", "ferrymq.PullConsumer")}


@pytest.mark.parametrize("path", STORAGE, ids=_ids(STORAGE))
def test_storage_does_not_import_broker_or_client(path: Path) -> None:
    bad = _broker_client_or_cli(path)
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", CLIENT, ids=_ids(CLIENT))
def test_client_does_not_import_broker(path: Path) -> None:
    bad = {n for n in _imports(path) if n.startswith("ferrymq.broker") or n == "ferrymq.Broker"}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", SPARK, ids=_ids(SPARK))
def test_spark_imports_no_client_broker_or_cli(path: Path) -> None:
    bad = _broker_client_or_cli(path)
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", HANDLER_SIDE, ids=_ids(HANDLER_SIDE))
def test_handlers_see_the_broker_through_its_context(path: Path) -> None:
    bad = {n for n in _imports(path)
           if n.startswith(("ferrymq.broker.server", "ferrymq.broker.connection"))}
    assert not bad, f"{path.name} imports {sorted(bad)} (use ferrymq.broker.context)"


@pytest.mark.parametrize("path", BELOW_SERVER, ids=_ids(BELOW_SERVER))
def test_only_the_top_of_the_broker_imports_the_server(path: Path) -> None:
    bad = {n for n in _imports(path) if n.startswith("ferrymq.broker.server")}
    assert not bad, f"{path.relative_to(PKG)} imports {sorted(bad)}"


ENVIRONMENT_READERS = {"admin/cli.py", "_launcher.py"}
"""The edges that may touch ``os.environ``: the command line (settings and a test's fault hooks,
read once) and the launcher (which builds a broker subprocess's environment)."""


@pytest.mark.parametrize("path", _modules("."), ids=_ids(_modules(".")))
def test_only_the_edges_read_the_environment(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    reads = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb")]
    allowed = path.relative_to(PKG).as_posix() in ENVIRONMENT_READERS
    assert bool(reads) == allowed, (f"{path.name} reads the environment (lines {reads})" if reads
                                    else f"{path.name} no longer reads it: shorten the list")
