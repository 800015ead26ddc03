"""The web UI on the simulated cluster: a node drained from its page and its
replica moving without a reload; a node killed and its card turning lost,
its replica rebuilt on the other fabric (the drained node uncordoned from
its page first, so that there is room)."""

from __future__ import annotations

import pytest

from cli.wait import wait_until
from replicas.catalog import catalog_apply
from replicas.choices import ReplicaStatus
from replicas.models import Member, Replica
from tests.e2e.sim import GRACE, fast_env
from tests.ui.browser import browser_page, login, screenshot
from tests.ui.conftest import PASSWORD, superuser  # noqa: F401 - the fixture, for this directory too

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def ready(count: int):
    return lambda: Replica.objects.filter(status=ReplicaStatus.READY).count() == count


def test_drain_and_lost_node_in_the_browser(sim_cluster, web_factory, superuser):
    from playwright.sync_api import expect

    cluster = sim_cluster()
    catalog_apply(entries=[{"name": "wide", "engine": "sim", "model": "/m", "nodes": 2, "gpus_per_node": 4,
                            "replicas": 1}])
    wait_until(ready(1), timeout=60, message="a ready 2x4 replica")
    first = Replica.objects.get(status=ReplicaStatus.READY)
    on = sorted(Member.objects.filter(replica=first).values_list("node__name", flat=True))
    web = web_factory(**fast_env())
    with browser_page() as page:
        login(page, web.url, "root", PASSWORD, f"/nodes/{on[0]}/")
        page.get_by_role("button", name="Drain").click()
        expect(page.locator(".messages")).to_contain_text(f"Draining {on[0]}: 1 replica(s) to move")
        page.evaluate("window.__not_reloaded = true")
        # The replacement is made on free GPUs, becomes ready, and only
        # then the original stops: the page follows without a reload.
        expect(page.locator("#drain .badge").first).to_have_text("done", timeout=120_000)
        expect(page.locator("#node-status")).to_have_text("drained")
        expect(page.locator("#drain")).to_contain_text("1 moved, 0 remaining")
        assert page.evaluate("window.__not_reloaded") is True
        screenshot(page, "e2e-node-drained")
        wait_until(ready(1), timeout=60, message="the replacement ready")
        moved = Replica.objects.get(status=ReplicaStatus.READY)
        assert moved.pk != first.pk

        # Back in service from its page, so that the other fabric has room again.
        page.get_by_role("button", name="Uncordon").click()
        expect(page.locator("#node-status")).to_have_text("ready")

        holders = sorted(Member.objects.filter(replica=moved).values_list("node__name", flat=True))
        victim = holders[0]
        page.goto(f"{web.url}/")
        card = page.locator(f"article[data-node={victim}]")
        expect(card).to_have_class("node ready")
        page.evaluate("window.__not_reloaded = true")
        cluster.kill_node(victim)
        expect(card).to_have_class("node lost", timeout=int((GRACE + 30) * 1000))
        assert page.evaluate("window.__not_reloaded") is True
        screenshot(page, "e2e-cluster-node-lost")
    wait_until(lambda: Replica.objects.filter(status=ReplicaStatus.READY).exclude(
        members__node__name=victim).count() == 1, timeout=90, message="the replica rebuilt away from the lost node")
