"""Debian's Chromium driven by Playwright, with axe-core for accessibility.

Playwright never downloads a browser here (`playwright install` is not used):
it drives /usr/bin/chromium, which `make test` installs when it is missing.
axe-core comes vendored inside axe-playwright-python: nothing is fetched.
"""

from __future__ import annotations

import shutil
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
