"""The official openai package against the gateway and a real sim engine."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture
def client(gateway_web, make_replica, sim_engine, api_key):
    port = sim_engine("sim-openai", token_delay=0.005)
    make_replica("sim-openai", port)
    key = api_key("openai-tests")
    web = gateway_web()
    with openai.OpenAI(base_url=f"{web.url}/v1", api_key=key, max_retries=0, timeout=20) as client:
        client.gateway_url = web.url
        yield client


def test_chat_completion(client):
    reply = client.chat.completions.create(model="sim-openai", messages=[{"role": "user", "content": "Hello!"}])
    assert reply.choices[0].message.content.startswith("This is sim-openai answering")
    assert reply.usage.completion_tokens > 0


def test_streaming_chat_completion(client):
    stream = client.chat.completions.create(model="sim-openai", stream=True,
                                            messages=[{"role": "user", "content": "Hello!"}])
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len(pieces) > 5
    assert "".join(pieces).startswith("This is sim-openai answering")


def test_streaming_with_usage(client):
    stream = client.chat.completions.create(model="sim-openai", stream=True, stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "Hello!"}])
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_completion(client):
    reply = client.completions.create(model="sim-openai", prompt="Once upon a time", max_tokens=4)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].text


def test_models_list(client):
    assert [m.id for m in client.models.list()] == ["sim-openai"]
    assert client.models.retrieve("sim-openai").id == "sim-openai"


def test_bad_key(client):
    with openai.OpenAI(base_url=f"{client.gateway_url}/v1", api_key="sk-llmgw-not-a-key", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as raised:
            bad.models.list()
    assert raised.value.status_code == 401
    assert raised.value.code == "invalid_api_key"


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "Hello!"}])
    assert raised.value.code == "model_not_found"
    assert "sim-openai" in raised.value.message
