"""Headless Chromium for the viewer tests: the system's Chromium driven by Playwright (the
browser Playwright would download is not needed). `launch()` skips the calling test, with the
reason, only when the machine has no Chromium (a system package, not a pip one: `.ci/run`
installs it; the README's test command must still pass on a machine without it)."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage"]


def chromium_path() -> str | None:
    for name in CANDIDATES:
        p = shutil.which(name)
        if p:
            return p
    return None


@contextmanager
def launch():
    """A Playwright browser context on the system Chromium, with a fresh profile."""
    exe = chromium_path()
    if exe is None:
        why = "no Chromium found (install the system package: apt-get install chromium)"
        if os.environ.get("FUELGRAPH_REQUIRE_BROWSER") == "1":   # CI installs it: must run
            pytest.fail(why)
        pytest.skip(why)
    from playwright.sync_api import sync_playwright   # a test dependency: missing is a failure
    with tempfile.TemporaryDirectory(prefix="fg-chromium-") as profile, sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            profile, executable_path=exe, headless=True, args=FLAGS,
            viewport={"width": 1600, "height": 1000})
        try:
            yield ctx
        finally:
            ctx.close()


def open_page(ctx, path: Path):
    """Load a local file; returns (page, console errors, page errors) collected while loading."""
    page = ctx.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    failed: list[str] = []
    page.on("requestfailed", lambda r: failed.append(r.url))
    page.goto(path.resolve().as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    return page, errors, failed
