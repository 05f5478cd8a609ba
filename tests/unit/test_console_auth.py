"""The console's origin check and login redirect target (pure functions)."""

from __future__ import annotations

import pytest

from ferrymq.ops.console_auth import local_path, same_origin


@pytest.mark.parametrize(("origin", "referer", "host", "ok"), [
    ("http://127.0.0.1:9877", None, "127.0.0.1:9877", True),
    ("https://console.example:443", None, "console.example:443", True),
    ("http://CONSOLE.example", None, "console.example", True),
    (None, "http://127.0.0.1:9877/group?name=g", "127.0.0.1:9877", True),  # no Origin
    ("null", "http://127.0.0.1:9877/", "127.0.0.1:9877", True),
    ("http://127.0.0.1:9999", None, "127.0.0.1:9877", False),  # another port: another origin
    ("http://evil.example", "http://127.0.0.1:9877/", "127.0.0.1:9877", False),
    ("null", None, "127.0.0.1:9877", False),
    (None, None, "127.0.0.1:9877", False),
    ("http://127.0.0.1:9877", None, None, False),
    ("ftp://127.0.0.1:9877", None, "127.0.0.1:9877", False),
])
def test_same_origin(origin: str | None, referer: str | None, host: str | None,
                     ok: bool) -> None:
    assert same_origin(origin, referer, host) is ok


@pytest.mark.parametrize(("target", "expected"), [
    ("/topic?name=a", "/topic?name=a"),
    ("/", "/"),
    ("//evil.example/x", "/"),
    ("/\\evil.example", "/"),
    ("http://evil.example/", "/"),
    ("topic", "/"),
    ("/a\nb", "/"),
])
def test_local_path(target: str, expected: str) -> None:
    assert local_path(target) == expected
