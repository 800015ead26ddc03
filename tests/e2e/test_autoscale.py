"""Autoscaling end to end: real sim engines, agents, worker and beat, and the
gateway's web processes. Load up -> more replicas; load gone -> fewer with no
failed request; a model at zero brought back by a request that then
succeeds, with the held-request bound giving 429 and Retry-After; two
gateway processes whose load is summed."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from cli.wait import wait_until
from core.models import Event
from gateway.load_report import deployment_load, store
from replicas.catalog import catalog_apply
from replicas.choices import ReplicaStatus
from replicas.models import CatalogEntry, Replica
from tests.e2e.sim import fast_env
from tests.e2e.test_drain_traffic import Traffic

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MODEL = "auto"
FAST = {"LLMGW_AUTOSCALE_INTERVAL": "0.5"}


def _ready() -> int:
    return Replica.objects.filter(model__name=MODEL, status=ReplicaStatus.READY).count()


def _wanted() -> int:
    return CatalogEntry.objects.get(name=MODEL).replicas


def _start(sim_cluster, web_factory, policy: dict, replicas: int = 1, token_delay: str = "0.05", webs: int = 1,
           env: dict | None = None):
    cluster = sim_cluster(**FAST)
    servers = [web_factory(LLMGW_GATEWAY_OPEN="1", **fast_env(), **FAST) for _ in range(webs)]
    catalog_apply(entries=[{"name": MODEL, "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 1,
                            "replicas": replicas, "args": ["--token-delay", token_delay], "autoscale": policy,
                            "env": env or {}}])
    if replicas:
        wait_until(lambda: _ready() >= replicas, timeout=60, message="the first replicas ready")
        for web in servers:
            wait_until(lambda: httpx.get(f"{web.url}/v1/models", timeout=5).json()["data"], timeout=10,
                       message="the gateway to route the model")
    return cluster, servers


def test_load_up_more_replicas_load_gone_fewer_with_no_failed_request(sim_cluster, web_factory):
    policy = {"min": 1, "max": 3, "target": 2, "up_after": 1, "down_after": 4, "cooldown": 2, "max_step": 2}
    _, (web,) = _start(sim_cluster, web_factory, policy)
    with Traffic(web.url, threads=1, model=MODEL, limit=240) as calm:
        with Traffic(web.url, threads=6, model=MODEL, limit=120) as busy:
            wait_until(lambda: _ready() == 3, timeout=60, message="three ready replicas under load")
            busy.wait_served(10, after=time.monotonic(), what="with three replicas")
        went_at = time.monotonic()
        wait_until(lambda: _wanted() == 1, timeout=60, message="the autoscaler to scale down")
        wait_until(lambda: _ready() == 1 and not Replica.objects.filter(status=ReplicaStatus.STOPPING).exists(),
                   timeout=60, message="the extra replicas to stop")
        calm.wait_served(5, after=time.monotonic(), what="after the scale-down")
    assert busy.failures() == [] and calm.failures() == []
    assert calm.served(went_at) > 5
    ups = Event.objects.filter(kind="autoscale", data__rule="up")
    downs = Event.objects.filter(kind="autoscale", data__rule="down")
    assert ups.exists() and downs.exists()
    assert "target 2 per replica" in ups.first().message


def _ask(url: str, results: list, index: int, stream: bool) -> None:
    body = {"model": MODEL, "stream": stream, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    started = time.monotonic()
    with httpx.Client(timeout=90) as client:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            text = "".join(response.iter_text())
    results.append((index, response.status_code, dict(response.headers), text, time.monotonic() - started,
                    time.monotonic()))


def test_scaled_to_zero_then_brought_back_by_requests_past_the_bound_get_429(sim_cluster, web_factory):
    policy = {"min": 0, "max": 2, "target": 4, "up_after": 1, "down_after": 2, "cooldown": 0, "zero_after": 10,
              "hold_max": 2, "hold_wait": 60}
    # The engine takes 3 s to start (as a real one loads its weights): the held requests wait for it.
    _, (web,) = _start(sim_cluster, web_factory, policy, env={"LLMGW_SIM_COLD_START": "3"})
    wait_until(lambda: _wanted() == 0 and _ready() == 0, timeout=60, message="the model to go to zero when idle")
    assert Event.objects.filter(kind="autoscale", data__rule="zero").exists()
    # Its last replica gone from the gateway's routing table and stopped.
    wait_until(lambda: not httpx.get(f"{web.url}/v1/models", timeout=5).json()["data"], timeout=10,
               message="the gateway to stop routing the model")
    wait_until(lambda: not Replica.objects.filter(model__name=MODEL).exclude(status=ReplicaStatus.STOPPED).exists(),
               timeout=30, message="the last replica stopped")
    results: list = []
    threads = []
    for index, stream in enumerate((True, False, True)):
        thread = threading.Thread(target=_ask, args=(web.url, results, index, stream))
        thread.start()
        threads.append(thread)
        time.sleep(0.2)
    for thread in threads:
        thread.join(timeout=120)
    by_index = {r[0]: r for r in results}
    # The first two are held and served (the streamed one whole); the third is past the bound.
    assert by_index[0][1] == 200 and "[DONE]" in by_index[0][3], by_index[0]
    assert by_index[1][1] == 200, by_index[1]
    assert by_index[0][4] >= 3.0, "served before the engine's cold start was over"
    # In arrival order: the first held request was answered no later than the second.
    assert by_index[0][5] <= by_index[1][5] + 0.5
    refused = by_index[2]
    assert refused[1] == 429 and int(refused[2]["retry-after"]) >= 1
    assert '"code": "model_starting"' in refused[3] and "is starting" in refused[3]
    assert Event.objects.filter(kind="autoscale", data__rule="wake").exists()


def test_two_gateway_processes_load_summed(sim_cluster, web_factory):
    policy = {"min": 1, "max": 1, "target": 100}
    _, webs = _start(sim_cluster, web_factory, policy, token_delay="0.2", webs=2)
    with Traffic(webs[0].url, threads=3, model=MODEL, limit=60), Traffic(webs[1].url, threads=2, model=MODEL,
                                                                           limit=60):
        wait_until(lambda: deployment_load().get(MODEL, (0, 0, None))[0] == 5, timeout=20,
                   message="5 requests in flight summed over the two gateway processes")
        # Each process's own record holds only its part.
        busy = [r for r in store().records().values() if r["models"].get(MODEL, [0])[0] > 0]
        assert len(busy) == 2


def test_the_engines_queue_as_the_signal(sim_cluster, web_factory):
    # One request at a time per engine: the rest wait in its queue, which its /metrics shows.
    policy = {"min": 1, "max": 2, "metric": "engine_queue", "target": 1, "up_after": 1, "cooldown": 0}
    cluster = sim_cluster(**FAST)
    web = web_factory(LLMGW_GATEWAY_OPEN="1", **fast_env(), **FAST)
    catalog_apply(entries=[{"name": MODEL, "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 1,
                            "replicas": 1, "args": ["--token-delay", "0.05", "--max-num-seqs", "1"],
                            "autoscale": policy}])
    wait_until(lambda: _ready() == 1, timeout=60, message="the first replica ready")
    wait_until(lambda: httpx.get(f"{web.url}/v1/models", timeout=5).json()["data"], timeout=10,
               message="the gateway to route the model")
    with Traffic(web.url, threads=4, model=MODEL, limit=60) as traffic:
        wait_until(lambda: Event.objects.filter(kind="autoscale", data__rule="up").exists(), timeout=30,
                   message="a scale-up on the engines' queue")
    up = Event.objects.get(kind="autoscale", data__rule="up")
    # Waiting in the engines' queues or, with every engine at its batch limit, in the gateway's.
    assert (up.data["engine_waiting"] or 0) + up.data["held"] >= 2 and up.data["metric"] == "engine_queue"
    assert "waiting in the engines' queues" in up.message
    assert traffic.failures() == []
    assert cluster is not None
