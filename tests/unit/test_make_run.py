"""``make run`` tells a newcomer how to reach the CLI and a Python that has FerryMQ: the venv is
not on PATH after it, and the README's ``ferrymq ...`` lines failed with 'command not found'."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_run_says_how_to_get_the_cli(tmp_path: Path) -> None:
    # -n: print what it would run (the venv of a fresh checkout included), run nothing
    out = subprocess.run(["make", "-n", "run", f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    said = out.stdout
    assert f"{tmp_path / 'venv'}/bin/activate" in said
    assert f"{tmp_path / 'venv'}/bin/ferrymq topic list" in said
    assert f"{tmp_path / 'venv'}/bin/python app.py" in said
