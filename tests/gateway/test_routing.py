"""Requests through the real web process to real engines: routing,
balancing, retries, and the routing table following the database."""

from __future__ import annotations

import collections

import httpx

from replicas.choices import ReplicaStatus

from .conftest import metric_samples, sample, wait_until


def _chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], **extra}


def test_chat_and_completion_reach_the_sim_engine(gateway_web, make_replica, sim_engine, api_key):
    port = sim_engine("sim-small")
    replica = make_replica("sim-small", port)
    key = api_key()
    web = gateway_web()
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=web.url, headers=headers, timeout=10) as client:
        chat = client.post("/v1/chat/completions", json=_chat("sim-small"))
        assert chat.status_code == 200, chat.text
        assert chat.headers["x-llmgw-replica"] == str(replica.pk)
        assert "sim-small answering" in chat.json()["choices"][0]["message"]["content"]
        completion = client.post("/v1/completions", json={"model": "sim-small", "prompt": "once upon", "max_tokens": 3})
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["finish_reason"] == "length"
        listing = client.get("/v1/models").json()
        assert [m["id"] for m in listing["data"]] == ["sim-small"]
        assert client.get("/v1/models/sim-small").json()["id"] == "sim-small"


def _replicas_used(client: httpx.Client, model: str, n: int) -> collections.Counter:
    used = collections.Counter()
    for _ in range(n):
        response = client.post("/v1/chat/completions", json=_chat(model))
        assert response.status_code == 200, response.text
        used[response.headers["x-llmgw-replica"]] += 1
    return used


def test_balancing_uses_every_ready_replica_and_prefers_the_least_busy(gateway_web, make_replica, fake_engine):
    a, b = fake_engine("m"), fake_engine("m")
    ra, rb = make_replica("m", a.port), make_replica("m", b.port)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    with httpx.Client(base_url=web.url, timeout=10) as client:
        idle = _replicas_used(client, "m", 20)
        assert set(idle) == {str(ra.pk), str(rb.pk)}, idle
        # Hold one stream open (holding applies to streams only): its replica
        # has one request outstanding, the other none.
        a.mode = b.mode = "hold"
        with client.stream("POST", "/v1/chat/completions", json=_chat("m", stream=True)) as held:
            busy = held.headers["x-llmgw-replica"]
            other = str(rb.pk) if busy == str(ra.pk) else str(ra.pk)
            chunks = held.iter_raw()  # one iterator: dropping it closes the stream
            next(chunks)
            assert _replicas_used(client, "m", 6) == {other: 6}
            a.release.set()
            b.release.set()
            assert b"[DONE]" in b"".join(chunks)


def test_only_ready_replicas_get_requests(gateway_web, make_replica, fake_engine):
    ready, starting, stopping = fake_engine("m"), fake_engine("m"), fake_engine("m")
    ready_replica = make_replica("m", ready.port)
    make_replica("m", starting.port, status=ReplicaStatus.STARTING)
    make_replica("m", stopping.port, status=ReplicaStatus.STOPPING)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    with httpx.Client(base_url=web.url, timeout=10) as client:
        assert _replicas_used(client, "m", 10) == {str(ready_replica.pk): 10}
    assert not starting.requests and not stopping.requests


def test_routing_table_follows_replica_changes(gateway_web, make_replica, fake_engine):
    from replicas.services import replica_transition

    first, second = fake_engine("m"), fake_engine("m")
    old = make_replica("m", first.port)
    new = make_replica("m", second.port, status=ReplicaStatus.STARTING)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1", LLMGW_GATEWAY_SYNC_INTERVAL="0.2")  # the default
    with httpx.Client(base_url=web.url, timeout=10) as client:
        assert _replicas_used(client, "m", 3) == {str(old.pk): 3}
        replica_transition(replica_id=new.pk, to=ReplicaStatus.READY)
        wait_until(lambda: str(new.pk) in _replicas_used(client, "m", 4), timeout=10,
                   message="the new replica getting requests")
        replica_transition(replica_id=old.pk, to=ReplicaStatus.STOPPING)
        # Twenty in a row: with both replicas routed, chance alone would give
        # four in a row to one of them one time in sixteen.
        wait_until(lambda: _replicas_used(client, "m", 20) == {str(new.pk): 20}, timeout=10,
                   message="the stopping replica getting no requests")
        # And once it has seen the change, never again.
        assert _replicas_used(client, "m", 10) == {str(new.pk): 10}
        replica_transition(replica_id=new.pk, to=ReplicaStatus.STOPPING)
        wait_until(lambda: client.post("/v1/chat/completions", json=_chat("m")).status_code == 503, timeout=10,
                   message="503 once no replica is ready")
        assert client.get("/v1/models").json()["data"] == []


