"""The web UI's pages and actions through Django's test client: what each
page shows, who may act, and that each action goes through the service."""

from __future__ import annotations

import pytest

from core.models import Event
from nodes.models import Node

pytestmark = pytest.mark.django_db

PAGES = ["/", "/cluster/grid/", "/nodes/node01/", "/nodes/node01/live/", "/replicas/", "/replicas/live/",
         "/catalog/", "/events/", "/events/live/", "/gateway/", "/provisioning/", "/provisioning/live/",
         "/models/qwen-7b/"]


@pytest.mark.parametrize("url", PAGES)
def test_every_page_needs_a_login(client, small_cluster, url):
    response = client.get(url)
    assert response.status_code == 302 and response["Location"].startswith("/login/?next="), url


def test_a_partial_polled_after_logout_sends_the_page_to_the_login(client, small_cluster):
    response = client.get("/cluster/grid/", HTTP_HX_REQUEST="true", HTTP_HX_CURRENT_URL="http://testserver/?state=lost")
    assert response["HX-Redirect"] == "/login/?next=/%3Fstate%3Dlost"


@pytest.mark.parametrize("url", PAGES)
def test_a_user_without_view_permissions_is_refused(client, small_cluster, url):
    from django.contrib.auth import get_user_model

    client.force_login(get_user_model().objects.create_user("nobody", "", "x"))
    assert client.get(url).status_code == 403, url


@pytest.mark.parametrize("url", PAGES)
def test_a_viewer_sees_every_page_and_no_action(viewer_client, small_cluster, url):
    response = viewer_client.get(url)
    assert response.status_code == 200, url
    body = response.content.decode()
    assert 'method="post" action="/nodes' not in body and "/scale/" not in body and "Create key" not in body
    assert "Revoke the certificate" not in body


@pytest.mark.parametrize("url,data", [
    ("/nodes/node01/cordon/", {}), ("/nodes/node01/uncordon/", {}), ("/nodes/node01/drain/", {}),
    ("/nodes/node01/drain/cancel/", {}),
    ("/nodes/node01/revoke/", {}), ("/models/qwen-7b/scale/", {"replicas": "5"}),
    ("/catalog/apply/", {"yaml": "models: []"}), ("/gateway/keys/", {"name": "k"}),
    ("/gateway/keys/k/revoke/", {}), ("/provisioning/vm/", {"node": "n"}),
    ("/provisioning/onboard/", {"node": "n", "addr": "127.0.1.9", "step": "read-key"}),
    ("/nodes/node01/reonboard/", {"addr": "127.0.1.1"}),
    ("/provisioning/jobs/1/retry/", {}), ("/provisioning/jobs/1/cancel/", {}),
])
def test_a_viewer_cannot_act(viewer_client, small_cluster, url, data):
    before = Event.objects.count()
    assert viewer_client.post(url, data).status_code == 403, url
    assert Node.objects.get(name="node01").status == "ready"
    assert Event.objects.count() == before


def test_cluster_page_shows_fabrics_nodes_and_gpus_by_replica(admin_client_ui, small_cluster):
    from replicas.models import Replica

    body = admin_client_ui.get("/").content.decode()
    for fabric in ("ib-a", "ib-b", "no fabric"):
        assert f'data-fabric="{fabric}"' in body
    for node in ("node01", "node02", "node03", "node04", "island01"):
        assert f'data-node="{node}"' in body
    wide = Replica.objects.get(model__name="llama-70b")
    assert body.count(f'title="llama-70b #{wide.pk}, GPU') == 8
    assert f"llama-70b #{wide.pk}</span>" in body  # in the legend
    assert "<meta http-equiv" not in body


def test_cluster_filters_and_collapse(admin_client_ui, small_cluster):
    body = admin_client_ui.get("/cluster/grid/", {"fabric": "ib-b"}).content.decode()
    assert 'data-node="node03"' in body and 'data-node="node01"' not in body
    body = admin_client_ui.get("/cluster/grid/", {"name": "ISLAND"}).content.decode()
    assert 'data-node="island01"' in body and 'data-node="node01"' not in body
    Node.objects.filter(name="node02").update(status="lost")
    body = admin_client_ui.get("/cluster/grid/", {"state": "lost"}).content.decode()
    assert 'class="node lost" data-node="node02"' in body and 'data-node="node01"' not in body
    body = admin_client_ui.get("/cluster/grid/", {"collapse": "ib-a"}).content.decode()
    assert 'data-node="node01"' not in body and 'data-node="node03"' in body
    assert admin_client_ui.get("/cluster/grid/", {"state": "<script>"}).status_code == 200


