"""The web console's assets ship in the package: every file of ``console_static/`` is served and
matched by pyproject.toml's package data (so a wheel or sdist carries it; no CDN)."""

from __future__ import annotations

import fnmatch
import tomllib
from importlib import resources
from pathlib import Path

from ferrymq.ops.console import STATIC

ROOT = Path(__file__).resolve().parents[2]


def test_every_asset_is_served_and_is_package_data() -> None:
    folder = resources.files("ferrymq.ops") / "console_static"
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    assert files == sorted(STATIC)
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["ferrymq"]
    for name in files:
        assert any(fnmatch.fnmatch(f"ops/console_static/{name}", p) for p in patterns), name


def test_assets_load_nothing_from_elsewhere() -> None:
    folder = resources.files("ferrymq.ops") / "console_static"
    for name in STATIC:
        text = (folder / name).read_text()
        assert "http://" not in text and "https://" not in text and "@import" not in text
