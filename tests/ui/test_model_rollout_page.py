"""A model's page, its rollout part: its revision, ready replicas on it, its rollout; operators
pause, resume and undo there, viewers only look."""

from __future__ import annotations

import pytest
from django.test import Client

from accounts import roles
from accounts.services import user_create
from replicas.catalog import catalog_apply
from replicas.models import Rollout
from tests.factories import node_with_gpus
from tests.replicas.test_rollout import ENTRY, _settle

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue")]


@pytest.fixture
def rolling(settings):
    settings.LLMGW_ROUTING_SETTLE = 0
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    for i in range(6):
        node_with_gpus(f"node{i:02d}", gpus=4, addr=f"127.0.1.{i + 1}")
    catalog_apply(entries=[ENTRY])
    _settle(3)
    catalog_apply(entries=[{**ENTRY, "args": ["--token-delay", "0.01"]}])
    _settle(1)


def _client(role: str) -> Client:
    user, _ = user_create(actor="tests", username=f"the-{role}", role=role, password="pw-for-the-tests-1")
    client = Client()
    client.force_login(user)
    return client


def test_viewer_sees_the_rollout_and_cannot_steer_it(rolling):
    viewer = _client(roles.VIEWER)
    page = viewer.get("/models/llama/")
    assert page.status_code == 200
    text = page.content.decode()
    assert 'id="revision">2<' in text and "Revision 1 &rarr; 2" in text and "Waiting for" in text
    assert "rollout-actions" not in text
    assert viewer.post("/models/llama/rollout/pause/").status_code == 403
    assert Rollout.objects.get().status == "running"
    listing = viewer.get("/replicas/").content.decode()
    assert 'href="/models/llama/"' in listing


def test_operator_pauses_resumes_and_undoes(rolling):
    operator = _client(roles.OPERATOR)
    text = operator.get("/models/llama/").content.decode()
    assert "/models/llama/rollout/pause/" in text and "/models/llama/rollout/undo/" in text
    operator.post("/models/llama/rollout/pause/", HTTP_REFERER="/models/llama/")
    assert Rollout.objects.get().status == "paused"
    page = operator.get("/models/llama/").content.decode()
    assert "/models/llama/rollout/resume/" in page and "/models/llama/rollout/pause/" not in page
    operator.post("/models/llama/rollout/resume/")
    assert Rollout.objects.get().status == "running"
    # A refusal is a message on the page, never a 500.
    refused = operator.post("/models/llama/rollout/resume/", follow=True)
    assert refused.status_code == 200 and "cannot resume the rollout of llama" in refused.content.decode()
    operator.post("/models/llama/rollout/undo/")
    assert Rollout.objects.first().to_revision == 3
    assert operator.post("/models/llama/rollout/explode/").status_code == 404
    assert operator.get("/models/nope/").status_code == 404