def test_node_page_shows_inventory_engines_and_certificate(admin_client_ui, small_cluster):
    body = admin_client_ui.get("/nodes/node01/").content.decode()
    assert "NVIDIA H200" in body and "mlx5_0" in body and "InfiniBand" in body and "ib-a" in body
    assert "llama-70b" in body  # its GPUs are held, its engine listed
    assert "Revoke the certificate of node01" in body and "turns" in body
    assert admin_client_ui.get("/nodes/nope/").status_code == 404


def test_cordon_and_uncordon_from_the_node_page(admin_client_ui, small_cluster):
    response = admin_client_ui.post("/nodes/node01/cordon/", HTTP_REFERER="http://testserver/nodes/node01/")
    assert response.status_code == 302 and response["Location"] == "http://testserver/nodes/node01/"
    assert Node.objects.get(name="node01").status == "cordoned"
    event = Event.objects.filter(subject="node/node01", kind="node.status").first()
    assert "cordoned by user root" in event.message
    body = admin_client_ui.get("/nodes/node01/").content.decode()
    assert "is cordoned" in body and "Uncordon" in body
    admin_client_ui.post("/nodes/node01/uncordon/")
    assert Node.objects.get(name="node01").status == "ready"


def test_a_refused_action_says_why_and_changes_nothing(admin_client_ui, small_cluster):
    Node.objects.filter(name="node02").update(status="lost")
    response = admin_client_ui.post("/nodes/node02/drain/", follow=True)
    assert response.status_code == 200
    assert "only a ready or cordoned node can be drained" in response.content.decode()
    assert Node.objects.get(name="node02").status == "lost"
    assert admin_client_ui.post("/nodes/ghost/cordon/", follow=True).status_code == 200
    assert admin_client_ui.post("/nodes/node01/cordon/", HTTP_REFERER="https://elsewhere.example/")["Location"] == "/"


def test_drain_from_the_node_page_shows_its_progress(admin_client_ui, small_cluster):
    admin_client_ui.post("/nodes/node01/drain/")
    assert Node.objects.get(name="node01").status == "draining"
    assert Event.objects.filter(message__contains="drain requested by user root").exists()
    body = admin_client_ui.get("/nodes/node01/live/").content.decode()
    assert 'id="drain"' in body and "2 replica(s) to move" in body and "0 moved, 2 remaining" in body and "Still on this node" in body


def test_a_drain_shows_each_replicas_outcome_and_can_be_cancelled(admin_client_ui, small_cluster):
    from replicas import drain
    from replicas.models import Drain

    admin_client_ui.post("/nodes/node01/drain/")
    drain.drain_step(drain_id=Drain.objects.get(node__name="node01").pk)
    recorded = Drain.objects.get(node__name="node01").replicas
    assert recorded, "the step records each replica's outcome"
    body = admin_client_ui.get("/nodes/node01/live/").content.decode()
    assert 'id="drain-outcomes"' in body and "Cancel the drain" in body
    for replica_id, entry in recorded.items():
        assert f'data-replica="{replica_id}"' in body and f'badge st-{entry["outcome"]}">{entry["outcome"]}<' in body
    response = admin_client_ui.post("/nodes/node01/drain/cancel/", follow=True)
    body = response.content.decode()
    assert "Drain of node01 cancelled: 0 replica(s) moved" in body and "node01 stays cordoned" in body
    assert Node.objects.get(name="node01").status == "cordoned"
    assert Event.objects.filter(message__contains="ended (cancelled by user root)").exists()
    body = admin_client_ui.get("/nodes/node01/live/").content.decode()
    assert "Cancel the drain" not in body and ">cancelled</span>" in body and ">released</span>" in body
    again = admin_client_ui.post("/nodes/node01/drain/cancel/", follow=True).content.decode()
    assert "node01 has no drain under way" in again


def test_revoke_certificate_from_the_node_page(admin_client_ui, small_cluster, pki_dir):
    from pki.models import Certificate
    from pki.services import cert_issue_client

    cert_issue_client(node_id="node01")
    response = admin_client_ui.post("/nodes/node01/revoke/", {"reason": "stolen"}, follow=True)
    assert "Revoked 1 certificate(s) of node01" in response.content.decode()
    assert Certificate.objects.get(common_name="node01").revoked_at is not None
    assert Event.objects.filter(message__contains="revoked by user root: stolen", node__name="node01").exists()
    again = admin_client_ui.post("/nodes/node01/revoke/", follow=True).content.decode()
    assert "already revoked" in again


