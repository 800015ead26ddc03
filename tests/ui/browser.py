"""Debian's Chromium driven by Playwright, with axe-core for accessibility.

Playwright never downloads a browser here (`playwright install` is not used):
it drives /usr/bin/chromium, which `make test` installs when it is missing.
axe-core comes vendored inside axe-playwright-python: nothing is fetched.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "var" / "test" / "screenshots"
BLOCKING = {"serious", "critical"}


def chromium() -> str:
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: 'make test' installs it (scripts/test-deps.sh)")
    return CHROMIUM


def login(page, base: str, username: str, password: str, next_path: str = "/") -> None:
    page.goto(f"{base}{next_path}")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}{next_path}")


def accessibility_problems(page) -> list[str]:
    from axe_playwright_python.sync_playwright import Axe

    results = Axe().run(page)
    return [
        f"{v['impact']}: {v['id']}: {v['help']} ({len(v['nodes'])} elements, e.g. {v['nodes'][0]['target']})"
        for v in results.response["violations"] if v.get("impact") in BLOCKING
    ]


def screenshot(page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


@contextmanager
def browser_page(width: int = 1440, height: int = 900):
    """A page in headless Chromium. The test may use the database between
    browser steps: Playwright's sync API runs an event loop in this thread,
    so Django is told that is safe here, and the connection the test opens
    meanwhile (one of its own) is closed at the end rather than left holding
    the test database."""
    from django.db import connections
    from playwright.sync_api import sync_playwright

    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": width, "height": height})
                page.set_default_timeout(20_000)
                yield page
            finally:
                browser.close()
                connections.close_all()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous
