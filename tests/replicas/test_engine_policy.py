"""Whoever writes the catalog is not root on every node: environment and
flags that load code into an engine are refused, through the REST API and
the UI's apply, with a 400 naming them; --trust-remote-code is an admin's
(issue 19, item 1b). The engines' user is tests/agent/test_engine_user.py."""

from __future__ import annotations

import pytest

from accounts import roles
from accounts.services import token_create, user_create
from replicas.models import CatalogEntry

pytestmark = pytest.mark.django_db

# The probe's exact payload.
PROBE_ENV = {"PYTHONWARNINGS": "all::antigravity.x", "BROWSER": '/bin/sh -c "id > /tmp/llmgw-probe-owned" %s'}
BASE = {"name": "probe", "engine": "vllm", "weights": "/models/probe", "nodes": 1, "gpus_per_node": 1,
        "replicas": 0}


@pytest.fixture(autouse=True)
def _no_worker(no_reconcile_enqueue):
    pass


@pytest.fixture
def as_role(client):
    """as_role(role) -> headers of a REST caller with that role's token."""
    def make(role: str) -> dict:
        user, _ = user_create(username=f"the-{role}", role=role, actor="tests")
        return {"HTTP_AUTHORIZATION": f"Token {token_create(user=user).token}"}
    return make


def apply(client, headers, *entries):
    return client.post("/api/v1/catalog/apply/", {"models": list(entries)}, content_type="application/json",
                       **headers)


def test_the_probes_environment_is_refused_to_an_operator_naming_each_variable(client, as_role):
    r = apply(client, as_role(roles.OPERATOR), {**BASE, "env": PROBE_ENV})
    assert r.status_code == 400, r.content
    text = r.content.decode()
    assert "PYTHONWARNINGS" in text and "BROWSER" in text and "Remove it" in text
    assert not CatalogEntry.objects.exists()


@pytest.mark.parametrize("role", [roles.OPERATOR, roles.ADMIN])
@pytest.mark.parametrize(("engine", "change"), [
    ("vllm", {"env": {"LD_PRELOAD": "/tmp/x.so"}}),
    ("vllm", {"env": {"PYTHONPATH": "/tmp"}}),
    ("vllm", {"env": {"BASH_ENV": "/tmp/x"}}),
    ("vllm", {"env": {"NODE_OPTIONS": "--require /tmp/x"}}),
    ("vllm", {"env": {"NCCL_NET_PLUGIN": "/tmp/x.so"}}),
    ("vllm", {"env": {"VLLM_PLUGINS": "evil"}}),
    ("vllm", {"env": {"SOMETHING_ELSE": "1"}}),
    ("vllm", {"args": ["--worker-extension-cls", "evil.Ext"]}),
    ("vllm", {"args": ["--worker-cls=evil.Worker"]}),
    ("vllm", {"args": ["--logits-processors", "evil.P"]}),
    ("vllm", {"args": ["--tool-parser-plugin", "/tmp/x.py"]}),
    ("sglang", {"args": ["--custom-weight-loader", "evil.load"]}),
    ("sglang", {"args": ["--enable-custom-logit-processor"]}),
])
def test_code_loading_environment_and_flags_are_refused_to_everyone(client, as_role, role, engine, change):
    r = apply(client, as_role(role), {**BASE, "engine": engine, **change})
    assert r.status_code == 400, r.content
    named = next(iter(change["env"])) if "env" in change else change["args"][0].split("=")[0]
    assert named in r.content.decode()
    assert not CatalogEntry.objects.exists()


def test_what_engines_legitimately_need_is_accepted(client, as_role):
    env = {"NCCL_DEBUG": "INFO", "VLLM_LOGGING_LEVEL": "INFO", "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_x",
           "OMP_NUM_THREADS": "8", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "HTTPS_PROXY": "http://proxy:3128"}
    r = apply(client, as_role(roles.OPERATOR), {**BASE, "env": env, "args": ["--max-model-len", "8192"]})
    assert r.status_code == 200, r.content
    assert CatalogEntry.objects.get(name="probe").env == env


def test_trust_remote_code_is_an_admins_and_an_operator_may_reapply_it_unchanged(client, as_role):
    entry = {**BASE, "args": ["--trust-remote-code"]}
    operator, admin = as_role(roles.OPERATOR), as_role(roles.ADMIN)
    r = apply(client, operator, entry)
    assert r.status_code == 400 and "only an admin may set it" in r.content.decode(), r.content
    assert not CatalogEntry.objects.exists()
    assert apply(client, admin, entry).status_code == 200
    # The operator's catalog.yaml still lists it: unchanged, it applies (and scales).
    assert apply(client, operator, {**entry, "replicas": 2}).status_code == 200
    # Changing what code runs (the weights it comes from) is the admin's again.
    r = apply(client, operator, {**entry, "weights": "/models/other"})
    assert r.status_code == 400 and "--trust-remote-code" in r.content.decode()
    assert CatalogEntry.objects.get(name="probe").weights == "/models/probe"
    # The single-entry endpoint says the same.
    r = client.put("/api/v1/models/probe/", {**entry, "weights": "/models/other"}, content_type="application/json",
                   **operator)
    assert r.status_code == 400, r.content


def test_the_ui_apply_refuses_the_probe_too(client):
    user, _ = user_create(username="ui-operator", role=roles.OPERATOR, actor="tests")
    client.force_login(user)
    text = ("models:\n  - name: probe\n    engine: vllm\n    model: /models/probe\n    env:\n"
            "      PYTHONWARNINGS: all::antigravity.x\n"
            "      BROWSER: '/bin/sh -c \"id > /tmp/llmgw-probe-owned\" %s'\n")
    r = client.post("/catalog/apply/", {"yaml": text})
    assert r.status_code == 400
    assert b"PYTHONWARNINGS" in r.content and b"BROWSER" in r.content
    assert not CatalogEntry.objects.exists()


def test_a_row_saved_before_the_policy_never_passes_its_code_loading_env_to_a_node():
    import dataclasses

    from replicas.engines import launch_spec
    from tests.replicas.test_engines import member

    inp = dataclasses.replace(member("vllm", nodes=1, gpus_per_node=1, rank=0),
                              env={"LD_PRELOAD": "/tmp/x.so", "NCCL_DEBUG": "INFO", **PROBE_ENV})
    env = launch_spec(inp).env
    assert env["NCCL_DEBUG"] == "INFO"
    assert not {"LD_PRELOAD", "PYTHONWARNINGS", "BROWSER"} & set(env)
