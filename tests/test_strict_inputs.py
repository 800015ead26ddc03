"""Documents an operator writes refuse unknown keys by name, at every level,
and nothing changes (issue 25): a catalog file through ``llmgw ctl apply``,
the catalog's REST bodies, and every other write body of the operator API,
against the real web process. The mechanism (``core.strict``) derives the
known keys from the serializers' declared fields, nested ones included, so a
field declared later is covered without touching it: checked here with
serializers declared in the test, and over the whole OpenAPI document."""

from __future__ import annotations

import re
import subprocess

import httpx
import pytest
from django.contrib.auth import get_user_model
from drf_spectacular.generators import SchemaGenerator
from rest_framework import serializers

from accounts.models import OperatorToken
from gateway.models import ApiKey
from pki.models import Certificate
from provisioning.models import Hypervisor, Job
from replicas.catalog import CatalogInvalid, catalog_validate
from replicas.models import CatalogEntry, Drain
from replicas.validation import CatalogEntryFields
from tests.conftest import REPO, server_env
from tests.factories import node_with_gpus

pytestmark = pytest.mark.django_db(transaction=True)

LLMGW = str(REPO / ".venv" / "bin" / "llmgw")

ENTRY = """
models:
  - name: tiny
    engine: sim
    model: /models/tiny
    {replicas_key}: 3
    gpus_per_node: 1
"""


@pytest.fixture
def web(web_factory):
    return web_factory()


