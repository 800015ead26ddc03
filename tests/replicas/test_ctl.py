"""'llmgw ctl' for the catalog and replicas, as real subprocesses against the
real web process (REST API)."""

import json
import subprocess
import sys

import pytest

from replicas import reconcile
from tests.factories import node_with_gpus

pytestmark = pytest.mark.django_db(transaction=True)

CATALOG = """
models:
  - name: llama-70b
    engine: vllm
    model: /models/llama-70b
    nodes: 2
    gpus_per_node: 4
    replicas: 1
    args: ["--max-model-len", "8192"]
    env: {VLLM_LOGGING_LEVEL: INFO}
"""


@pytest.fixture
def ctl(web_factory, admin_token):
    web = web_factory()

    def run(*args, stdin=None):
        env = dict(web.env, LLMGW_URL=web.url, LLMGW_TOKEN=admin_token)
        return subprocess.run([sys.executable, "-m", "cli", "ctl", *args], env=env, input=stdin,
                              capture_output=True, text=True, timeout=60)

    return run


def test_apply_scale_replicas_drain(ctl, tmp_path, no_reconcile_enqueue):
    node_with_gpus("node01", fabric="ib-a", addr="127.0.1.1")
    node_with_gpus("node02", fabric="ib-a", addr="127.0.1.2")
    path = tmp_path / "catalog.yaml"
    path.write_text(CATALOG)
    result = ctl("apply", "-f", str(path))
    assert result.returncode == 0, result.stderr
    assert "llama-70b created" in result.stdout
    assert "llama-70b unchanged" in ctl("apply", "-f", str(path)).stdout

    reconcile.replicas_reconcile()
    replicas = json.loads(ctl("replicas", "-o", "json").stdout)
    assert len(replicas) == 1
    leader, worker = replicas[0]["members"]
    assert (leader["node"], worker["node"]) == ("node01", "node02")
    # What ran, exactly: argv, environment, GPUs and ports of each member.
    assert leader["argv"][:3] == ["vllm", "serve", "/models/llama-70b"]
    assert "--headless" in worker["argv"] and "--headless" not in leader["argv"]
    # "=" makes NCCL match the names exactly (mlx5_1 must not also select mlx5_10).
    assert leader["env"]["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"
    assert leader["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert set(leader["ports"]) >= {"http", "rendezvous"}
    table = ctl("replicas").stdout
    assert "llama-70b" in table and "node01[0,1,2,3]" in table

    refused = ctl("scale", "llama-70b", "-1")
    # A sentence, never a Python dict; nothing changed.
    assert refused.returncode == 1 and refused.stderr.strip() == "llmgw: 400: replicas: must be 0 or more"
    assert json.loads(ctl("models", "-o", "json").stdout)[0]["replicas"] == 1
    scaled = ctl("scale", "llama-70b", "3")
    assert scaled.returncode == 0 and "scaled to 3" in scaled.stdout
    reconcile.replicas_reconcile()
    models = json.loads(ctl("models", "-o", "json").stdout)
    assert models[0]["replicas"] == 3
    assert models[0]["replica_counts"]["scheduled"] == 2
    assert models[0]["pending_reasons"], "the third replica cannot fit and says why"
    assert "needs 2 nodes x 4 GPUs" in ctl("models").stdout or "needs 2 nodes x 4 GPUs" in ctl("replicas").stdout

    drained = ctl("drain", "node01")
    assert drained.returncode == 0, drained.stderr
    nodes = {n["name"]: n for n in json.loads(ctl("nodes", "-o", "json").stdout)}
    assert nodes["node01"]["status"] == "draining"
    events = json.loads(ctl("events", "-o", "json").stdout)
    assert any(e["kind"] == "drain" for e in events)
    assert any("drain requested by user admin" in e["message"] for e in events)

    # Called off: the drain ends, node01 stays cordoned, an Event names what ended and who.
    cancelled = ctl("drain", "node01", "--cancel")
    assert cancelled.returncode == 0, cancelled.stderr
    assert "cancelled" in cancelled.stdout and "stays cordoned" in cancelled.stdout
    nodes = {n["name"]: n for n in json.loads(ctl("nodes", "-o", "json").stdout)}
    assert nodes["node01"]["status"] == "cordoned"
    events = json.loads(ctl("events", "-o", "json").stdout)
    assert any(e["kind"] == "drain" and "ended (cancelled by user admin)" in e["message"] for e in events)
    again = ctl("drain", "node01", "--cancel")
    assert again.returncode == 1 and "no drain under way" in again.stderr and "cancelled" in again.stderr

    # Drained again, then uncordoned: that ends the new drain too.
    assert ctl("drain", "node01").returncode == 0
    uncordoned = ctl("uncordon", "node01")
    assert uncordoned.returncode == 0 and "node01 is ready" in uncordoned.stdout
    from replicas.models import Drain

    assert list(Drain.objects.filter(node__name="node01").values_list("status", flat=True)) == ["cancelled"] * 2


def test_apply_refuses_a_malformed_catalog_and_names_the_field(ctl, tmp_path):
    path = tmp_path / "catalog.yaml"
    path.write_text(CATALOG.replace("nodes: 2", "nodes: two"))
    result = ctl("apply", "-f", str(path))
    assert result.returncode == 1
    assert "nodes" in result.stderr and "not changed" in result.stderr
    assert json.loads(ctl("models", "-o", "json").stdout) == []
    path.write_text("models: [unclosed")
    result = ctl("apply", "-f", str(path))
    assert result.returncode == 1 and "not valid YAML" in result.stderr


def test_api_errors_read_as_sentences():
    from cli.ctl.common import error_sentence

    assert error_sentence({"replicas": ["must be 0 or more"]}) == "replicas: must be 0 or more"
    assert error_sentence({"detail": "no model named 'x'"}) == "no model named 'x'"
    assert error_sentence({"non_field_errors": ["a", "b"], "nodes": ["must be at least 1"]}) == (
        "a; b; nodes: must be at least 1")
    assert error_sentence({"env": {"PATH": ["not allowed"]}}) == "env: PATH: not allowed"


def test_scale_on_an_autoscaled_model_sets_bounds_or_says_why_not(ctl, tmp_path, no_reconcile_enqueue):
    path = tmp_path / "catalog.yaml"
    path.write_text("models:\n  - name: qwen\n    engine: sim\n    model: /m\n"
                    "    autoscale: {min: 1, max: 4, target: 4}\n")
    assert ctl("apply", "-f", str(path)).returncode == 0
    refused = ctl("scale", "qwen", "3")
    assert refused.returncode != 0
    assert "qwen is autoscaled (1-4 replicas" in refused.stderr and "--min N --max M" in refused.stderr
    bounded = ctl("scale", "qwen", "--min", "2", "--max", "6")
    assert bounded.returncode == 0, bounded.stderr
    assert "qwen autoscales between 2 and 6 replicas (now 2)" in bounded.stdout
    listing = json.loads(ctl("models", "-o", "json").stdout)
    assert listing[0]["autoscale"]["min"] == 2 and listing[0]["replicas"] == 2
    fixed = ctl("scale", "qwen", "--min", "7")
    assert fixed.returncode != 0 and "min (7) is above max (6)" in fixed.stderr
