"""Every error the gateway makes, in OpenAI's shape, and never a 500 for bad input."""

from __future__ import annotations

import httpx
import pytest

from replicas.choices import ReplicaStatus


def _assert_openai_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["message"]
    return error


@pytest.fixture
def served(gateway_web, make_replica, fake_engine, api_key):
    """A gateway with model 'm' served, model 'idle' in the catalog with no ready replica, and a key."""
    engine = fake_engine("m")
    make_replica("m", engine.port)
    make_replica("idle", engine.port, status=ReplicaStatus.STARTING)
    key = api_key()
    web = gateway_web()
    with httpx.Client(base_url=web.url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as client:
        yield client, engine


def test_unknown_model_is_404_listing_the_models(served):
    client, _ = served
    error = _assert_openai_error(
        client.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
        404, "model_not_found")
    assert "`nope`" in error["message"] and "idle, m" in error["message"]
    assert error["param"] == "model"
    _assert_openai_error(client.get("/v1/models/nope"), 404, "model_not_found")


def test_model_without_ready_replica_is_503_with_retry_after(served):
    client, _ = served
    response = client.post("/v1/completions", json={"model": "idle", "prompt": "x"})
    _assert_openai_error(response, 503, "no_ready_replica")
    assert int(response.headers["retry-after"]) >= 1


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"\xff\xfe", None),
    (b"[1, 2]", None),
    (b'"a string"', None),
    (b"{}", "model"),
    (b'{"model": 7, "messages": []}', "model"),
    (b'{"model": "m"}', "messages"),
    (b'{"model": "m", "messages": []}', "messages"),
    (b'{"model": "m", "messages": "hi"}', "messages"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
])
def test_malformed_bodies_are_400(served, body, param):
    client, engine = served
    answer = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    error = _assert_openai_error(answer, 400, "invalid_request")
    assert error["param"] == param
    assert not engine.requests


def test_completion_and_embedding_bodies_are_checked_too(served):
    client, _ = served
    _assert_openai_error(client.post("/v1/completions", json={"model": "m"}), 400, "invalid_request")
    _assert_openai_error(client.post("/v1/embeddings", json={"model": "m"}), 400, "invalid_request")
    assert client.post("/v1/embeddings", json={"model": "m", "input": "hello"}).json()["data"][0]["embedding"]


def test_wrong_method_and_unknown_path(served):
    client, _ = served
    response = client.get("/v1/chat/completions")
    _assert_openai_error(response, 405, "method_not_allowed")
    assert response.headers["allow"] == "POST"
    _assert_openai_error(client.post("/v1/models", json={}), 405, "method_not_allowed")
    _assert_openai_error(client.post("/v1/nothing-here", json={}), 404, "not_found")


def test_body_too_large_is_413(gateway_web, make_replica, fake_engine):
    engine = fake_engine("m")
    make_replica("m", engine.port)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1", LLMGW_GATEWAY_MAX_BODY_BYTES="1000")
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]}
    _assert_openai_error(httpx.post(f"{web.url}/v1/chat/completions", json=body, timeout=10), 413, "body_too_large")


def test_upstream_timeout_is_504(gateway_web, make_replica, fake_engine):
    engine = fake_engine("m")
    engine.mode = "hang"
    make_replica("m", engine.port)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1", LLMGW_GATEWAY_TOTAL_TIMEOUT="0.5")
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    _assert_openai_error(httpx.post(f"{web.url}/v1/chat/completions", json=body, timeout=10), 504, "upstream_timeout")


def test_engine_errors_pass_through(served):
    client, engine = served
    engine.mode = "error500"
    response = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "engine exploded"


def test_an_engine_dying_mid_stream_ends_the_stream_cleanly(served):
    client, engine = served
    engine.mode = "die_mid_stream"
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        text = response.read().decode()  # a clean end of the chunked body, or httpx would raise
    events = [e for e in text.split("\n\n") if e.startswith("data: ")]
    assert '"t0 "' in events[0]
    assert '"code": "stream_broken"' in events[-1]
