"""The admin creates keys through the service, shows the key once, and revokes."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from gateway.models import ApiKey
from tests.factories import CatalogEntryFactory


@pytest.fixture
def admin_client(client, db):
    user = get_user_model().objects.create_superuser("root", "", "pw-for-tests")
    client.force_login(user)
    return client


def test_admin_add_shows_the_key_once_and_revokes(admin_client):
    CatalogEntryFactory(name="m")
    assert admin_client.get("/admin/gateway/apikey/add/").status_code == 200
    response = admin_client.post("/admin/gateway/apikey/add/", {"name": "ops", "models_text": "m"}, follow=True)
    assert response.status_code == 200
    messages = [str(m) for m in response.context["messages"]]
    key = ApiKey.objects.get(name="ops")
    assert key.allowed_models == ["m"]
    assert any("sk-llmgw-" in m and key.prefix in m for m in messages)
    assert admin_client.get(f"/admin/gateway/apikey/{key.pk}/change/").status_code == 200
    assert admin_client.get("/admin/gateway/apikey/").status_code == 200

    refused = admin_client.post("/admin/gateway/apikey/add/", {"name": "x", "models_text": "nope"})
    assert refused.status_code == 200 and b"no such model" in refused.content
    admin_client.post("/admin/gateway/apikey/", {"action": "revoke", "_selected_action": [key.pk]}, follow=True)
    key.refresh_from_db()
    assert key.revoked_at is not None
