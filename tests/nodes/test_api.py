"""The operator REST API, its OpenAPI document, and the admin."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.urls import reverse
from drf_spectacular.validation import validate_schema
from rest_framework.test import APIClient

from accounts.services import token_create
from core.choices import CoreEventKind
from core.models import Event
from nodes import liveness
from nodes.choices import NodeEventKind, NodeStatus
from nodes.models import ControlPlaneClock
from pki import services as pki_services
from tests.factories import EventFactory, FabricFactory, GpuFactory, HcaFactory, NodeFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def api(db):
    user = get_user_model().objects.create_superuser("operator", "", "operator-password-for-tests")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_create(user=user).token}")
    return client


@pytest.fixture
def cluster(db):
    """node01 on ib-a with two GPUs and an HCA; node02, an island with one GPU."""
    node01 = NodeFactory(name="node01", fabrics=["ib-a"])
    GpuFactory(node=node01, index=1, uuid="GPU-b")
    GpuFactory(node=node01, index=0, uuid="GPU-a")
    HcaFactory(node=node01, name="mlx5_0", fabric=FabricFactory(name="ib-a"))
    node02 = NodeFactory(name="node02", status=NodeStatus.CORDONED, discovery_errors=["ib: no /sys/class/infiniband"])
    GpuFactory(node=node02, index=0, uuid="GPU-c")
    return node01, node02


# --- nodes --------------------------------------------------------------------------


def test_nodes_list_with_gpus_hcas_and_fabrics(api, cluster):
    liveness.store().record("node01", time.time() - 3)
    r = api.get("/api/v1/nodes/")
    assert r.status_code == 200
    nodes = {n["name"]: n for n in r.json()}
    assert list(nodes) == ["node01", "node02"]
    n1 = nodes["node01"]
    assert n1["status"] == "ready"
    assert n1["fabrics"] == ["ib-a"]
    assert [(g["index"], g["uuid"]) for g in n1["gpus"]] == [(0, "GPU-a"), (1, "GPU-b")]
    assert n1["gpus"][0]["name"] == "NVIDIA H200" and n1["gpus"][0]["memory_mib"] == 143771
    assert [(h["name"], h["fabric"], h["state"]) for h in n1["hcas"]] == [("mlx5_0", "ib-a", "ACTIVE")]
    # The liveness store's heartbeat, not the row's copy.
    assert 2 <= n1["heartbeat_age_seconds"] < 30
    assert n1["replicas"] == 0
    n2 = nodes["node02"]
    assert n2["status"] == "cordoned" and n2["fabrics"] == [] and n2["hcas"] == []
    assert n2["discovery_errors"] == ["ib: no /sys/class/infiniband"]


def test_node_detail_and_unknown_node(api, cluster):
    r = api.get("/api/v1/nodes/node01/")
    assert r.status_code == 200 and r.json()["name"] == "node01"
    r = api.get("/api/v1/nodes/node99/")
    assert r.status_code == 404
    assert "detail" in r.json()


def test_node_names_with_dots(api):
    NodeFactory(name="gpu-7.rack2")
    assert api.get("/api/v1/nodes/gpu-7.rack2/").json()["name"] == "gpu-7.rack2"
    r = api.post("/api/v1/nodes/gpu-7.rack2/cordon/")
    assert r.status_code == 200 and r.json()["status"] == "cordoned"


def test_cordon_and_uncordon(api, cluster):
    r = api.post("/api/v1/nodes/node01/cordon/")
    assert r.status_code == 200, r.content
    assert r.json()["status"] == "cordoned" and r.json()["name"] == "node01"
    event = Event.objects.filter(node__name="node01", kind=NodeEventKind.NODE_STATUS).latest("id")
    assert event.message == "ready -> cordoned: cordoned by user operator"

    r = api.post("/api/v1/nodes/node01/cordon/")
    assert r.status_code == 409
    assert r.json() == {"detail": "node node01 is cordoned; it cannot become cordoned"}

    r = api.post("/api/v1/nodes/node01/uncordon/")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    r = api.post("/api/v1/nodes/node01/uncordon/")
    assert r.status_code == 409 and "cannot become ready" in r.json()["detail"]


def test_cordon_unknown_node_is_404_with_a_message(api):
    r = api.post("/api/v1/nodes/node99/cordon/")
    assert r.status_code == 404
    assert r.json() == {"detail": "no node named 'node99'; 'llmgw ctl nodes' lists them"}


def test_lost_node_cannot_be_cordoned(api):
    NodeFactory(name="node01", status=NodeStatus.LOST)
    r = api.post("/api/v1/nodes/node01/cordon/")
    assert r.status_code == 409 and "lost" in r.json()["detail"]


def test_nodes_are_read_only(api, cluster):
    assert api.post("/api/v1/nodes/", {"name": "x"}, format="json").status_code == 405
    assert api.delete("/api/v1/nodes/node01/").status_code == 405
    assert api.patch("/api/v1/nodes/node01/", {"status": "lost"}, format="json").status_code == 405
    assert api.get("/api/v1/nodes/node01/cordon/").status_code == 405


# --- fabrics, events, certificates ----------------------------------------------------


def test_fabrics(api, cluster):
    NodeFactory(name="node03", fabrics=["ib-a", "ib.b"])
    r = api.get("/api/v1/fabrics/")
    assert r.status_code == 200
    assert [(f["name"], sorted(f["nodes"])) for f in r.json()] == [("ib-a", ["node01", "node03"]), ("ib.b", ["node03"])]
    assert api.get("/api/v1/fabrics/ib-a/").json()["name"] == "ib-a"
    assert api.get("/api/v1/fabrics/ib.b/").json()["nodes"] == ["node03"]
    assert api.get("/api/v1/fabrics/ib-z/").status_code == 404
    assert api.post("/api/v1/fabrics/", {"name": "ib-c"}, format="json").status_code == 405


def test_events_filters_and_order(api, cluster):
    node01, node02 = cluster
    first = EventFactory(node=node01, subject="node/node01", kind=NodeEventKind.NODE_STATUS, message="one")
    second = EventFactory(node=node02, subject="node/node02", kind=NodeEventKind.NODE_INVENTORY, message="two")
    third = EventFactory(subject="control-plane", kind=CoreEventKind.CONTROL_PLANE, message="three")

    r = api.get("/api/v1/events/")
    assert r.status_code == 200
    assert [e["id"] for e in r.json()] == [third.id, second.id, first.id]
    assert r.json()[0]["node"] is None and r.json()[1]["node"] == "node02"
    assert [e["message"] for e in api.get("/api/v1/events/?node=node01").json()] == ["one"]
    assert [e["message"] for e in api.get("/api/v1/events/?kind=node.inventory").json()] == ["two"]
    assert [e["message"] for e in api.get("/api/v1/events/?limit=2").json()] == ["three", "two"]
    assert len(api.get("/api/v1/events/?limit=nonsense").json()) == 3
    assert api.get(f"/api/v1/events/{first.id}/").json()["message"] == "one"
    assert api.post("/api/v1/events/", {"message": "x"}, format="json").status_code == 405


def test_revoking_through_the_api_names_who_and_refuses_what_cannot_be(api, pki_dir):
    first = pki_services.cert_issue_client(node_id="node01")
    second = pki_services.cert_issue_client(node_id="node01")
    answer = api.post("/api/v1/certificates/revoke/", {"target": first.row.serial, "reason": "laptop lost"},
                      format="json")
    assert answer.status_code == 200, answer.content
    assert [r["serial"] for r in answer.json()] == [first.row.serial]
    event = Event.objects.get(subject=f"certificate/{first.row.serial}")
    assert "revoked by" in event.message and "laptop lost" in event.message
    assert event.data["actor"] == "user operator" and "revoked by user operator" in event.message
    # The node's remaining live one, by node id.
    rows = api.post("/api/v1/certificates/revoke/", {"target": "node01"}, format="json").json()
    assert [r["serial"] for r in rows] == [second.row.serial]
    again = api.post("/api/v1/certificates/revoke/", {"target": "node01"}, format="json")
    assert again.status_code == 400 and "already revoked" in again.json()["target"][0]
    unknown = api.post("/api/v1/certificates/revoke/", {"target": "node99"}, format="json")
    assert unknown.status_code == 400 and "llmgw ctl cert list" in unknown.json()["target"][0]
    assert api.post("/api/v1/certificates/revoke/", {}, format="json").status_code == 400


def test_certificates_are_read_only(api, pki_dir):
    issued = pki_services.cert_issue_client(node_id="node01")
    pki_services.cert_revoke(target="node01", reason="test")
    r = api.get("/api/v1/certificates/")
    assert r.status_code == 200
    row = next(c for c in r.json() if c["serial"] == issued.row.serial)
    assert row["common_name"] == "node01" and row["kind"] == "client"
    assert row["fingerprint_sha256"] == issued.row.fingerprint_sha256
    assert row["revoked_at"] and row["revocation_reason"] == "test"
    assert "pem" not in row  # nothing but what an operator needs to recognise it
    assert {c["kind"] for c in api.get("/api/v1/certificates/?kind=client").json()} == {"client"}
    assert api.get(f"/api/v1/certificates/{issued.row.serial}/").json()["common_name"] == "node01"

    assert api.post("/api/v1/certificates/", {"common_name": "node02"}, format="json").status_code == 405
    assert api.delete(f"/api/v1/certificates/{issued.row.serial}/").status_code == 405
    assert api.put(f"/api/v1/certificates/{issued.row.serial}/", {}, format="json").status_code == 405


# --- authentication -------------------------------------------------------------------

ENDPOINTS = ["/api/v1/nodes/", "/api/v1/fabrics/", "/api/v1/events/", "/api/v1/certificates/"]


@pytest.mark.parametrize("path", ENDPOINTS)
def test_unauthenticated_is_refused(db, path):
    client = APIClient()
    r = client.get(path)
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"] == "Token"
    client.credentials(HTTP_AUTHORIZATION="Token not-a-real-token")
    assert client.get(path).status_code == 401


def test_unauthenticated_cordon_changes_nothing(db):
    NodeFactory(name="node01")
    assert APIClient().post("/api/v1/nodes/node01/cordon/").status_code == 401
    assert not Event.objects.exists()


def test_a_user_without_permissions_is_forbidden(db):
    user = get_user_model().objects.create_user("nobody", "", "nobody-password", is_staff=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_create(user=user).token}")
    NodeFactory(name="node01")
    for path in ENDPOINTS:
        assert client.get(path).status_code == 403
    assert client.post("/api/v1/nodes/node01/cordon/").status_code == 403


def test_real_http_with_token(web_factory, admin_token):
    NodeFactory(name="node01", fabrics=["ib-a"])
    web = web_factory()
    with httpx.Client(base_url=web.url, timeout=10) as client:
        assert client.get("/api/v1/nodes/").status_code == 401
        r = client.get("/api/v1/nodes/", headers={"Authorization": f"Token {admin_token}"})
        assert r.status_code == 200
        assert [(n["name"], n["fabrics"]) for n in r.json()] == [("node01", ["ib-a"])]
        r = client.post("/api/v1/nodes/node01/cordon/", headers={"Authorization": f"Token {admin_token}"})
        assert r.status_code == 200 and r.json()["status"] == "cordoned"
        schema = client.get("/api/schema/", headers={"Accept": "application/vnd.oai.openapi+json"})
        assert schema.status_code == 200 and "/api/v1/nodes/" in schema.json()["paths"]


# --- the OpenAPI document -----------------------------------------------------------------


def test_schema_is_valid_openapi_with_our_paths(client):
    r = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert r.status_code == 200
    schema = json.loads(r.content)
    validate_schema(schema)
    assert schema["openapi"].startswith("3.")
    paths = schema["paths"]
    for path, methods in {
        "/api/v1/nodes/": {"get"},
        "/api/v1/nodes/{name}/": {"get"},
        "/api/v1/nodes/{name}/cordon/": {"post"},
        "/api/v1/nodes/{name}/uncordon/": {"post"},
        "/api/v1/fabrics/": {"get"},
        "/api/v1/fabrics/{name}/": {"get"},
        "/api/v1/events/": {"get"},
        "/api/v1/events/{id}/": {"get"},
        "/api/v1/certificates/": {"get"},
        "/api/v1/certificates/{serial}/": {"get"},
        "/api/v1/drains/": {"get", "post"},
        "/api/v1/drains/{id}/": {"get"},
        "/api/v1/drains/{id}/cancel/": {"post"},
    }.items():
        assert path in paths, path
        assert set(paths[path]) - {"parameters"} == methods, (path, set(paths[path]))
    event_params = {p["name"] for p in paths["/api/v1/events/"]["get"]["parameters"]}
    assert {"node", "kind", "limit"} <= event_params
    cert_params = {p["name"] for p in paths["/api/v1/certificates/"]["get"].get("parameters", [])}
    assert "kind" in cert_params
    node = schema["components"]["schemas"]["Node"]["properties"]
    assert {"gpus", "hcas", "fabrics", "heartbeat_age_seconds", "replicas"} <= set(node)
    assert "TokenAuth" in json.dumps(schema["components"].get("securitySchemes", {})) or "tokenAuth" in json.dumps(
        schema["components"].get("securitySchemes", {})
    )


def test_schema_generation_has_no_warnings_or_errors(tmp_path):
    """As 'manage.py spectacular --validate --fail-on-warn' checks it."""
    out = tmp_path / "schema.yml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(out))
    assert "/api/v1/nodes/{name}/cordon/" in out.read_text()


# --- the admin --------------------------------------------------------------------------


@pytest.fixture
def everything(cluster, pki_dir):
    node01, _ = cluster
    EventFactory(node=node01)
    ControlPlaneClock.objects.get_or_create(pk=1)
    pki_services.cert_issue_client(node_id="node01")


def test_every_admin_changelist_loads(admin_client, everything):
    checked = []
    for model, model_admin in admin.site._registry.items():
        opts = model._meta
        url = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
        r = admin_client.get(url)
        assert r.status_code == 200, f"{url}: {r.status_code}"
        checked.append(opts.label)
        obj = model_admin.get_queryset(admin_client.get(url).wsgi_request).first()
        if obj is not None:
            change = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk])
            assert admin_client.get(change).status_code == 200, change
    assert {"nodes.Node", "nodes.Gpu", "nodes.Hca", "nodes.Fabric", "core.Event", "nodes.ControlPlaneClock",
            "pki.Certificate"} <= set(checked)


def test_admin_index_and_search(admin_client, everything):
    assert admin_client.get("/admin/").status_code == 200
    r = admin_client.get(reverse("admin:nodes_node_changelist") + "?q=node01")
    assert r.status_code == 200 and b"node01" in r.content


def test_admin_certificates_cannot_be_added(admin_client, everything):
    assert admin_client.get(reverse("admin:pki_certificate_add")).status_code == 403


def test_admin_cordon_action_reports_refusals(admin_client, cluster):
    url = reverse("admin:nodes_node_changelist")
    node01, node02 = cluster  # node02 is already cordoned
    r = admin_client.post(
        url, {"action": "cordon", "_selected_action": [node01.pk, node02.pk]}, follow=True
    )
    assert r.status_code == 200
    node01.refresh_from_db()
    node02.refresh_from_db()
    assert node01.status == NodeStatus.CORDONED and node02.status == NodeStatus.CORDONED
    text = r.content.decode()
    assert "node02 is cordoned; it cannot become cordoned" in text
    r = admin_client.post(url, {"action": "uncordon", "_selected_action": [node01.pk]}, follow=True)
    node01.refresh_from_db()
    assert node01.status == NodeStatus.READY
