"""Streams are passed on as the engine writes them, and a client that goes
away cancels the engine's work."""

from __future__ import annotations

import json

import httpx

from .conftest import metric_samples, sample, wait_until


def _stream_body(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "tell me"}], "stream": True, **extra}


def test_first_chunk_arrives_before_the_engine_finishes(gateway_web, make_replica, fake_engine):
    engine = fake_engine("m", events=5)
    engine.mode = "hold"  # writes one event, then waits for the test
    make_replica("m", engine.port)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    with httpx.Client(base_url=web.url, timeout=10) as client:
        with client.stream("POST", "/v1/chat/completions", json=_stream_body("m"),
                           headers={"Accept-Encoding": "gzip"}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert "content-encoding" not in response.headers
            chunks = response.iter_raw()
            first = next(chunks)
            assert b'"t0 "' in first
            assert engine.finished_streams == 0  # the engine is still holding the rest
            engine.release.set()
            rest = b"".join(chunks)
    assert rest.endswith(b"data: [DONE]\n\n")
    # The engine counts a stream after its last write returns, which may be after the client read it.
    wait_until(lambda: engine.finished_streams == 1, timeout=2, message="the engine finished its stream")


def test_client_disconnect_cancels_the_upstream_request(gateway_web, make_replica, fake_engine):
    engine = fake_engine("m", events=200, event_delay=0.05)  # ten seconds of tokens
    replica = make_replica("m", engine.port)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    with httpx.Client(base_url=web.url, timeout=10) as client:
        with client.stream("POST", "/v1/chat/completions", json=_stream_body("m")) as response:
            next(response.iter_raw())  # then drop the stream: httpx closes the connection
        # Well before the engine's ten seconds of tokens are through.
        wait_until(lambda: engine.disconnects, timeout=8, message="the engine seeing the disconnect")
        assert engine.finished_streams == 0
        samples = metric_samples(client.get("/metrics").text)
    r = str(replica.pk)
    assert sample(samples, "llmgw_gateway_requests_total", model="m", replica=r, endpoint="chat", code="499") == 1
    assert sample(samples, "llmgw_gateway_inflight_requests", model="m", replica=r) == 0


def test_usage_is_counted_and_not_shown_unless_asked(gateway_web, make_replica, fake_engine, api_key):
    from gateway.models import ApiKey

    engine = fake_engine("m", events=4)
    make_replica("m", engine.port)
    key = api_key("counted")
    web = gateway_web()
    with httpx.Client(base_url=web.url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as client:
        plain = client.post("/v1/chat/completions", json=_stream_body("m")).text
        asked = client.post("/v1/chat/completions",
                            json=_stream_body("m", stream_options={"include_usage": True})).text
    assert engine.requests[0]["stream_options"] == {"include_usage": True}  # the gateway asked for itself
    assert '"usage": {' not in plain and plain.endswith("data: [DONE]\n\n")
    assert '"usage": {"prompt_tokens": 7' in asked and asked.endswith("data: [DONE]\n\n")
    row = wait_until(lambda: ApiKey.objects.filter(name="counted", completion_tokens=8).first(), timeout=5,
                     message="usage flushed to the database")
    assert (row.requests, row.prompt_tokens) == (2, 14)


def test_events_cut_across_reads_reach_the_client_whole_and_usage_is_counted(gateway_web, make_replica,
                                                                             fake_engine, api_key):
    """An engine's events may arrive cut anywhere (a TCP segment ends inside the JSON): the gateway holds
    an event's beginning until its end, so it finds the final usage event whole, counts it, and strips
    it whole; the client never sees half an event."""
    from gateway.models import ApiKey

    engine = fake_engine("m", events=3)
    engine.mode = "split_events"  # every event in two writes 50 ms apart, the usage event cut inside "usage"
    make_replica("m", engine.port)
    key = api_key("split")
    web = gateway_web()
    with httpx.Client(base_url=web.url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as client:
        plain = client.post("/v1/chat/completions", json=_stream_body("m")).text
        asked = client.post("/v1/chat/completions",
                            json=_stream_body("m", stream_options={"include_usage": True})).text
    for text, usage_shown in ((plain, False), (asked, True)):
        assert text.endswith("data: [DONE]\n\n")
        events = [e for e in text.split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events), events
        chunks = [json.loads(e[6:]) for e in events[:-1]]  # each one whole JSON
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == "t0 t1 t2 "
        assert [c["usage"] for c in chunks if not c["choices"]] == ([{"prompt_tokens": 7, "completion_tokens": 3,
                                                                      "total_tokens": 10}] if usage_shown else [])
    row = wait_until(lambda: ApiKey.objects.filter(name="split", completion_tokens=6).first(), timeout=5,
                     message="usage of both streams flushed to the database")
    assert (row.requests, row.prompt_tokens) == (2, 14)


def test_streaming_from_the_sim_engine(gateway_web, make_replica, sim_engine):
    port = sim_engine("sim-stream", token_delay=0.01)
    make_replica("sim-stream", port)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    with httpx.Client(base_url=web.url, timeout=10) as client:
        with client.stream("POST", "/v1/chat/completions", json=_stream_body("sim-stream")) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text.startswith("This is sim-stream answering")
    assert all(c["choices"] for c in chunks)  # no usage-only chunk the client did not ask for
