"""GET /metrics: the gateway's own figures and the cluster's, in Prometheus text format."""

from __future__ import annotations

import re

import httpx

from replicas.choices import ReplicaStatus

from .conftest import metric_samples, sample, wait_until




def test_metrics(gateway_web, make_replica, fake_engine, gw_node):
    from replicas.models import GpuAllocation
    from tests.factories import GpuFactory, NodeFactory

    engine = fake_engine("m", events=3)
    replica = make_replica("m", engine.port)
    make_replica("m", engine.port, status=ReplicaStatus.STOPPED)
    gpus = [GpuFactory(node=gw_node, index=i, uuid=f"GPU-metrics-{i}") for i in range(4)]
    GpuAllocation.objects.create(gpu=gpus[0], member=replica.members.get(), node=gw_node)
    NodeFactory(name="gw-cordoned", status="cordoned")
    lost = NodeFactory(name="gw-lost", status="lost")
    for i in range(2):
        GpuFactory(node=lost, index=i, uuid=f"GPU-metrics-lost-{i}")
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=web.url, timeout=10) as client:
        for _ in range(2):
            assert client.post("/v1/chat/completions", json=chat).status_code == 200
        assert b"[DONE]" in client.post("/v1/chat/completions", json={**chat, "stream": True}).content
        assert client.post("/v1/chat/completions", json={**chat, "model": "made-up"}).status_code == 404
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    samples = metric_samples(text)
    r = str(replica.pk)
    assert sample(samples, "llmgw_gateway_requests_total", model="m", replica=r, endpoint="chat", code="200") == 3
    assert sample(samples, "llmgw_gateway_requests_total", model="", replica="", endpoint="chat", code="404") == 1
    assert sample(samples, "llmgw_gateway_errors_total", model="", kind="model_not_found") == 1
    assert "made-up" not in text  # client-chosen names never become labels
    assert sample(samples, "llmgw_gateway_request_duration_seconds_count", model="m", replica=r) == 3
    assert sample(samples, "llmgw_gateway_request_duration_seconds_bucket", model="m", replica=r, le="+Inf") == 3
    assert sample(samples, "llmgw_gateway_time_to_first_token_seconds_count", model="m", replica=r) == 1
    assert sample(samples, "llmgw_gateway_inflight_requests", model="m", replica=r) == 0
    assert sample(samples, "llmgw_replicas", model="m", status="ready") == 1
    assert sample(samples, "llmgw_replicas", model="m", status="stopped") == 1
    assert sample(samples, "llmgw_replicas", model="m", status="pending") == 0
    assert sample(samples, "llmgw_nodes", status="ready") == 1
    assert sample(samples, "llmgw_nodes", status="cordoned") == 1
    assert 0 <= sample(samples, "llmgw_node_heartbeat_age_seconds", node="gw-node") < 120
    assert sample(samples, "llmgw_gpus", node="gw-node", state="allocated") == 1
    assert sample(samples, "llmgw_gpus", node="gw-node", state="free") == 3
    assert sample(samples, "llmgw_gpus_allocated") == 1 and sample(samples, "llmgw_gpus_free") == 3
    # A lost node's GPUs are not free: nothing can be placed on them.
    assert sample(samples, "llmgw_gpus", node="gw-lost", state="free") == 0
    assert sample(samples, "llmgw_gpus", node="gw-lost", state="unavailable") == 2
    # Every family is declared once, and every sample belongs to a declared family.
    families = re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)
    assert len(families) == len({name for name, _ in families})
    declared = {name for name, _ in families}
    for name, _ in samples:
        assert name in declared or re.sub(r"_(bucket|sum|count)$", "", name) in declared, name


def test_one_scrape_sees_the_requests_of_every_web_process(gateway_web, make_replica, fake_engine):
    """Two web processes on one data directory, as uvicorn --workers runs them."""
    engine = fake_engine("m")
    replica = make_replica("m", engine.port)
    webs = [gateway_web(LLMGW_GATEWAY_OPEN="1") for _ in range(2)]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for web, count in zip(webs, (2, 3)):
        with httpx.Client(base_url=web.url, timeout=10) as client:
            for _ in range(count):
                assert client.post("/v1/chat/completions", json=chat).status_code == 200
            assert client.post("/v1/chat/completions", json={**chat, "model": "made-up"}).status_code == 404
    r = str(replica.pk)
    for web in webs:
        samples = metric_samples(httpx.get(f"{web.url}/metrics", timeout=10).text)
        assert sample(samples, "llmgw_gateway_requests_total", model="m", replica=r, endpoint="chat", code="200") == 5
        assert sample(samples, "llmgw_gateway_errors_total", model="", kind="model_not_found") == 2
        assert sample(samples, "llmgw_gateway_request_duration_seconds_count", model="m", replica=r) == 5
        assert sample(samples, "llmgw_replicas", model="m", status="ready") == 1  # the cluster's, once


def test_a_killed_web_process_leaves_the_in_flight_sum(gateway_web, make_replica, fake_engine):
    engine = fake_engine("m", events=200, event_delay=0.05)  # ten seconds of tokens
    replica = make_replica("m", engine.port)
    first, second = gateway_web(LLMGW_GATEWAY_OPEN="1"), gateway_web(LLMGW_GATEWAY_OPEN="1")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    r = str(replica.pk)

    def inflight() -> float:
        samples = metric_samples(httpx.get(f"{second.url}/metrics", timeout=10).text)
        # The series goes with the last process that had it.
        return samples.get(("llmgw_gateway_inflight_requests", frozenset({"model": "m", "replica": r}.items())), 0)

    with httpx.Client(base_url=first.url, timeout=10) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            chunks = response.iter_raw()
            next(chunks)  # held, not dropped: the request stays in flight
            assert inflight() == 1  # seen from the other process
            first.proc.kill()  # no chance to count the request out
            first.proc.wait()
    wait_until(lambda: inflight() == 0, timeout=10, message="the stopped process's request leaving the sum")
