"""GPU telemetry and health in the browser: the cluster page under load (cells
shaded by utilisation, degraded and quarantined GPUs marked), the node page's
charts of the last hour and health history, and an operator clearing a
quarantine with the button (a viewer has none). Screenshots under
var/test/screenshots/ (gpu-cluster-load, gpu-node-charts)."""

from __future__ import annotations

import json
import math
import time

import pytest

from tests.ui.browser import accessibility_problems, browser_page, login, screenshot
from tests.ui.conftest import PASSWORD

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def page():
    with browser_page() as opened:
        yield opened


def _under_load(node: str, count: int = 8) -> None:
    """An hour of samples and a fresh block for ``node``, as heartbeats would leave them."""
    from nodes import telemetry
    from nodes.gpus import gpus_judged

    store = telemetry.store()
    now = time.time()
    seed = sum(map(ord, node))
    for step in range(0, 3600, 60):
        at = now - 3600 + step
        gpus = [[i, round(50 + 45 * math.sin((step / 600) + i + seed)), 120_000 + i * 100,
                 55 + (i + step // 300) % 20, round(300 + 350 * abs(math.sin(step / 900 + i)), 1),
                 1 if (node == "node02" and i == 3 and step > 2400) else 0] for i in range(count)]
        store.put(node, json.dumps({"at": at, "source": "sim", "note": "", "gpus": []}),
                  json.dumps([round(at), gpus]))
    readings = [{"index": i, "uuid": f"GPU-{node}-{i:02d}", "util": (seed * 7 + i * 23) % 101,
                 "mem_used_mib": 120_000, "mem_total_mib": 143771, "temp_c": 60 + i, "power_w": 400.0}
                for i in range(count)]
    if node == "node02":
        readings[3].update(temp_c=91, thermal_throttle=True)
    if node == "node03":
        readings[0].update(xids=[79], last_xid=79, lost=True, util=None, temp_c=None, power_w=None)
    telemetry._history_at.clear()
    telemetry.telemetry_keep(node_name=node, block=telemetry.telemetry_parse({"source": "sim", "gpus": readings}),
                             persist=gpus_judged)


@pytest.fixture(params=["redis", "database"])
def loaded(request, settings, small_cluster, pki_dir):
    """The cluster under load; the environment for the web process, which
    reads the readings from Redis, or (the embedded default) from the database."""
    from nodes import liveness, telemetry

    web_env = {}
    if request.param == "database":
        settings.LLMGW_REDIS_URL = web_env["LLMGW_REDIS_URL"] = ""
    liveness.store.cache_clear()
    telemetry.store.cache_clear()
    telemetry.forget_cache()
    for node in ("node01", "node02", "node03", "node04", "island01"):
        _under_load(node)
    yield web_env
    liveness.store.cache_clear()
    telemetry.store.cache_clear()


def test_cluster_page_under_load_and_the_node_charts(loaded, superuser, web_factory, page):
    from playwright.sync_api import expect

    from core.models import Event
    from nodes.models import Gpu

    web = web_factory(**loaded)
    login(page, web.url, "root", PASSWORD)
    grid = page.locator("main")
    quarantined = page.locator('[data-node="node03"] .gpu.quarantined')
    expect(quarantined).to_have_count(1)
    assert "Xid 79 (GPU has fallen off the bus)" in quarantined.get_attribute("title")
    degraded = page.locator('[data-node="node02"] .gpu.degraded')
    expect(degraded).to_have_count(1)
    assert "thermal throttling" in degraded.get_attribute("title")
    assert page.locator(".gpu.u4").count() > 0 and page.locator(".gpu.u0").count() > 0
    # A shaded cell says how busy it is.
    assert "% busy" in (page.locator('[data-node="node01"] .gpu.u4, [data-node="node01"] .gpu.u3')
                        .first.get_attribute("title") or "% busy")
    expect(grid).to_contain_text("node03")
    assert not accessibility_problems(page)
    screenshot(page, "gpu-cluster-load")

    page.goto(f"{web.url}/nodes/node03/")
    expect(page.locator("#gpu-telemetry svg.chart")).to_have_count(4)
    expect(page.locator("#gpu-telemetry .strips svg")).to_have_count(8)  # a health bar per GPU
    assert page.locator("#gpu-telemetry .strips rect.h-quarantined").count() == 1
    expect(page.locator("#gpu-telemetry figcaption")).to_have_text(
        ["Utilisation", "Memory used", "Temperature", "Power"])
    assert page.locator("#gpu-telemetry polyline").count() == 4 * 8
    row = page.locator('#gpus tr[data-gpu="0"]')
    expect(row.locator(".gpu-health")).to_contain_text("quarantined")
    expect(row.locator(".gpu-health")).to_contain_text("Xid 79")
    expect(page.locator("#gpu-health-events")).to_contain_text("gpu.quarantined")
    assert not accessibility_problems(page)
    screenshot(page, "gpu-node-charts")

    page.get_by_role("button", name="Clear GPU 0").click()
    expect(page.locator(".messages")).to_contain_text("GPU 0 (GPU-node03-00) of node03 is back in service")
    assert Gpu.objects.get(node__name="node03", index=0).quarantined_at is None
    assert "cleared by user root" in Event.objects.get(kind="gpu.cleared").message


def test_a_viewer_sees_gpu_health_but_no_clear_button(loaded, viewer, web_factory, page):
    from playwright.sync_api import expect

    web = web_factory(**loaded)
    login(page, web.url, "watcher", PASSWORD, "/nodes/node03/")
    expect(page.locator('#gpus tr[data-gpu="0"] .gpu-health')).to_contain_text("quarantined")
    expect(page.get_by_role("button", name="Clear GPU 0")).to_have_count(0)
