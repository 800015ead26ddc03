"""A model's page: policy, signals, the SVG chart of replicas against load,
and the policy's form (through the catalog's service)."""

from __future__ import annotations

import time

import pytest

from core.models import Event
from replicas.autoscaling import history
from replicas.models import CatalogEntry

pytestmark = pytest.mark.django_db


@pytest.fixture
def samples():
    store = history.store()
    key = history.KEY.format("qwen-7b")
    store.client.delete(key)
    now = time.time()
    for i in range(30):
        store.append("qwen-7b", {"at": now - 600 + i * 20, "load": 4.0 * (1 + i // 10), "recommended": 1 + i // 10,
                                 "busy": 4, "wanted": 1 + i // 10, "ready": 1 + (i - 1) // 10 if i else 1,
                                 "inflight": 7, "held": 2, "engine_waiting": None, "kv_usage": None,
                                 "rule": "steady", "to": None})
    yield
    store.client.delete(key)


def test_policy_form_sets_it_and_the_page_shows_policy_signals_and_chart(admin_client_ui, small_cluster, samples):
    response = admin_client_ui.post("/models/qwen-7b/autoscale/", {
        "min": "1", "max": "5", "metric": "requests", "target": "4", "up_after": "6", "down_after": "60",
        "cooldown": "20", "max_step": "2", "zero_after": "300", "hold_max": "50", "hold_wait": "30"},
        HTTP_REFERER="/models/qwen-7b/")
    assert response.status_code == 302
    model = CatalogEntry.objects.get(name="qwen-7b")
    assert model.autoscale["max"] == 5 and model.autoscale["hold_max"] == 50
    page = admin_client_ui.get("/models/qwen-7b/").content.decode()
    assert "autoscaled: 1-5 replicas, target 4 requests in flight or held" in page
    assert "7 in flight, 2 held (all gateway processes)" in page
    assert "<svg" in page and 'class="wanted"' in page and 'class="ready"' in page and 'class="load"' in page
    assert Event.objects.filter(subject="model/qwen-7b", message__contains="autoscales 1-5").exists()


def test_a_bad_policy_changes_nothing_and_says_why(admin_client_ui, small_cluster):
    response = admin_client_ui.post("/models/qwen-7b/autoscale/", {"min": "4", "max": "2"}, follow=True,
                                    HTTP_REFERER="/models/qwen-7b/")
    assert "min (4) is above max (2)" in response.content.decode()
    assert CatalogEntry.objects.get(name="qwen-7b").autoscale is None


def test_scaling_an_autoscaled_model_by_hand_says_why_not(admin_client_ui, small_cluster):
    admin_client_ui.post("/models/qwen-7b/autoscale/", {"min": "1", "max": "3"}, HTTP_REFERER="/models/qwen-7b/")
    response = admin_client_ui.post("/models/qwen-7b/scale/", {"replicas": "3"}, follow=True,
                                    HTTP_REFERER="/replicas/")
    assert "its replica count follows the load" in response.content.decode()
    removed = admin_client_ui.post("/models/qwen-7b/autoscale/", {"remove": "1"}, HTTP_REFERER="/models/qwen-7b/")
    assert removed.status_code == 302 and CatalogEntry.objects.get(name="qwen-7b").autoscale is None