def test_connect_failure_is_retried_on_another_replica(gateway_web, make_replica, fake_engine):
    from tests.conftest import free_port

    alive = fake_engine("m")
    dead = make_replica("m", free_port())  # nothing listens there
    live = make_replica("m", alive.port)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    with httpx.Client(base_url=web.url, timeout=10) as client:
        assert _replicas_used(client, "m", 12) == {str(live.pk): 12}
        samples = metric_samples(client.get("/metrics").text)
    assert sample(samples, "llmgw_gateway_retries_total", model="m") >= 1
    answered_by = {dict(labels)["replica"] for name, labels in samples
                   if name == "llmgw_gateway_requests_total" and dict(labels)["code"] == "200"}
    assert answered_by == {str(live.pk)}


def test_no_reachable_replica_is_a_502_in_openai_shape(gateway_web, make_replica):
    from tests.conftest import free_port

    make_replica("m", free_port())
    make_replica("m", free_port())
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    response = httpx.post(f"{web.url}/v1/chat/completions", json=_chat("m"), timeout=10)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_unreachable"


def test_replica_inflight_is_summed_across_processes_and_ends_at_zero(gateway_web, make_replica, fake_engine):
    from gateway.selectors import replica_inflight
    from replicas.services import replica_transition

    engine = fake_engine("m")
    engine.mode = "hold"
    replica = make_replica("m", engine.port)
    webs = [gateway_web(LLMGW_GATEWAY_OPEN="1"), gateway_web(LLMGW_GATEWAY_OPEN="1")]
    clients = [httpx.Client(base_url=w.url, timeout=10) for w in webs]
    try:
        streams = [c.stream("POST", "/v1/chat/completions", json=_chat("m", stream=True)) for c in clients]
        responses = [s.__enter__() for s in streams]
        readers = [response.iter_raw() for response in responses]
        for reader in readers:
            next(reader)
        # Two requests in flight, and two processes that still route to the replica.
        wait_until(lambda: replica_inflight(replica.pk) == 4, timeout=2, message="in-flight 4")
        replica_transition(replica_id=replica.pk, to=ReplicaStatus.STOPPING)
        wait_until(lambda: replica_inflight(replica.pk) == 2, timeout=2, message="in-flight 2 once unrouted")
        engine.release.set()
        for stream in streams:
            stream.__exit__(None, None, None)
        wait_until(lambda: replica_inflight(replica.pk) == 0, timeout=2, message="in-flight 0")
    finally:
        for client in clients:
            client.close()


def test_replica_inflight_on_the_embedded_default_uses_the_database(gateway_web, make_replica, fake_engine, settings):
    from gateway import inflight
    from gateway.models import GatewayProcess
    from gateway.selectors import replica_inflight

    engine = fake_engine("m")
    engine.mode = "hold"
    replica = make_replica("m", engine.port)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1", LLMGW_REDIS_URL="", CELERY_BROKER_URL="filesystem://")
    settings.LLMGW_REDIS_URL = ""
    inflight.store.cache_clear()
    try:
        with httpx.Client(base_url=web.url, timeout=10) as client:
            with client.stream("POST", "/v1/chat/completions", json=_chat("m", stream=True)) as response:
                reader = response.iter_raw()
                next(reader)
                wait_until(lambda: replica_inflight(replica.pk) == 2, timeout=3, message="in-flight via the database")
                assert GatewayProcess.objects.count() == 1
                engine.release.set()
            wait_until(lambda: replica_inflight(replica.pk) == 1, timeout=3, message="request done")
    finally:
        inflight.store.cache_clear()