def test_scale_a_model(admin_client_ui, small_cluster):
    from replicas.models import CatalogEntry

    admin_client_ui.post("/models/qwen-7b/scale/", {"replicas": "3"})
    assert CatalogEntry.objects.get(name="qwen-7b").replicas == 3
    assert Event.objects.filter(message="qwen-7b scaled from 2 to 3 by user root").exists()
    body = admin_client_ui.post("/models/qwen-7b/scale/", {"replicas": "-1"}, follow=True).content.decode()
    assert "must be between 0 and 10000, got -1" in body
    body = admin_client_ui.post("/models/qwen-7b/scale/", {"replicas": "10001"}, follow=True).content.decode()
    assert "must be between 0 and 10000, got 10001" in body
    body = admin_client_ui.post("/models/qwen-7b/scale/", {"replicas": "many"}, follow=True).content.decode()
    assert "whole number" in body
    assert CatalogEntry.objects.get(name="qwen-7b").replicas == 3


def test_replicas_page_and_a_replica_with_its_launch_command(admin_client_ui, small_cluster):
    from replicas.models import Replica

    body = admin_client_ui.get("/replicas/").content.decode()
    assert "llama-70b" in body and "2 x 4 GPUs" in body
    wide = Replica.objects.get(model__name="llama-70b")
    body = admin_client_ui.get(f"/replicas/{wide.pk}/").content.decode()
    assert "Rank 0 (leader)" in body and "Rank 1" in body and "Launch command" in body
    assert "pending -&gt; scheduled" in body  # the state history


CATALOG = """models:
  - name: qwen-7b
    engine: sim
    model: /models/7b
    replicas: 4
  - name: mistral
    engine: sim
    model: /models/m
"""


def test_catalog_preview_then_apply(admin_client_ui, small_cluster):
    from replicas.models import CatalogEntry

    body = admin_client_ui.post("/catalog/", {"yaml": CATALOG, "prune": "on"}).content.decode()
    assert "mistral (1 replicas)" in body and "qwen-7b: 2 → 4" in body and "llama-70b" in body
    assert not CatalogEntry.objects.filter(name="mistral").exists()  # a preview applies nothing
    response = admin_client_ui.post("/catalog/apply/", {"yaml": CATALOG}, follow=True)
    assert "Catalog applied: 1 created, 1 updated" in response.content.decode()
    assert CatalogEntry.objects.get(name="qwen-7b").replicas == 4
    assert Event.objects.filter(message="catalog: mistral created by user root").exists()


def test_a_bad_catalog_names_the_field(admin_client_ui, small_cluster):
    from django.core.files.uploadedfile import SimpleUploadedFile

    bad = "models:\n  - name: broken\n    engine: nope\n    model: /m\n    nodes: 0\n"
    response = admin_client_ui.post("/catalog/", {"file": SimpleUploadedFile("c.yaml", bad.encode())})
    assert response.status_code == 400
    body = response.content.decode()
    assert '<td class="mono field">engine</td>' in body and '<td class="mono field">nodes</td>' in body
    assert admin_client_ui.post("/catalog/", {"yaml": "models: [\n"}).status_code == 400
    assert admin_client_ui.post("/catalog/apply/", {"yaml": bad}).status_code == 400


def test_api_key_shown_once_then_revoked(admin_client_ui, small_cluster):
    from gateway.models import ApiKey

    response = admin_client_ui.post("/gateway/keys/", {"name": "team-a", "models": "qwen-7b"})
    assert response.status_code == 201
    body = response.content.decode()
    key = body.split('id="new-key-value">')[1].split("<")[0]
    assert key.startswith(ApiKey.objects.get(name="team-a").prefix)
    assert key not in admin_client_ui.get("/gateway/").content.decode()
    duplicate = admin_client_ui.post("/gateway/keys/", {"name": "team-a"})
    assert duplicate.status_code == 400 and "exists already" in duplicate.content.decode()
    assert admin_client_ui.post("/gateway/keys/", {"name": "x", "models": "nope"}).status_code == 400
    admin_client_ui.post("/gateway/keys/team-a/revoke/")
    assert ApiKey.objects.get(name="team-a").revoked_at is not None
    assert Event.objects.filter(subject="apikey/team-a", message__contains="revoked by user root").exists()


