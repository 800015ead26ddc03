"""Rollouts through the REST API and 'llmgw ctl rollout': status, pause,
resume, undo; operators steer, viewers only look; refusals are 4xx."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from rest_framework.test import APIClient

from accounts import roles, services
from replicas.choices import RolloutStatus
from replicas.models import Replica, Rollout
from tests.factories import node_with_gpus
from tests.replicas.test_rollout import ENTRY, _settle

pytestmark = pytest.mark.django_db


@pytest.fixture
def users(settings, no_reconcile_enqueue):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.LLMGW_ROUTING_SETTLE = 0
    made = {}
    for role in (roles.VIEWER, roles.OPERATOR):
        user, _ = services.user_create(actor="tests", username=f"the-{role}", role=role, password="pw-for-the-tests-1")
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {services.token_create(user=user).token}")
        made[role] = client
    return made


@pytest.fixture
def rolling(users):
    for i in range(6):
        node_with_gpus(f"node{i:02d}", gpus=4, addr=f"127.0.1.{i + 1}")
    operator = users[roles.OPERATOR]
    assert operator.post("/api/v1/catalog/apply/", {"models": [ENTRY]}, format="json").status_code == 200
    _settle(3)
    changed = {**ENTRY, "args": ["--token-delay", "0.01"]}
    assert operator.post("/api/v1/catalog/apply/", {"models": [changed]}, format="json").status_code == 200
    _settle(1)
    return users


def test_status_pause_resume_undo_over_rest(rolling):
    viewer, operator = rolling[roles.VIEWER], rolling[roles.OPERATOR]
    status = viewer.get("/api/v1/models/llama/rollout/")
    assert status.status_code == 200
    body = status.json()
    assert body["revision"] == 2 and body["wanted"] == 4 and body["max_surge"] == 1
    assert body["rollout"]["from_revision"] == 1 and body["rollout"]["to_revision"] == 2
    assert body["rollout"]["status"] == "running" and body["rollout"]["waiting_for"]
    # Viewers look; they do not steer.
    for verb in ("pause", "resume", "undo"):
        refused = viewer.post(f"/api/v1/models/llama/rollout/{verb}/")
        assert refused.status_code == 403, refused.content
    assert Rollout.objects.get().status == RolloutStatus.RUNNING
    paused = operator.post("/api/v1/models/llama/rollout/pause/")
    assert paused.status_code == 200 and paused.json()["rollout"]["status"] == "paused"
    again = operator.post("/api/v1/models/llama/rollout/pause/")
    assert again.status_code == 409 and "cannot pause the rollout of llama" in again.json()["detail"]
    assert operator.post("/api/v1/models/llama/rollout/resume/").json()["rollout"]["status"] == "running"
    _settle(14)
    done = viewer.get("/api/v1/models/llama/rollout/").json()
    assert done["rollout"]["status"] == "done" and done["ready_current"] == 4
    models = viewer.get("/api/v1/models/").json()
    assert models[0]["revision"] == 2 and models[0]["ready_current"] == 4
    replicas = viewer.get("/api/v1/replicas/").json()
    assert {r["revision"] for r in replicas} == {2}
    undo = operator.post("/api/v1/models/llama/rollout/undo/")
    assert undo.status_code == 200, undo.content
    assert undo.json()["revision"] == 3 and undo.json()["rollout"]["to_revision"] == 3
    assert operator.get("/api/v1/models/llama/").json()["args"] == []


def test_unknown_model_is_404_and_no_previous_revision_is_409(users):
    operator = users[roles.OPERATOR]
    assert operator.get("/api/v1/models/nope/rollout/").status_code == 404
    assert operator.post("/api/v1/models/nope/rollout/undo/").status_code == 404
    assert operator.post("/api/v1/catalog/apply/", {"models": [ENTRY]}, format="json").status_code == 200
    refused = operator.post("/api/v1/models/llama/rollout/undo/")
    assert refused.status_code == 409 and "no previous revision" in refused.json()["detail"]
    none = operator.get("/api/v1/models/llama/rollout/").json()
    assert none["rollout"] is None and none["revision"] == 1
    refused = operator.post("/api/v1/models/llama/rollout/resume/")
    assert refused.status_code == 409 and "no rollout under way" in refused.json()["detail"]


@pytest.mark.django_db(transaction=True)
def test_ctl_rollout(web_factory, admin_token, no_reconcile_enqueue, settings, tmp_path):
    settings.LLMGW_ROUTING_SETTLE = 0
    web = web_factory()

    def ctl(*args):
        env = dict(web.env, LLMGW_URL=web.url, LLMGW_TOKEN=admin_token)
        return subprocess.run([sys.executable, "-m", "cli", "ctl", *args], env=env, capture_output=True,
                              text=True, timeout=60)

    for i in range(6):
        node_with_gpus(f"node{i:02d}", gpus=4, addr=f"127.0.1.{i + 1}")
    from replicas.catalog import catalog_apply
    catalog_apply(entries=[ENTRY])
    _settle(3)
    catalog_apply(entries=[{**ENTRY, "args": ["--token-delay", "0.01"]}])
    _settle(1)
    status = ctl("rollout", "status", "llama")
    assert status.returncode == 0, status.stderr
    assert "rollout revision 1 -> 2: running" in status.stdout and "waiting for:" in status.stdout
    paused = ctl("rollout", "pause", "llama")
    assert paused.returncode == 0 and "paused" in paused.stdout
    refused = ctl("rollout", "pause", "llama")
    assert refused.returncode == 1 and "409: cannot pause the rollout of llama" in refused.stderr
    # A change applied to a paused rollout: the new one starts paused, and both say so.
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(yaml.safe_dump({"models": [{**ENTRY, "args": ["--token-delay", "0.02"]}]}))
    applied = ctl("apply", "-f", str(catalog))
    assert applied.returncode == 0, applied.stderr
    assert ("llama: rollout revision 1 -> 3 started paused (the rollout it supersedes was paused; "
            "'llmgw ctl rollout resume llama' carries it on)") in applied.stdout, applied.stdout
    held = ctl("rollout", "status", "llama").stdout
    assert "rollout revision 1 -> 3: paused (paused: the rollout it superseded was paused)" in held, held
    no_undo = ctl("rollout", "undo", "llama")
    assert no_undo.returncode == 1 and "while it is paused" in no_undo.stderr and "resume it first" in no_undo.stderr
    assert ctl("rollout", "resume", "llama").returncode == 0
    _settle(16)
    table = ctl("replicas").stdout
    assert table.splitlines()[0].split()[:4] == ["replica", "model", "rev", "state"]
    assert all(line.split()[2] == "3" for line in table.splitlines()[1:]), table
    assert json.loads(ctl("rollout", "status", "llama", "-o", "json").stdout)["rollout"]["status"] == "done"
    undone = ctl("rollout", "undo", "llama")
    assert undone.returncode == 0 and "revision 4" in undone.stdout
    assert Replica.objects.exclude(status="stopped").count() >= 4
    missing = ctl("rollout", "status", "nope")
    assert missing.returncode == 1 and "404" in missing.stderr
