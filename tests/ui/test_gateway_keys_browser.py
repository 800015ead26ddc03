"""The gateway page's key forms in Chromium (Playwright on /usr/bin/chromium,
axe-core for accessibility): an operator creates a key and sets its limits,
a bad value is refused with a message naming it and changes nothing; a
viewer sees no form and is refused the same posts."""

from __future__ import annotations

import pytest

from accounts import roles

PASSWORD = "keys-password-for-tests"


@pytest.fixture
def key_users(transactional_db):
    from accounts.services import user_create
    from gateway.services import key_create

    key_create(name="team-a")
    for who in (roles.OPERATOR, roles.VIEWER):
        user_create(actor="tests", username=f"the-{who}", role=who, password=PASSWORD)


def _key(name: str):
    from gateway.models import ApiKey

    return ApiKey.objects.filter(name=name).values("rpm", "tpm", "max_concurrent", "priority", "expires_at").first()


def test_operator_creates_and_updates_keys_and_bad_values_change_nothing(key_users, web_factory):
    from playwright.sync_api import expect

    from gateway.models import ApiKey
    from tests.ui.browser import accessibility_problems, browser_page, login

    web = web_factory()
    before = _key("team-a")
    with browser_page() as page:
        login(page, web.url, f"the-{roles.OPERATOR}", PASSWORD, "/gateway/")
        assert accessibility_problems(page) == []

        # Create: a name the gateway refuses, then a good one.
        page.fill("#key-name", "no spaces allowed")
        page.get_by_role("button", name="Create key").click()
        expect(page.locator("#key-form [role=alert]")).to_contain_text("name")
        assert ApiKey.objects.count() == 1
        expect(page.locator("#key-name")).to_have_value("no spaces allowed")  # kept for the fix
        assert accessibility_problems(page) == []
        page.fill("#key-name", "team-b")
        page.get_by_role("button", name="Create key").click()
        expect(page.locator("#new-key-value")).to_contain_text("sk-llmgw-")
        assert ApiKey.objects.filter(name="team-b").exists()

        # Update: a bad value among good ones changes nothing, and says which field and why.
        page.goto(f"{web.url}/gateway/")
        form = page.locator("#limits-team-a")
        form.locator("summary").click()
        form.get_by_label("Requests per minute").fill("lots")
        form.get_by_label("Tokens per minute").fill("40000")
        form.get_by_label("Priority").select_option("interactive")
        form.get_by_role("button", name="Save limits of team-a").click()
        message = page.locator(".messages")
        expect(message).to_contain_text("API key team-a not changed")
        expect(message).to_contain_text("rpm: a positive whole number")
        assert _key("team-a") == before
        assert accessibility_problems(page) == []
        form = page.locator("#limits-team-a")
        form.locator("summary").click()
        form.get_by_label("Expires (UTC)").fill("next tuesday")
        form.get_by_role("button", name="Save limits of team-a").click()
        expect(page.locator(".messages")).to_contain_text("expires: a date and time")
        assert _key("team-a") == before

        # And then good values: saved, shown in the table.
        form = page.locator("#limits-team-a")
        form.locator("summary").click()
        form.get_by_label("Requests per minute").fill("120")
        form.get_by_label("Tokens per minute").fill("40,000")
        form.get_by_label("At once").fill("4")
        form.get_by_label("Priority").select_option("interactive")
        form.get_by_role("button", name="Save limits of team-a").click()
        expect(page.locator(".messages")).to_contain_text("API key team-a updated")
        expect(page.locator('tr[data-key="team-a"] .limits')).to_contain_text("120 req/min")
        expect(page.locator('tr[data-key="team-a"] .limits')).to_contain_text("4 at once")
    after = _key("team-a")
    assert (after["rpm"], after["tpm"], after["max_concurrent"], after["priority"]) == (120, 40000, 4, "interactive")


def test_a_viewer_has_no_key_forms_and_is_refused_their_posts(key_users, web_factory):
    from playwright.sync_api import expect

    from gateway.models import ApiKey
    from tests.ui.browser import accessibility_problems, browser_page, login

    web = web_factory()
    before = _key("team-a")
    with browser_page() as page:
        login(page, web.url, f"the-{roles.VIEWER}", PASSWORD, "/gateway/")
        expect(page.locator('tr[data-key="team-a"]')).to_be_visible()
        expect(page.locator("#key-form")).to_have_count(0)
        expect(page.locator(".key-limits")).to_have_count(0)
        expect(page.locator("main button")).to_have_count(0)
        assert accessibility_problems(page) == []
        csrf = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
        headers = {"X-CSRFToken": csrf, "Referer": f"{web.url}/gateway/"}
        for path, form in (("/gateway/keys/team-a/limits/", {"rpm": "1", "priority": "batch"}),
                           ("/gateway/keys/", {"name": "team-v"})):
            answer = page.request.post(f"{web.url}{path}", form=form, headers=headers)
            assert answer.status == 403, (path, answer.status)
    assert _key("team-a") == before and ApiKey.objects.count() == 1
