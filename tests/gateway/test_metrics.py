"""GET /metrics: the gateway's own figures and the cluster's, in Prometheus text format."""

from __future__ import annotations

import re

import httpx

from replicas.choices import ReplicaStatus


def _samples(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics(gateway_web, make_replica, fake_engine, gw_node):
    from replicas.models import GpuAllocation
    from tests.factories import GpuFactory, NodeFactory

    engine = fake_engine("m", events=3)
    replica = make_replica("m", engine.port)
    make_replica("m", engine.port, status=ReplicaStatus.STOPPED)
    gpus = [GpuFactory(node=gw_node, index=i, uuid=f"GPU-metrics-{i}") for i in range(4)]
    GpuAllocation.objects.create(gpu=gpus[0], member=replica.members.get(), node=gw_node)
    NodeFactory(name="gw-cordoned", status="cordoned")
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
    samples = _samples(text)
    r = replica.pk
    assert samples[f'llmgw_gateway_requests_total{{model="m",replica="{r}",endpoint="chat",code="200"}}'] == 3
    assert samples['llmgw_gateway_requests_total{model="",replica="",endpoint="chat",code="404"}'] == 1
    assert samples['llmgw_gateway_errors_total{model="",kind="model_not_found"}'] == 1
    assert "made-up" not in text  # client-chosen names never become labels
    assert samples[f'llmgw_gateway_request_duration_seconds_count{{model="m",replica="{r}"}}'] == 3
    assert samples[f'llmgw_gateway_request_duration_seconds_bucket{{model="m",replica="{r}",le="+Inf"}}'] == 3
    assert samples[f'llmgw_gateway_time_to_first_token_seconds_count{{model="m",replica="{r}"}}'] == 1
    assert samples['llmgw_replicas{model="m",status="ready"}'] == 1
    assert samples['llmgw_replicas{model="m",status="stopped"}'] == 1
    assert samples['llmgw_replicas{model="m",status="pending"}'] == 0
    assert samples['llmgw_nodes{status="ready"}'] == 1
    assert samples['llmgw_nodes{status="cordoned"}'] == 1
    assert 0 <= samples['llmgw_node_heartbeat_age_seconds{node="gw-node"}'] < 120
    assert samples['llmgw_gpus{node="gw-node",state="allocated"}'] == 1
    assert samples['llmgw_gpus{node="gw-node",state="free"}'] == 3
    assert samples["llmgw_gpus_allocated"] == 1 and samples["llmgw_gpus_free"] == 3
    # Every family is declared once, and every sample belongs to a declared family.
    families = re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)
    assert len(families) == len({name for name, _ in families})
    declared = {name for name, _ in families}
    for name in samples:
        base = re.sub(r"_(bucket|sum|count)$", "", name.split("{")[0])
        assert name.split("{")[0] in declared or base in declared, name
