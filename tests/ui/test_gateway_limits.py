"""The gateway page: each key's limits and priority in a form an operator
saves (refused input changes nothing and says why), and the usage chart
drawn on the server as SVG from the hourly usage rows."""

from __future__ import annotations

import datetime as dt

from django.utils import timezone

from gateway.models import ApiKey, KeyUsage
from gateway.services import key_create


def test_operator_saves_limits_and_bad_input_changes_nothing(admin_client_ui):
    key_create(name="team-a")
    saved = admin_client_ui.post("/gateway/keys/team-a/limits/", {
        "rpm": "120", "tpm": "40,000", "max_concurrent": "", "daily_tokens": "1000000", "monthly_tokens": "",
        "expires_at": "2030-01-31 00:00", "priority": "interactive"}, follow=True)
    assert "updated" in saved.content.decode()
    row = ApiKey.objects.get(name="team-a")
    assert (row.rpm, row.tpm, row.max_concurrent, row.daily_tokens, row.priority) == (
        120, 40000, None, 1000000, "interactive")
    assert row.expires_at == dt.datetime(2030, 1, 31, tzinfo=dt.timezone.utc)
    page = admin_client_ui.get("/gateway/").content.decode()
    assert "120 req/min" in page and "40000 tokens/min" in page and 'action="/gateway/keys/team-a/limits/"' in page

    bad = admin_client_ui.post("/gateway/keys/team-a/limits/", {"rpm": "lots", "priority": "interactive"},
                               follow=True).content.decode()
    assert "not changed" in bad and "rpm" in bad
    bad = admin_client_ui.post("/gateway/keys/team-a/limits/", {"rpm": "5", "priority": "urgent"},
                               follow=True).content.decode()
    assert "not changed" in bad and "priority" in bad
    assert ApiKey.objects.get(name="team-a").rpm == 120


def test_usage_chart_is_svg_drawn_from_the_hourly_rows(admin_client_ui):
    a, b = key_create(name="team-a").row, key_create(name="team-b").row
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    KeyUsage.objects.create(key=a, model="m", hour=hour, requests=3, prompt_tokens=300, completion_tokens=900)
    KeyUsage.objects.create(key=a, model="m", hour=hour - dt.timedelta(hours=2), requests=1, prompt_tokens=10,
                            completion_tokens=20)
    KeyUsage.objects.create(key=b, model="m", hour=hour, requests=1, prompt_tokens=5, completion_tokens=5)
    KeyUsage.objects.create(key=b, model="m", hour=hour - dt.timedelta(days=3), requests=9, prompt_tokens=999,
                            completion_tokens=999)  # older than the chart's day
    page = admin_client_ui.get("/gateway/").content.decode()
    assert '<svg xmlns="http://www.w3.org/2000/svg"' in page and 'class="usage-chart"' in page
    assert page.count('class="completion"') == 2  # two hours with usage
    assert "305 prompt + 905 completion tokens" in page
    assert "<td>team-a</a></td><td>m</td><td>4</td><td>310</td><td>920</td>" in page.replace(
        '<td><a href="?usage_key=team-a#usage-chart">', "<td>")
    only_b = admin_client_ui.get("/gateway/?usage_key=team-b").content.decode()
    assert "5 prompt + 5 completion tokens" in only_b and "team-a</a>" not in only_b.split('id="usage"')[1]


def test_viewer_sees_usage_but_no_limits_form(viewer_client):
    key_create(name="team-a")
    page = viewer_client.get("/gateway/").content.decode()
    assert 'class="usage-chart"' in page and "/limits/" not in page
    assert viewer_client.post("/gateway/keys/team-a/limits/", {"rpm": "1"}).status_code == 403


def test_the_key_form_says_the_defaults_and_applies_them(admin_client_ui, settings):
    settings.LLMGW_KEYS_DEFAULT_RPM, settings.LLMGW_KEYS_DEFAULT_MAX_CONCURRENT = 60, 4
    settings.LLMGW_KEYS_DEFAULT_EXPIRES_DAYS, settings.LLMGW_KEYS_DEFAULT_PRIORITY = 30, "batch"
    page = admin_client_ui.get("/gateway/").content.decode()
    says = "New keys get this deployment's defaults: 60 req/min, 4 at once, expires after 30 days, priority batch"
    assert says in page
    created = admin_client_ui.post("/gateway/keys/", {"name": "from-ui", "models": ""})
    assert created.status_code == 201
    row = ApiKey.objects.get(name="from-ui")
    assert (row.rpm, row.tpm, row.max_concurrent, row.priority) == (60, None, 4, "batch")
    assert row.expires_at > timezone.now() + dt.timedelta(days=29)
    assert "60 req/min" in created.content.decode()