def test_events_filters(admin_client_ui, small_cluster):
    from replicas.models import Replica

    wide = Replica.objects.get(model__name="llama-70b")
    body = admin_client_ui.get("/events/", {"replica": wide.pk}).content.decode()
    assert f"replica/{wide.pk}" in body and "model/qwen-7b" not in body
    body = admin_client_ui.get("/events/", {"kind": "model"}).content.decode()
    assert "model/qwen-7b" in body and f"replica/{wide.pk}" not in body
    assert admin_client_ui.get("/events/", {"kind": "bogus", "severity": "x", "replica": "y"}).status_code == 200


def test_provisioning_new_vm_form_names_bad_fields(admin_client_ui, small_cluster):
    from provisioning.models import Hypervisor

    Hypervisor.objects.create(name="pve1", url="https://127.0.0.1:8006", token_id="u@pve!t",
                              token_secret_encrypted="x", image="local:import/noble.qcow2")
    body = admin_client_ui.get("/provisioning/").content.decode()
    assert "pve1" in body and "New VM" in body
    response = admin_client_ui.post("/provisioning/vm/", {"node": "node09", "vmid": "abc", "ip": "", "gateway": ""})
    assert response.status_code == 400
    body = response.content.decode()
    assert "<strong>vmid</strong>: give a whole number" in body and "<strong>ip</strong>: required" in body


def test_missing_gpus_and_claims_in_conflict_are_marked(admin_client_ui, small_cluster):
    from django.utils import timezone

    from nodes.models import Gpu, GpuConflict

    Gpu.objects.filter(node__name="node02", index=3).update(missing_since=timezone.now())
    claimed = Gpu.objects.get(node__name="node01", index=5)
    GpuConflict.objects.create(claimant=Node.objects.get(name="node03"), gpu=claimed)
    body = admin_client_ui.get("/cluster/grid/").content.decode()
    card = body.split('data-node="node02"')[1].split("</article>")[0]
    assert "⚠ GPU 3 missing since" in card and card.count(" missing\" title=") == 1
    assert "; missing since" in card and "llama-70b #" in card.split(" missing\"")[1]  # still held, and says so
    holder = body.split('data-node="node01"')[1].split("</article>")[0]
    assert "⚠ GPU 5 also claimed by node03" in holder and 'conflict" title="GPU 5: free; also claimed by node03"' in holder
    claimant = body.split('data-node="node03"')[1].split("</article>")[0]
    assert "⚠ claims GPU 5 of node01, which holds it" in claimant
    assert "missing GPU</span>" in body and "GPU claimed by two nodes</span>" in body  # in the legend
    page = admin_client_ui.get("/nodes/node01/").content.decode()
    assert 'id="gpu-conflicts"' in page and claimed.uuid in page and "also claimed by node03" in page
    assert 'id="gpu-conflicts"' in admin_client_ui.get("/nodes/node03/").content.decode()
    assert "missing since" in admin_client_ui.get("/nodes/node02/").content.decode()
    assert 'id="gpu-conflicts"' not in admin_client_ui.get("/nodes/node04/").content.decode()


def test_a_replica_page_shows_its_engine_reading_or_unknown(admin_client_ui, small_cluster, settings):
    import json
    import time

    from gateway import engineload
    from gateway.inflight import store
    from replicas.models import Replica

    replica = Replica.objects.get(model__name="llama-70b")
    client = store().client
    client.delete(engineload.REDIS_KEY)
    body = admin_client_ui.get(f"/replicas/{replica.pk}/").content.decode()
    assert body.count(">unknown<") == 3  # queue, KV use, hit rate: never read
    reading = {"running": 3, "waiting": 5, "kv_use": 0.425, "prefix_queries": 1000.0, "prefix_hits": 250.0,
               "cache_tokens": 400000, "at": time.time(), "error": ""}
    client.hset(engineload.REDIS_KEY, str(replica.pk), json.dumps(reading))
    try:
        body = admin_client_ui.get(f"/replicas/{replica.pk}/").content.decode()
    finally:
        client.delete(engineload.REDIS_KEY)
    assert "5 waiting, 3 running" in body and "42.5 %" in body and "25.0 % of prompt tokens" in body
