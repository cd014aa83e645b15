"""A headless Chromium (Debian's, driven by playwright; `make setup` installs it) for the tests
that need a real browser: the dashboard page and CORS from a page of another origin."""
from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def launch_browser():
    """Yields a playwright Browser; skips (fails in CI) where Chromium or playwright is
    missing."""
    if not shutil.which(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing (make setup installs it)")
        pytest.skip(f"{CHROMIUM} is missing: apt-get install chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                             headless=True)
        yield browser
        browser.close()
