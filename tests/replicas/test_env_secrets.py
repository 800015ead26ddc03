"""A catalog env value such as HF_TOKEN was shown to viewers in
/api/v1/models/, /api/v1/replicas/ and the replica page. Secret values are
write-only: shown masked everywhere people look, given whole to the engines,
and kept when the masked value is sent back."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from accounts import roles, services
from replicas import reconcile
from replicas.envmask import MASK, env_is_secret
from replicas.models import CatalogEntry
from replicas.selectors import node_desired_members
from tests.factories import node_with_gpus

pytestmark = pytest.mark.django_db

TOKEN = "hf_REALsecretVALUE123"
ENTRY = {"name": "m", "engine": "sim", "weights": "/models/m", "nodes": 1, "gpus_per_node": 1, "replicas": 1,
         "env": {"HF_TOKEN": TOKEN, "VLLM_LOGGING_LEVEL": "DEBUG"}}


@pytest.fixture
def users(settings, no_reconcile_enqueue):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    made = {}
    for role in (roles.VIEWER, roles.OPERATOR):
        user, _ = services.user_create(actor="tests", username=f"the-{role}", role=role, password="pw-for-the-tests-1")
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {services.token_create(user=user).token}")
        made[role] = (user, client)
    return made


def test_secret_names():
    assert all(env_is_secret(n) for n in ("HF_TOKEN", "OPENAI_API_KEY", "AWS_SECRET", "DB_PASSWORD", "passwordish"))
    assert not any(env_is_secret(n) for n in ("LOG_LEVEL", "TOKENIZERS_PARALLELISM", "KEYRING", "VLLM_PORT"))


def test_secret_env_values_are_masked_for_viewers_and_reach_the_engines(users, client):
    viewer, operator = users[roles.VIEWER], users[roles.OPERATOR][1]
    node_with_gpus("node01", addr="127.0.1.1")
    assert operator.post("/api/v1/models/", ENTRY, format="json").status_code == 201
    reconcile.replicas_reconcile()
    answers = [viewer[1].get("/api/v1/models/"), viewer[1].get("/api/v1/models/m/"),
               viewer[1].get("/api/v1/replicas/")]
    for answer in answers:
        assert answer.status_code == 200
        assert TOKEN not in answer.content.decode()
    assert answers[1].json()["env"] == {"HF_TOKEN": MASK, "VLLM_LOGGING_LEVEL": "DEBUG"}
    member = answers[2].json()[0]["members"][0]
    assert member["env"]["HF_TOKEN"] == MASK
    client.force_login(viewer[0])
    page = client.get(f"/replicas/{answers[2].json()[0]['id']}/")
    assert page.status_code == 200 and TOKEN.encode() not in page.content and MASK.encode() in page.content
    # The engine gets the value itself.
    assert node_desired_members(node_name="node01")[0]["env"]["HF_TOKEN"] == TOKEN


def test_applying_the_masked_value_back_keeps_the_secret(users):
    operator = users[roles.OPERATOR][1]
    assert operator.post("/api/v1/catalog/apply/", {"models": [ENTRY]}, format="json").status_code == 200
    shown = operator.get("/api/v1/models/m/").json()
    again = {k: shown[k] for k in ENTRY}
    assert again["env"]["HF_TOKEN"] == MASK
    answer = operator.post("/api/v1/catalog/apply/", {"models": [again]}, format="json")
    assert answer.status_code == 200 and answer.json()["unchanged"] == ["m"], answer.content
    assert CatalogEntry.objects.get(name="m").env["HF_TOKEN"] == TOKEN
    # A PATCH of another field, and a new value, behave as expected.
    assert operator.patch("/api/v1/models/m/", {"replicas": 0}, format="json").status_code == 200
    assert CatalogEntry.objects.get(name="m").env["HF_TOKEN"] == TOKEN
    new_env = {"HF_TOKEN": "hf_new", "VLLM_LOGGING_LEVEL": "DEBUG"}
    assert operator.post("/api/v1/catalog/apply/", {"models": [{**ENTRY, "env": new_env}]},
                         format="json").status_code == 200
    assert CatalogEntry.objects.get(name="m").env["HF_TOKEN"] == "hf_new"


def test_a_mask_with_nothing_stored_is_refused(users):
    operator = users[roles.OPERATOR][1]
    entry = {**ENTRY, "env": {"HF_TOKEN": MASK}}
    answer = operator.post("/api/v1/catalog/apply/", {"models": [entry]}, format="json")
    assert answer.status_code == 400 and "HF_TOKEN is the mask, not a value" in answer.content.decode()
    assert not CatalogEntry.objects.exists()
