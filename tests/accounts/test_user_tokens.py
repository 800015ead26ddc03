"""Operator tokens per user: each carries its user's role and an expiry, is
made and revoked by its user (REST, 'llmgw ctl tokens', the tokens page) and
by admins for anyone. Only the first admin could get one before."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.test import APIClient

from accounts import roles, services
from accounts.models import OperatorToken
from core.models import Event
from tests.conftest import server_env
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fast(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _user(role: str):
    return services.user_create(actor="tests", username=f"the-{role}", role=role, password="pw-for-the-tests-1")[0]


def _bearer(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def test_a_viewer_makes_its_own_token_which_carries_its_role(db):
    NodeFactory(name="n1")
    viewer = _user(roles.VIEWER)
    session = APIClient()
    session.force_login(viewer)
    made = session.post("/api/v1/tokens/", {"name": "script", "days": 7}, format="json")
    assert made.status_code == 201, made.content
    body = made.json()
    assert body["user"] == "the-viewer" and body["token"].startswith(body["prefix"])
    expires = timezone.datetime.fromisoformat(body["expires_at"])
    assert timedelta(days=6.9) < expires - timezone.now() <= timedelta(days=7)
    as_viewer = _bearer(body["token"])
    assert as_viewer.get("/api/v1/nodes/").status_code == 200
    assert as_viewer.post("/api/v1/nodes/n1/cordon/").status_code == 403  # a viewer's rights, no more
    assert as_viewer.get("/api/v1/tokens/").json()[0]["prefix"] == body["prefix"]
    assert "token" not in as_viewer.get("/api/v1/tokens/").json()[0]
    event = Event.objects.filter(subject="user/the-viewer").latest("id")
    assert event.message.startswith(f"operator token {body['prefix']} (script) of the-viewer made by user the-viewer")


def test_an_expired_token_is_refused(db):
    created = services.token_create(user=_user(roles.OPERATOR), days=1)
    client = _bearer(created.token)
    assert client.get("/api/v1/nodes/").status_code == 200
    OperatorToken.objects.filter(pk=created.row.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    refused = client.get("/api/v1/nodes/")
    assert refused.status_code == 401 and "expired" in refused.json()["detail"]


def test_a_token_never_outlives_the_token_that_made_it(db):
    parent = services.token_create(user=_user(roles.OPERATOR), days=1)
    child = _bearer(parent.token).post("/api/v1/tokens/", {"days": 300}, format="json").json()
    assert OperatorToken.objects.get(prefix=child["prefix"]).expires_at == parent.row.expires_at
    assert _bearer(parent.token).post("/api/v1/tokens/", {"days": 1000}, format="json").status_code == 400


def test_revoking_own_and_others_tokens(db):
    viewer, operator, admin = _user(roles.VIEWER), _user(roles.OPERATOR), _user(roles.ADMIN)
    theirs = services.token_create(user=operator, days=5)
    mine = services.token_create(user=viewer, days=5)
    as_viewer = _bearer(mine.token)
    # Someone else's token is as absent as a token that does not exist.
    assert as_viewer.delete(f"/api/v1/tokens/{theirs.row.prefix}/").status_code == 404
    assert as_viewer.get("/api/v1/tokens/", {"all": "1"}).json()[0]["prefix"] == mine.row.prefix
    as_admin = _bearer(services.token_create(user=admin, days=5).token)
    assert {t["user"] for t in as_admin.get("/api/v1/tokens/", {"all": "1"}).json()} == {
        "the-viewer", "the-operator", "the-admin"}
    assert as_admin.delete(f"/api/v1/tokens/{theirs.row.prefix}/").status_code == 200
    assert _bearer(theirs.token).get("/api/v1/nodes/").status_code == 401
    assert as_viewer.delete(f"/api/v1/tokens/{mine.row.prefix}/").status_code == 200
    assert as_viewer.get("/api/v1/nodes/").status_code == 401
    messages = set(Event.objects.values_list("message", flat=True))
    assert f"operator token {theirs.row.prefix} of the-operator revoked by user the-admin" in messages


def test_the_tokens_page_makes_and_revokes(client, db):
    viewer = _user(roles.VIEWER)
    client.force_login(viewer)
    assert client.get("/tokens/").status_code == 200
    made = client.post("/tokens/new/", {"name": "laptop", "days": "30"})
    assert made.status_code == 201
    token = re.search(rb"id=\"new-token-value\">(llmgw-op-\w+)<", made.content).group(1).decode()
    assert _bearer(token).get("/api/v1/nodes/").status_code == 200
    prefix = OperatorToken.objects.get(user=viewer).prefix
    assert client.post(f"/tokens/{prefix}/revoke/").status_code == 302
    assert not OperatorToken.objects.filter(user=viewer).exists()
    assert client.post("/tokens/new/", {"days": "9999"}).status_code == 400


@pytest.mark.django_db(transaction=True)
def test_ctl_tokens_create_list_revoke(web_factory):
    from tests.test_ctl_rest import run

    operator = _user(roles.OPERATOR)
    first = services.token_create(user=operator, days=10)
    web = web_factory()
    env = server_env(LLMGW_URL=web.url, LLMGW_TOKEN=first.token, LLMGW_DATA_DIR="/nonexistent")
    made = run("tokens", "create", "ci", "--days", "2", "-q", env=env)
    token = made.stdout.strip()
    assert re.fullmatch(r"llmgw-op-\w{40}", token)
    listed = run("tokens", "list", env=env).stdout
    assert "ci" in listed and token not in listed and "the-operator" in listed
    prefix = token[:17]
    assert f"revoked operator token {prefix} of the-operator" in run("tokens", "revoke", prefix, env=env).stdout
    assert "404" in run("tokens", "revoke", prefix, env=env, rc=1).stderr
    assert get_user_model().objects.get(username="the-operator").operator_tokens.count() == 1
