"""The dashboard in a real browser: Debian's Chromium driven by Playwright.

Playwright never downloads a browser here (`playwright install` is not used):
it drives /usr/bin/chromium, which `make test` installs when it is missing.
"""

from __future__ import annotations

import shutil

import pytest

from tests.control_plane import heartbeat_once

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
NODE = "gpu-node-07"
DISCOVERY_ERROR = "nvidia-smi: GPU 0000:1B:00.0 has fallen off the bus"

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def chromium_path() -> str:
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: 'make test' installs it (scripts/test-deps.sh)")
    return CHROMIUM


def test_dashboard_shows_a_node_and_its_discovery_error(
    chromium_path, agent_api, web_factory, client_cert, admin_token, tmp_path
):
    from playwright.sync_api import expect, sync_playwright

    response = heartbeat_once(agent_api.url, NODE, client_cert(NODE), gpus=4, discovery_errors=[DISCOVERY_ERROR])
    assert response.status_code == 200, response.text
    web = web_factory()

    # No database access from here on: Playwright's sync API runs an event
    # loop in this thread, and Django refuses ORM calls from one.
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(15_000)

            page.goto(f"{web.url}/")
            expect(page).to_have_url(f"{web.url}/admin/login/?next=/")
            page.fill("#id_username", "admin")
            page.fill("#id_password", "admin-password-for-tests")
            page.click("input[type=submit]")
            expect(page).to_have_url(f"{web.url}/")

            row = page.locator("#nodes tr", has_text=NODE)
            expect(row).to_have_count(1)
            expect(row.locator("td").nth(1)).to_have_text("ready")
            expect(row.locator("td").nth(2)).to_have_text("ib-a")
            expect(row.locator("td").nth(3)).to_have_text("4")
            expect(row).to_contain_text(DISCOVERY_ERROR)
            expect(page.locator("#events")).to_contain_text(f"node/{NODE}")
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)

            row.get_by_role("link", name=NODE).click()
            expect(page).to_have_url(f"{web.url}/nodes/{NODE}/")
            expect(page.locator("h1")).to_contain_text(NODE)
            expect(page.locator("h1")).to_contain_text("ready")
            expect(page.locator("p.warn")).to_have_text(f"Discovery errors: {DISCOVERY_ERROR}")
            expect(page.locator("body")).to_contain_text("NVIDIA H200")
            expect(page.locator("body")).to_contain_text("mlx5_0")
            shot = tmp_path / "node.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()

    assert shot.stat().st_size > 5_000
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replicas_page_shows_placements_and_why_one_waits(chromium_path, web_factory, admin_token, tmp_path,
                                                          monkeypatch):
    from playwright.sync_api import expect, sync_playwright

    from replicas import reconcile, tasks
    from replicas.catalog import catalog_apply
    from tests.factories import node_with_gpus

    monkeypatch.setattr(tasks.replicas_reconcile, "delay", lambda: None)
    node_with_gpus("node01", fabric="ib-a", addr="127.0.1.1")
    node_with_gpus("node02", fabric="ib-a", addr="127.0.1.2")
    catalog_apply(entries=[{"name": "wide", "engine": "sim", "model": "/m", "nodes": 2, "gpus_per_node": 8,
                            "replicas": 2}])
    reconcile.replicas_reconcile()
    web = web_factory()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(15_000)
            page.goto(f"{web.url}/replicas/")
            page.fill("#id_username", "admin")
            page.fill("#id_password", "admin-password-for-tests")
            page.click("input[type=submit]")
            expect(page).to_have_url(f"{web.url}/replicas/")
            expect(page.locator("#models")).to_contain_text("2 x 8 GPUs")
            scheduled = page.locator("#replicas tr", has=page.locator("td.status-scheduled"))
            expect(scheduled).to_have_count(1)
            expect(scheduled).to_contain_text("node01[0,1,2,3,4,5,6,7] r0")
            expect(scheduled).to_contain_text("ib-a")
            waiting = page.locator("#replicas tr", has=page.locator("td.status-pending"))
            expect(waiting).to_contain_text("needs 2 nodes x 8 GPUs in one fabric")
            page.screenshot(path=str(tmp_path / "replicas.png"), full_page=True)
        finally:
            browser.close()
