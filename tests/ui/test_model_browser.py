"""A model's page in Chromium: the rollout shown, passing axe-core; an
operator pauses and resumes it with the page's buttons; a viewer sees none."""

from __future__ import annotations

import pytest

from tests.ui.browser import accessibility_problems, browser_page, login, screenshot
from tests.ui.conftest import PASSWORD

pytestmark = pytest.mark.django_db(transaction=True)


def test_model_page_rollout_in_the_browser(web_factory, no_reconcile_enqueue, settings):
    from playwright.sync_api import expect

    from accounts import roles
    from accounts.services import user_create
    from replicas.catalog import catalog_apply
    from replicas.models import Rollout
    from tests.factories import node_with_gpus
    from tests.replicas.test_rollout import ENTRY, _settle

    settings.LLMGW_ROUTING_SETTLE = 0
    for i in range(6):
        node_with_gpus(f"node{i:02d}", gpus=4, addr=f"127.0.1.{i + 1}")
    catalog_apply(entries=[ENTRY])
    _settle(3)
    catalog_apply(entries=[{**ENTRY, "args": ["--token-delay", "0.01"]}])
    _settle(1)
    for role in (roles.OPERATOR, roles.VIEWER):
        user_create(actor="tests", username=f"the-{role}", role=role, password=PASSWORD)
    web = web_factory()
    with browser_page() as page:
        login(page, web.url, f"the-{roles.OPERATOR}", PASSWORD, "/models/llama/")
        expect(page.locator("#revision")).to_have_text("2")
        expect(page.locator("#rollout")).to_contain_text("Revision 1 → 2")
        expect(page.locator("#rollout")).to_contain_text("Waiting for")
        assert not accessibility_problems(page)
        screenshot(page, "model-rollout")
        page.get_by_role("button", name="Pause").click()
        expect(page.locator(".messages")).to_contain_text("The rollout of llama is paused.")
        assert Rollout.objects.get().status == "paused"
        page.get_by_role("button", name="Resume").click()
        expect(page.locator(".messages")).to_contain_text("The rollout of llama is running.")
    with browser_page() as page:
        login(page, web.url, f"the-{roles.VIEWER}", PASSWORD, "/models/llama/")
        expect(page.locator("#rollout")).to_contain_text("Revision 1 → 2")
        expect(page.get_by_role("button", name="Pause")).to_have_count(0)
        expect(page.get_by_role("button", name="Undo: back to the previous revision")).to_have_count(0)
