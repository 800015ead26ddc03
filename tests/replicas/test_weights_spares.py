"""Weights ready before they are needed: spares per fabric, staging by hand
(service, REST API and 'llmgw ctl models stage'), and what ctl nodes and
ctl models show of the nodes' caches."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from replicas import reconcile
from replicas.choices import ReplicaStatus
from replicas.models import CatalogEntry, Replica, StagedWeights
from replicas.weights_cache import node_desired_weights, node_weights_report
from replicas.weights_placement import WeightsNeed, WeightsView
from replicas.weights_spares import StageRefused, spares_choose, weights_stage
from tests.factories import node_with_gpus

MANIFEST = {"kind": "http", "revision": "r1", "total_bytes": 3000,
            "files": [{"name": "w.bin", "size": 3000, "sha256": "a" * 64, "url": "http://127.0.0.1:9/w.bin"}]}


def report(node, *, free=10**6, holds=False):
    models = [{"model": "m", "revision": "r1", "bytes": 3000, "total": 3000, "complete": True, "rate": 0.0,
               "error": ""}] if holds else []
    node_weights_report(node_name=node, report={"free_bytes": free, "budget_bytes": 10**7, "used_bytes": 0,
                                                "downloads": 0, "models": models})


def model(**kwargs):
    return CatalogEntry.objects.create(name="m", engine="sim", weights="/models/m", source={"kind": "http",
                                       "url": "http://127.0.0.1:9/"}, manifest=MANIFEST, **kwargs)


def test_spares_choose_keeps_current_then_holders_then_room_and_never_a_node_without_room():
    need = WeightsNeed("m@r1", 100)
    view = WeightsView(caches={"a", "b", "c", "d"}, holders={"m@r1": {"c"}}, room={"a": 500, "b": 50, "c": 0, "d": 900})
    assert spares_choose(count=2, candidates=["a", "b", "c", "d"], view=view, need=need, current=set()) == ["c", "d"]
    assert spares_choose(count=2, candidates=["a", "b", "c", "d"], view=view, need=need, current={"a"}) == ["a", "c"]
    assert spares_choose(count=5, candidates=["a", "b", "c", "d"], view=view, need=need, current=set()) == ["c", "d", "a"]


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_each_fabric_keeps_its_spares_off_the_nodes_serving_the_model():
    for name, fabric in (("node01", "ib-a"), ("node02", "ib-a"), ("node03", "ib-b"), ("node04", "ib-b")):
        node_with_gpus(name, fabric=fabric)
    for name in ("node01", "node02", "node03"):
        report(name, holds=(name == "node02"))
    report("node04", free=10)  # no room: never a spare
    model(replicas=1, spares=1)
    reconcile.replicas_reconcile()
    serving = Replica.objects.get().members.get().node.name
    assert serving == "node02"  # it holds the weights
    spares = dict(StagedWeights.objects.values_list("node__name", "why"))
    assert spares == {"node01": "spare", "node03": "spare"}, spares
    assert [w["model"] for w in node_desired_weights(node_name="node03")] == ["m"]
    assert node_desired_weights(node_name="node04") == []
    # The replica's node is lost: the rebuild finds the spare ready, and a new spare is chosen.
    report("node01", holds=True)
    Replica.objects.all().update(status=ReplicaStatus.STOPPED)
    reconcile.replicas_reconcile()
    rebuilt = Replica.objects.exclude(status=ReplicaStatus.STOPPED).get()
    assert rebuilt.members.get().node.name in ("node01", "node02")
    assert rebuilt.status == ReplicaStatus.SCHEDULED  # no staging: it held them already


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_stage_by_hand_and_what_it_refuses():
    node_with_gpus("node01", fabric="ib-a")
    node_with_gpus("node02", fabric="ib-a")
    node_with_gpus("node03")
    report("node01")
    report("node02", free=10)
    model(replicas=0)
    assert weights_stage(model="m", nodes=["node01"]) == ["node01"]
    assert [w["model"] for w in node_desired_weights(node_name="node01")] == ["m"]
    with pytest.raises(StageRefused, match="not enough room on node02: 10 bytes of room"):
        weights_stage(model="m", fabric="ib-a")
    with pytest.raises(StageRefused, match="node03: no weights cache"):
        weights_stage(model="m", nodes=["node03"])
    with pytest.raises(StageRefused, match="no node named nope"):
        weights_stage(model="m", nodes=["nope"])
    CatalogEntry.objects.create(name="plain", engine="sim", weights="/m")
    with pytest.raises(StageRefused, match="no weights source"):
        weights_stage(model="plain", nodes=["node01"])
    assert list(StagedWeights.objects.values_list("node__name", "why")) == [("node01", "manual")]


@pytest.fixture
def ctl(web_factory, admin_token):
    web = web_factory()

    def run(*args):
        env = dict(web.env, LLMGW_URL=web.url, LLMGW_TOKEN=admin_token)
        return subprocess.run([sys.executable, "-m", "cli", "ctl", *args], env=env, capture_output=True, text=True,
                              timeout=60)

    return run


@pytest.mark.django_db(transaction=True)
def test_ctl_models_stage_and_the_listings(ctl, no_reconcile_enqueue):
    node_with_gpus("node01", fabric="ib-a", addr="127.0.1.1")
    node_with_gpus("node02", fabric="ib-a", addr="127.0.1.2")
    report("node01", holds=True)
    report("node02", free=10)
    model(replicas=0)
    done = ctl("models", "stage", "m", "--node", "node01")
    assert done.returncode == 0 and "m: weights staging on node01" in done.stdout, done.stderr
    refused = ctl("models", "stage", "m", "--fabric", "ib-a")
    assert refused.returncode != 0 and "not enough room on node02" in refused.stderr
    missing = ctl("models", "stage", "nope", "--node", "node01")
    assert missing.returncode != 0 and "no model named 'nope'" in missing.stderr
    nodes = ctl("nodes").stdout
    line = next(line for line in nodes.splitlines() if line.startswith("node01"))
    assert "m@r1" in line and "0.0G" in line
    models = ctl("models").stdout
    assert "weights on" in models and "node01" in next(line for line in models.splitlines() if line.startswith("m "))
    listed = json.loads(ctl("models", "-o", "json").stdout)
    assert listed[0]["source"] == {"kind": "http", "url": "http://127.0.0.1:9/"}


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_metrics_export_bytes_cached_and_downloads_in_progress():
    from gateway.metrics import render
    from gateway.selectors import cluster_gauges

    node_with_gpus("node01")
    node_with_gpus("node02")
    report("node01", holds=True)
    node_weights_report(node_name="node02", report={
        "free_bytes": 5000, "budget_bytes": 10**7, "used_bytes": 10, "downloads": 1,
        "models": [{"model": "m", "revision": "r1", "bytes": 10, "total": 3000, "complete": False, "rate": 5.0,
                    "error": ""}]})
    page = render(cluster_gauges()).decode()
    assert 'llmgw_weights_cached_bytes{node="node01"} 3000.0' in page
    assert 'llmgw_weights_cached_bytes{node="node02"} 0.0' in page
    assert 'llmgw_weights_downloads{node="node02"} 1.0' in page
    assert 'llmgw_weights_cache_free_bytes{node="node02"} 5000.0' in page


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_pages_show_cached_weights_and_staging_progress(admin_client):
    node_with_gpus("node01")
    report("node01", free=2 * 10**9)
    model(replicas=1)
    reconcile.replicas_reconcile()
    node_weights_report(node_name="node01", report={
        "free_bytes": 10**9, "budget_bytes": 10**10, "used_bytes": 1500, "downloads": 1,
        "models": [{"model": "m", "revision": "r1", "bytes": 1500, "total": 3000, "complete": False, "rate": 500.0,
                    "error": ""}]})
    replica = Replica.objects.get()
    assert replica.status == ReplicaStatus.STAGING
    node_page = admin_client.get("/nodes/node01/").content.decode()
    assert "Model weights" in node_page and "953.7\xa0MB free of a" in node_page and "fetching" in node_page
    replicas_page = admin_client.get("/replicas/").content.decode()
    assert "weights 50% (0.00 of 0.00 GB, 0.0 MB/s, about 3s left)" in replicas_page
    assert "<dd data-staging>weights 50% (" in admin_client.get(f"/replicas/{replica.pk}/").content.decode()
