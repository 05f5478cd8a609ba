"""Real-browser tests of the web console: headless Chromium (Debian's ``chromium``, installed by
``make chromium``) driven by Playwright's Python package, which never downloads a browser here.

One browser per module (each test gets a fresh context: its own cookies); a failed test leaves
a screenshot of its page under ``test-artifacts/`` (the path is printed). Without chromium the
tests skip, which a CI run (FERRYMQ_REQUIRE_ALL_TESTS) turns into a failure.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import playwright.sync_api as playwright_api
import pytest

CHROMIUM = os.environ.get("FERRYMQ_CHROMIUM", "/usr/bin/chromium")
"""The browser the tests drive (Debian's package; another path through FERRYMQ_CHROMIUM)."""
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
"""Where a failed test's screenshot goes."""
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
"""No sandbox (CI runs as root), and nothing that reaches the internet."""



@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each phase's report on the item, for :func:`page` to see a failure."""
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture(scope="module")
def browser() -> Iterator[playwright_api.Browser]:
    """One headless Chromium for the module (Playwright gives it a fresh profile dir)."""
    if not (os.access(CHROMIUM, os.X_OK) or shutil.which(CHROMIUM)):
        pytest.skip(f"the browser tests need chromium at {CHROMIUM} (make chromium, or: sudo "
                    f"apt-get install -y chromium)")
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    with playwright_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: playwright_api.Browser,
         request: pytest.FixtureRequest) -> Iterator[playwright_api.Page]:
    """A page in a fresh browser context; a screenshot is kept when the test fails."""
    context = browser.new_context()
    context.set_default_timeout(10_000)
    pg = context.new_page()
    try:
        yield pg
    finally:
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            ARTIFACTS.mkdir(exist_ok=True)
            shot = ARTIFACTS / (re.sub(r"[^\w.-]+", "_", request.node.nodeid) + ".png")
            try:
                pg.screenshot(path=str(shot), full_page=True)
                print(f"\nscreenshot of the failed test's page: {shot}")
            except playwright_api.Error as exc:
                print(f"\nno screenshot: {exc}")
        context.close()
