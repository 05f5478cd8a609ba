"""The pytest plugin: installed FerryMQ gives every test suite its fixtures through the
``pytest11`` entry point, with no ``pytest_plugins`` line; the session broker is one broker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

USER_TESTS = '''
import pytest
from ferrymq import Message, Producer, PullConsumer

SEEN = []


@pytest.mark.parametrize("n", [1, 2])
def test_session_broker_is_shared(ferrymq_session_broker, n):
    SEEN.append(ferrymq_session_broker.address)
    with Producer(ferrymq_session_broker.address) as p:
        p.send(Message("shared", f"m{n}".encode()))
    assert len(set(SEEN)) == 1


def test_function_broker_is_fresh_and_real(ferrymq_broker, ferrymq_session_broker):
    assert ferrymq_broker.address != ferrymq_session_broker.address
    with Producer(ferrymq_broker.address) as p:
        p.send(Message("orders", b"hi"))
    with PullConsumer(ferrymq_broker.address, "g", auto_offset_reset="earliest") as c:
        c.subscribe("orders")
        got = []
        for _ in range(50):
            got += c.poll(timeout=0.2)
            if got:
                break
    assert [m.body for m in got] == [b"hi"]
'''


def _run_pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_user_suite.py").write_text(USER_TESTS)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         "-c", "/dev/null", *args, str(tmp_path / "test_user_suite.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)


def test_fixtures_are_found_without_pytest_plugins(tmp_path: Path) -> None:
    assert "pytest_plugins" not in USER_TESTS
    assert not (tmp_path / "conftest.py").exists()
    out = _run_pytest(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 passed" in out.stdout, out.stdout


def test_without_the_plugin_the_fixtures_are_missing(tmp_path: Path) -> None:
    # the control: what made them appear above is the entry point, nothing else
    out = _run_pytest(tmp_path, "-p", "no:ferrymq")
    assert out.returncode != 0
    assert "fixture 'ferrymq_session_broker' not found" in out.stdout, out.stdout
