"""/api/v1/hypervisors/ and /api/v1/jobs/: permissions of their own, bad
input named by field with nothing changed, the token secret never shown."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from rest_framework.test import APIClient

from core.models import Event
from provisioning.models import Hypervisor, Job
from tests.factories import NodeFactory

from .conftest import hypervisor_fields, job_run, provision_request
from .pve import TOKEN_SECRET

pytestmark = pytest.mark.django_db(transaction=True)


def _client(*perms: str, staff: bool = True) -> APIClient:
    user = get_user_model().objects.create_user(f"u{len(perms)}{staff}", password="x", is_staff=staff)
    for name in perms:
        app, codename = name.split(".") if "." in name else ("provisioning", name)
        user.user_permissions.add(Permission.objects.get(codename=codename, content_type__app_label=app))
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def operator():
    return _client("run_provisioning", "view_job", "view_hypervisor", "add_hypervisor", "change_hypervisor",
                   "delete_hypervisor")


def _body(pve, **overrides) -> dict:
    body = hypervisor_fields(pve, **overrides)
    return body


def test_staff_without_the_permission_gets_403(pve, hypervisor):
    node_operator = _client("nodes.view_node", "nodes.change_node")  # may cordon nodes, may not provision
    assert node_operator.get("/api/v1/nodes/").status_code == 200
    for method, path, body, needed in [
        ("get", "/api/v1/jobs/", None, "provisioning.view_job"),
        ("post", "/api/v1/jobs/provision/", provision_request(), "provisioning.run_provisioning"),
        ("get", "/api/v1/hypervisors/", None, "provisioning.view_hypervisor"),
        ("post", "/api/v1/hypervisors/", _body(pve, name="other"), "provisioning.add_hypervisor"),
        ("post", "/api/v1/hypervisors/pve/check/", None, "provisioning.run_provisioning"),
        ("get", "/api/v1/hypervisors/ssh-key/", None, "provisioning.view_hypervisor"),
    ]:
        answer = getattr(node_operator, method)(path, body, format="json")
        assert answer.status_code == 403, (path, answer.content)
        assert needed in answer.json()["detail"]
    assert Job.objects.count() == 0 and Hypervisor.objects.count() == 1


def test_view_permission_reads_but_does_not_provision(pve, hypervisor):
    viewer = _client("view_job", "view_hypervisor")
    assert viewer.get("/api/v1/jobs/").status_code == 200
    assert viewer.get("/api/v1/hypervisors/").status_code == 200
    assert viewer.post("/api/v1/jobs/provision/", provision_request(), format="json").status_code == 403
    assert Job.objects.count() == 0


def test_the_permission_counts_not_staff(pve, hypervisor):
    assert _client("view_job", staff=False).get("/api/v1/jobs/").status_code == 200
    assert _client(staff=True).get("/api/v1/jobs/").status_code == 403


def test_hypervisor_crud_never_shows_the_secret(pve, operator):
    created = operator.post("/api/v1/hypervisors/", _body(pve), format="json")
    assert created.status_code == 201, created.content
    answers = [created]
    answers.append(operator.get("/api/v1/hypervisors/"))
    answers.append(operator.get("/api/v1/hypervisors/pve/"))
    answers.append(operator.patch("/api/v1/hypervisors/pve/", {"token_secret": TOKEN_SECRET + "x"}, format="json"))
    answers.append(operator.post("/api/v1/hypervisors/pve/check/"))
    answers.append(operator.get("/api/schema/"))
    for answer in answers:
        assert answer.status_code == 200 or answer.status_code == 201, answer.content
        assert TOKEN_SECRET not in answer.content.decode()
    detail = answers[2].json()
    assert "token_secret" not in detail and "token_secret_encrypted" not in detail and detail["has_ca"] is True
    check = answers[4].json()
    assert check["reachable"] is False and "authentication failure" in check["error"]
    operator.patch("/api/v1/hypervisors/pve/", {"token_secret": TOKEN_SECRET}, format="json")
    assert operator.post("/api/v1/hypervisors/pve/check/").json() == {
        "name": "pve", "reachable": True, "error": "", "version": "9.0.10", "missing": []}
    events = json.dumps(list(Event.objects.values()), default=str)
    assert TOKEN_SECRET not in events


@pytest.mark.parametrize("field,value,message", [
    ("url", "http://pve:8006", "https://host:8006"),
    ("token_id", "llmgw", "user@realm!tokenname"),
    ("image", "/var/lib/vz/images/noble.qcow2", "an API token can never import from an absolute path"),
    ("name", "Bad Name", "not a usable name"),
    ("token_secret", "", "required"),
])
def test_bad_hypervisor_is_refused_by_field(pve, operator, field, value, message):
    answer = operator.post("/api/v1/hypervisors/", _body(pve, **{field: value}), format="json")
    assert answer.status_code == 400
    assert message in json.dumps(answer.json()[field])
    assert Hypervisor.objects.count() == 0


@pytest.mark.parametrize("field,value,message", [
    ("node", "Node_04", "is not a valid node id"),
    ("node", "node01", "already a node of this cluster"),
    ("vmid", 99, "a VMID is an integer from 100"),
    ("ip", "10.0.0.144", "is not an address with its prefix"),
    ("gateway", "10.1.0.1", "is outside 10.0.0.0/24"),
    ("hypervisor", "nope", "no hypervisor named 'nope'"),
    ("disk", "200", "a size in GiB"),
    ("memory", "64G", "A valid integer is required"),
])
def test_bad_provision_request_is_refused_by_field(pve, hypervisor, operator, field, value, message):
    NodeFactory(name="node01")
    body = provision_request(ip="10.0.0.144/24", gateway="10.0.0.1")
    body[field] = value
    answer = operator.post("/api/v1/jobs/provision/", body, format="json")
    assert answer.status_code == 400, answer.content
    assert message in json.dumps(answer.json()[field])
    assert Job.objects.count() == 0 and pve.requests == []


def test_provision_through_the_api(pve, hypervisor, operator, vm_ssh, fast):
    answer = operator.post("/api/v1/jobs/provision/", provision_request(hypervisor=""), format="json")
    assert answer.status_code == 201, answer.content
    job = answer.json()
    assert job["status"] == "queued" and job["hypervisor"] == "pve" and job["node_name"] == "llmgw-node04"
    assert [s["name"] for s in job["steps"]] == ["validate", "vmid", "create", "resize", "start", "ssh"]
    again = operator.post("/api/v1/jobs/provision/", provision_request(vmid=145), format="json")
    assert again.status_code == 400 and "already running" in again.json()["node"][0]

    job_run(job["id"])
    done = operator.get(f"/api/v1/jobs/{job['id']}/").json()
    assert done["status"] == "succeeded"
    assert done["ssh_host_key"] == vm_ssh[2] and done["ssh_host_key_fingerprint"].startswith("SHA256:")
    assert all(s["started_at"] and s["finished_at"] and s["log"] for s in done["steps"])
    assert [j["id"] for j in operator.get("/api/v1/jobs/?status=succeeded").json()] == [job["id"]]

    refused = operator.post(f"/api/v1/jobs/{job['id']}/retry/")
    assert refused.status_code == 409 and "succeeded" in refused.json()["detail"]
    assert operator.post(f"/api/v1/jobs/{job['id']}/cancel/").status_code == 409
    assert operator.get("/api/v1/jobs/99999/").status_code == 404
    assert operator.post("/api/v1/jobs/99999/retry/").status_code == 404
    assert operator.get("/api/v1/jobs/abc/").status_code == 404
    assert TOKEN_SECRET not in json.dumps(done)


def test_ssh_key_is_shown(operator):
    key = operator.get("/api/v1/hypervisors/ssh-key/").json()
    assert key["public_key"].startswith("ssh-ed25519 ") and key["fingerprint"].startswith("SHA256:")


def test_openapi_schema_lists_the_endpoints(operator):
    schema = APIClient()
    schema.force_authenticate(get_user_model().objects.create_superuser("root", "", "x"))
    paths = schema.get("/api/schema/?format=json").json()["paths"]
    for path in ("/api/v1/hypervisors/", "/api/v1/hypervisors/{name}/check/", "/api/v1/hypervisors/ssh-key/",
                 "/api/v1/jobs/", "/api/v1/jobs/provision/", "/api/v1/jobs/{id}/retry/",
                 "/api/v1/jobs/{id}/cancel/"):
        assert path in paths, path


@pytest.mark.parametrize("change", [
    {"url": "https://127.0.0.9:8006"},
    {"ca_pem": ""},
    {"url": "https://127.0.0.9:8006", "ca_pem": "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"},
])
def test_moving_the_secret_elsewhere_needs_the_secret(pve, hypervisor, operator, change):
    """The probe changed url and CA without the secret, then 'check' sent the
    token to the new server. Now the change is refused, naming token_secret."""
    before = Hypervisor.objects.values().get(name="pve")
    answer = operator.patch("/api/v1/hypervisors/pve/", change, format="json")
    assert answer.status_code == 400, answer.content
    assert "give the token's secret again" in json.dumps(answer.json()["token_secret"])
    assert Hypervisor.objects.values().get(name="pve") == before
    # Given the secret, the same change is made.
    answer = operator.patch("/api/v1/hypervisors/pve/", {**change, "token_secret": TOKEN_SECRET}, format="json")
    assert answer.status_code == 200, answer.content


def test_other_changes_and_the_same_url_need_no_secret(pve, hypervisor, operator):
    answer = operator.patch("/api/v1/hypervisors/pve/", {"bridge": "vmbr1", "url": pve.url}, format="json")
    assert answer.status_code == 200, answer.content
    assert Hypervisor.objects.get(name="pve").bridge == "vmbr1"


def test_every_change_to_a_hypervisor_is_an_event_naming_who(pve, operator):
    who = "user " + get_user_model().objects.get().username
    assert operator.post("/api/v1/hypervisors/", _body(pve), format="json").status_code == 201
    assert operator.patch("/api/v1/hypervisors/pve/", {"bridge": "vmbr1"}, format="json").status_code == 200
    assert operator.patch("/api/v1/hypervisors/pve/", {"token_secret": TOKEN_SECRET}, format="json").status_code == 200
    assert operator.delete("/api/v1/hypervisors/pve/").status_code == 200
    events = list(Event.objects.filter(subject="hypervisor/pve").order_by("id"))
    assert [e.message for e in events] == [
        f"hypervisor pve added by {who} ({pve.url}, token {hypervisor_fields(pve)['token_id']})",
        f"hypervisor pve changed by {who}: bridge=vmbr1",
        f"hypervisor pve changed by {who}: token_secret",
        f"hypervisor pve removed by {who}",
    ]
    assert all(e.data["actor"] == who for e in events)
    assert TOKEN_SECRET not in json.dumps([e.data for e in events])
