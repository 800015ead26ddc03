"""Every action taken through the REST API (and so the CLI) writes an Event
naming the user who did it, as the web pages' actions do."""

from __future__ import annotations

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from accounts import roles, services
from core.models import Event
from gateway.services import key_create
from provisioning.choices import JobKind
from provisioning.models import Job
from replicas.models import Drain
from tests.factories import CatalogEntryFactory, NodeFactory

pytestmark = pytest.mark.django_db

ENTRY = {"name": "m3", "engine": "sim", "weights": "/models/sim", "nodes": 1, "gpus_per_node": 1, "replicas": 0}


@pytest.fixture
def world(db, settings, no_reconcile_enqueue):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    NodeFactory(name="n1")
    NodeFactory(name="n2", status="cordoned")
    NodeFactory(name="n3")
    CatalogEntryFactory(name="m", replicas=1)
    key_create(name="k")
    failed = Job.objects.create(kind=JobKind.PROVISION, node_name="n8", status="failed", status_changed_at=timezone.now())
    queued = Job.objects.create(kind=JobKind.PROVISION, node_name="n9", status="queued", status_changed_at=timezone.now())
    user, _ = services.user_create(actor="tests", username="alice", role=roles.ADMIN, password="alice-password-1")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {services.token_create(user=user).token}")
    return client, failed, queued


def _drain_of_n3() -> str:
    return f"/api/v1/drains/{Drain.objects.get(node__name='n3').pk}/cancel/"


# (method, path or a function of the world giving it, body, what the Event says)
ACTIONS = [
    ("/api/v1/nodes/n1/cordon/", None, "cordoned by user alice"),
    ("/api/v1/nodes/n2/uncordon/", None, "by user alice"),
    ("/api/v1/drains/", {"node": "n3"}, "drain requested by user alice"),
    ("/api/v1/models/m/scale/", {"replicas": 3}, "m scaled from 1 to 3 by user alice"),
    ("/api/v1/catalog/apply/", {"models": [ENTRY], "prune": False}, "catalog: m3 created by user alice"),
    ("/api/v1/keys/", {"name": "new"}, "created by user alice"),
    ("/api/v1/keys/k/revoke/", None, "API key k revoked by user alice"),
    ("job:failed:retry", None, "retried by user alice"),
    ("job:queued:cancel", None, "cancelled by user alice"),
]


@pytest.mark.parametrize("path, body, says", ACTIONS, ids=[a[0] for a in ACTIONS])
def test_a_rest_action_names_its_user_in_its_event(world, path, body, says):
    client, failed, queued = world
    if path.startswith("job:"):
        _, which, verb = path.split(":")
        path = f"/api/v1/jobs/{(failed if which == 'failed' else queued).pk}/{verb}/"
    before = Event.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
    answer = client.post(path, body, format="json")
    assert answer.status_code in (200, 201), answer.content
    messages = list(Event.objects.filter(pk__gt=before).values_list("message", flat=True))
    assert any(says in m for m in messages), messages


def test_cancelling_a_drain_through_the_api_names_the_user(world):
    client, _, _ = world
    assert client.post("/api/v1/drains/", {"node": "n3"}, format="json").status_code == 201
    answer = client.post(_drain_of_n3(), format="json")
    assert answer.status_code == 200, answer.content
    assert Event.objects.filter(message__contains="ended (cancelled by user alice)").exists()