@pytest.fixture
def ctl(web, admin_token, tmp_path):
    env = server_env(LLMGW_URL=web.url, LLMGW_TOKEN=admin_token, LLMGW_DATA_DIR=str(tmp_path / "nowhere"))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([LLMGW, "ctl", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)

    return run


@pytest.fixture
def api(web, admin_token):
    with httpx.Client(base_url=web.url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=30) as client:
        yield client


# --- the catalog through the CLI ------------------------------------------------


def test_ctl_apply_refuses_a_typo_in_an_entry_and_creates_nothing(ctl, tmp_path, no_reconcile_enqueue):
    path = tmp_path / "catalog.yaml"
    path.write_text(ENTRY.format(replicas_key="replica"))
    result = ctl("apply", "-f", str(path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "models[0] (tiny): replica: unknown key; did you mean replicas?" in result.stderr
    assert "Traceback" not in result.stderr
    assert not CatalogEntry.objects.exists()

    # The same file spelled right is applied as written: 3 replicas, not the default 1.
    path.write_text(ENTRY.format(replicas_key="replicas"))
    result = ctl("apply", "-f", str(path))
    assert result.returncode == 0, result.stderr
    assert CatalogEntry.objects.get(name="tiny").replicas == 3


def test_ctl_apply_refuses_an_unknown_top_level_key_even_with_prune(ctl, tmp_path, no_reconcile_enqueue):
    path = tmp_path / "catalog.yaml"
    path.write_text(ENTRY.format(replicas_key="replicas"))
    assert ctl("apply", "-f", str(path)).returncode == 0
    # 'modles:' must not read as an empty catalog, which --prune would apply as "remove everything".
    path.write_text(ENTRY.format(replicas_key="replicas").replace("models:", "modles:"))
    result = ctl("apply", "-f", str(path), "--prune")
    assert result.returncode == 1
    assert "modles: unknown key; did you mean models?" in result.stderr
    model = CatalogEntry.objects.get(name="tiny")
    assert (model.removing, model.replicas) == (False, 3)


def test_ctl_apply_names_a_key_with_no_close_match(ctl, tmp_path, no_reconcile_enqueue):
    path = tmp_path / "catalog.yaml"
    path.write_text(ENTRY.format(replicas_key="replicas") + "    colour: blue\n")
    result = ctl("apply", "-f", str(path))
    assert result.returncode == 1
    # The keys an entry has grow with the catalog; the message lists them all, sorted.
    listed = result.stderr.split("colour: unknown key; the keys here are ", 1)[1].split("\n", 1)[0]
    assert {"args", "engine", "env", "gpus_per_node", "replicas"} <= set(listed.split(", "))
    assert not CatalogEntry.objects.exists()


def test_ctl_apply_refuses_a_typo_inside_the_source_block(ctl, tmp_path, no_reconcile_enqueue):
    # source: is free-form JSON to the serializer (its keys depend on its kind), and strict all the same.
    path = tmp_path / "catalog.yaml"
    path.write_text(ENTRY.format(replicas_key="replicas") + "    source:\n      kind: path\n      pth: /shared/tiny\n")
    result = ctl("apply", "-f", str(path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "models[0] (tiny): source.pth: unknown key; did you mean path?" in result.stderr
    assert not CatalogEntry.objects.exists()

    path.write_text(path.read_text().replace("pth:", "path:"))
    result = ctl("apply", "-f", str(path))
    assert result.returncode == 0, result.stderr
    assert CatalogEntry.objects.get(name="tiny").source == {"kind": "path", "path": "/shared/tiny"}


# --- the catalog through REST ---------------------------------------------------


def _entry(**extra) -> dict:
    return {"name": "tiny", "engine": "sim", "weights": "/models/tiny", "replicas": 2, **extra}


def test_rest_catalog_bodies_refuse_unknown_keys(api, no_reconcile_enqueue):
    answer = api.post("/api/v1/models/", json=_entry(gpus_per_nod=8))
    assert answer.status_code == 400
    assert "gpus_per_nod: unknown key; did you mean gpus_per_node?" in answer.json()["detail"]
    assert not CatalogEntry.objects.exists()

    answer = api.post("/api/v1/catalog/apply/", json={"models": [_entry()], "prunne": True})
    assert answer.status_code == 400
    assert answer.json() == {"prunne": ["unknown key; did you mean prune?"]}
    assert not CatalogEntry.objects.exists()

    assert api.post("/api/v1/models/", json=_entry()).status_code == 201
    for method, path, body, message in [
        ("put", "/api/v1/models/tiny/", {"replica": 5}, "replica: unknown key; did you mean replicas?"),
        ("patch", "/api/v1/models/tiny/", {"egnine": "vllm"}, "egnine: unknown key; did you mean engine?"),
    ]:
        answer = api.request(method, path, json=body)
        assert answer.status_code == 400, (path, answer.text)
        assert message in answer.json()["detail"]
        model = CatalogEntry.objects.get(name="tiny")
        assert (model.replicas, model.engine) == (2, "sim")
    answer = api.post("/api/v1/models/tiny/scale/", json={"replica": 5})
    assert (answer.status_code, answer.json()) == (400, {"replica": ["unknown key; did you mean replicas?"]})
    assert CatalogEntry.objects.get(name="tiny").replicas == 2


def test_catalog_yaml_name_model_is_an_alias_of_weights():
    (clean,) = catalog_validate([{"name": "a", "engine": "sim", "model": "/m"}])
    assert clean["weights"] == "/m"
    with pytest.raises(CatalogInvalid, match="model and weights are one key"):
        catalog_validate([{"name": "a", "engine": "sim", "model": "/m", "weights": "/n"}])


# --- fields declared later: nested serializers are walked -----------------------


class _Routing(serializers.Serializer):
    policy = serializers.CharField()


class _Stage(serializers.Serializer):
    weight = serializers.IntegerField()


class _EntryWithMore(CatalogEntryFields):
    """What another change may add to the catalog entry: a nested policy and a list of them."""

    routing = _Routing(required=False)
    stages = serializers.ListField(child=_Stage(), required=False)
    canaries = _Stage(many=True, required=False)

    class Meta(CatalogEntryFields.Meta):
        fields = [*CatalogEntryFields.Meta.fields, "routing", "stages", "canaries"]


def test_nested_fields_declared_later_are_strict_without_more_code():
    data = {"name": "a", "engine": "sim", "model": "/m", "routing": {"polcy": "least-load"},
            "stages": [{"weight": 1}, {"weigth": 2}], "canaries": [{"wieght": 1}]}
    fields = _EntryWithMore(data=data)
    assert not fields.is_valid()
    assert fields.errors == {
        "routing": {"polcy": ["unknown key; did you mean policy?"]},
        "stages": {1: {"weigth": ["unknown key; did you mean weight?"]}},
        "canaries": {0: {"wieght": ["unknown key; did you mean weight?"]}},
    }
    good = dict(data, routing={"policy": "least-load"}, stages=[{"weight": 1}], canaries=[{"weight": 1}])
    assert _EntryWithMore(data=good).is_valid()


# --- every other body an operator writes ---------------------------------------


def test_every_other_write_body_refuses_unknown_keys(api, web):
    node_with_gpus("node01", addr="127.0.1.1")
    user_model = get_user_model()
    counts = {
        "users": user_model.objects.count, "tokens": OperatorToken.objects.count, "keys": ApiKey.objects.count,
        "hypervisors": Hypervisor.objects.count, "jobs": Job.objects.count, "drains": Drain.objects.count,
        "revoked": Certificate.objects.filter(revoked_at__isnull=False).count,
    }
    before = {name: count() for name, count in counts.items()}
    cases = [
        ("/api/v1/users/", {"username": "bob", "role": "operator", "passwd": "x"}, "passwd",
         "did you mean password?"),
        ("/api/v1/users/admin/set-role/", {"rol": "viewer"}, "rol", "did you mean role?"),
        ("/api/v1/users/admin/set-superuser/", {"superuser": True, "supervisor": False}, "supervisor",
         "did you mean superuser?"),
        ("/api/v1/tokens/", {"name": "t", "day": 3}, "day", "did you mean days?"),
        ("/api/v1/keys/", {"name": "k", "model": ["tiny"]}, "model", "did you mean models?"),
        ("/api/v1/certificates/revoke/", {"target": "node01", "reasn": "x"}, "reasn", "did you mean reason?"),
        ("/api/v1/drains/", {"node": "node01", "wait": True}, "wait", "the keys here are node"),
        ("/api/v1/hypervisors/", {"name": "pve", "url": "https://127.0.0.1:8006", "token_id": "a@pve!b",
                                  "tokn_secret": "s"}, "tokn_secret", "did you mean token_secret?"),
        ("/api/v1/jobs/onboard/", {"node": "node09", "addr": "127.0.1.9", "fabric": ["ib-a"]}, "fabric",
         "did you mean fabrics?"),
    ]
    for path, body, key, hint in cases:
        answer = api.post(path, json=body)
        assert answer.status_code == 400, (path, answer.text)
        assert answer.json()[key] == [f"unknown key; {hint}"], (path, answer.text)
    # Nested: provisioning's 'onboard' is the onboarding body, as strict as it is.
    answer = api.post("/api/v1/jobs/provision/", json={
        "node": "node09", "vmid": 144, "ip": "127.0.1.9/24", "gateway": "127.0.1.254",
        "onboard": {"ssh_usr": "ubuntu"}})
    assert answer.status_code == 400, answer.text
    assert answer.json() == {"onboard": {"ssh_usr": ["unknown key; did you mean ssh_user?"]}}
    assert {name: count() for name, count in counts.items()} == before


def test_the_schema_says_every_write_body_is_strict():
    """A write endpoint added later with a body that is not strict fails here."""
    schema = SchemaGenerator().get_schema(request=None, public=True)
    components = schema["components"]["schemas"]
    bodies = 0
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if method not in ("post", "put", "patch") or body is None:
                continue
            bodies += 1
            component = components[body["$ref"].rsplit("/", 1)[-1]]
            assert component.get("additionalProperties") is False, f"{method.upper()} {path}: not core.strict"
    assert bodies >= 15
    assert components["OnboardOptions"]["additionalProperties"] is False


def test_every_post_without_a_body_refuses_one():
    """A POST the schema gives no body (cordon, cancel, ...) is core.strict.no_body:
    a body sent to it is refused, not ignored. A new one without it fails here."""
    schema = SchemaGenerator().get_schema(request=None, public=True)
    bodiless = {re.sub(r"{[^}]*}", "{}", path) for path, operations in schema["paths"].items()
                if "post" in operations and "requestBody" not in operations["post"]}
    generator = SchemaGenerator()
    generator._initialise_endpoints()
    checked = set()
    for path, _regex, method, callback in generator.endpoints:
        path = re.sub(r"{[^}]*}", "{}", path)
        if method != "POST" or path not in bodiless:
            continue
        actions = getattr(callback, "actions", None) or {}
        handler = getattr(callback.cls, actions.get("post", "post"))
        assert getattr(handler, "takes_no_body", False), f"POST {path}: takes no body but does not refuse one"
        checked.add(path)
    assert checked == bodiless and len(checked) >= 7


def test_a_request_that_takes_no_body_refuses_one(api):
    """cordon takes no body: a 'reason' sent with it would vanish, so it is refused."""
    from nodes.models import Node

    node_with_gpus("node01", addr="127.0.1.1")
    answer = api.post("/api/v1/nodes/node01/cordon/", json={"reason": "maintenance"})
    assert (answer.status_code, answer.json()) == (400, {"reason": ["unknown key; this request takes no body"]})
    assert Node.objects.get(name="node01").status == "ready"
    assert api.post("/api/v1/nodes/node01/cordon/").status_code == 200
    assert api.post("/api/v1/nodes/node01/uncordon/", json={}).status_code == 200
    assert api.post("/api/v1/keys/", json={"name": "k"}).status_code == 201
    answer = api.post("/api/v1/keys/k/revoke/", json={"now": True})
    assert answer.status_code == 400 and ApiKey.objects.get(name="k").revoked_at is None
