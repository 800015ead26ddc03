"""Per-model timeouts (connect, time to first token, idle between chunks,
total) against a real sim engine that stalls at the matching point, defaults
that do not cut long generations, and the retry: once on another replica
before any byte reached the client, never after."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from replicas.models import CatalogEntry


def _body(model: str, stall: dict | None = None, **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 6, **extra}
    if stall:
        body["sim_stall"] = stall
    return body


def _timeouts(model: str, **values: float) -> None:
    CatalogEntry.objects.filter(name=model).update(timeouts=values)


@pytest.fixture
def blackhole():
    """A port that takes no connection: its accept queue is full, so a SYN is dropped and connect waits."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fill = []
    for _ in range(4):
        client = socket.socket()
        client.setblocking(False)
        try:
            client.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fill.append(client)
    time.sleep(0.1)
    yield port
    for client in fill:
        client.close()
    server.close()


def _error(response: httpx.Response) -> dict:
    return response.json()["error"]


def test_connect_timeout(gateway_web, make_replica, blackhole):
    make_replica("m", blackhole)
    _timeouts("m", connect=0.5)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    started = time.monotonic()
    answer = httpx.post(f"{web.url}/v1/chat/completions", json=_body("m"), timeout=20)
    assert answer.status_code == 504 and _error(answer)["code"] == "upstream_timeout"
    assert "within 0.5s" in _error(answer)["message"]
    assert time.monotonic() - started < 3


def test_connect_timeout_goes_to_another_replica(gateway_web, make_replica, sim_engine, blackhole):
    make_replica("m", blackhole)
    make_replica("m", sim_engine("m"))
    _timeouts("m", connect=0.3)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    with httpx.Client(base_url=web.url, timeout=20) as client:
        codes = [client.post("/v1/chat/completions", json=_body("m")).status_code for _ in range(6)]
    assert codes == [200] * 6


def test_ttft_timeout_on_a_stream(gateway_web, make_replica, sim_engine):
    make_replica("m", sim_engine("m"))
    _timeouts("m", ttft=0.5)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    started = time.monotonic()
    answer = httpx.post(f"{web.url}/v1/chat/completions", timeout=20,
                        json=_body("m", {"at": "first_token", "seconds": 5}, stream=True))
    # No byte reached the client: a proper 504, not a broken stream.
    assert answer.status_code == 504 and _error(answer)["code"] == "upstream_timeout"
    assert "no first token within 0.5s" in _error(answer)["message"]
    assert time.monotonic() - started < 3
    fine = httpx.post(f"{web.url}/v1/chat/completions", timeout=20,
                      json=_body("m", {"at": "first_token", "seconds": 0.2}, stream=True))
    assert fine.status_code == 200 and fine.text.rstrip().endswith("[DONE]")


def test_idle_timeout_between_chunks(gateway_web, make_replica, sim_engine):
    make_replica("m", sim_engine("m", token_delay=0.1))
    _timeouts("m", idle=0.6)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    started = time.monotonic()
    with httpx.stream("POST", f"{web.url}/v1/chat/completions", timeout=20,
                      json=_body("m", {"at": "token", "after": 2, "seconds": 5}, stream=True)) as answer:
        assert answer.status_code == 200
        text = answer.read().decode()
    events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
    assert sum(1 for e in events if e.get("choices") and e["choices"][0]["delta"].get("content")) == 2
    assert events[-1]["error"]["code"] == "upstream_timeout"
    assert "nothing for 0.6s" in events[-1]["error"]["message"]
    assert time.monotonic() - started < 3.5
    # Tokens every 0.1 s for 1.2 s: longer than the idle timeout in all, never silent that long.
    long = httpx.post(f"{web.url}/v1/chat/completions", timeout=20, json=_body("m", stream=True, max_tokens=12))
    assert long.status_code == 200 and long.text.rstrip().endswith("[DONE]") and '"error"' not in long.text


def test_total_timeout_and_no_total_by_default(gateway_web, make_replica, sim_engine):
    make_replica("m", sim_engine("m"))
    make_replica("slow", sim_engine("slow"))
    _timeouts("m", total=1)
    _timeouts("slow", idle=0.5, ttft=0.5)  # neither bounds a non-streamed answer
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    started = time.monotonic()
    answer = httpx.post(f"{web.url}/v1/chat/completions", timeout=20,
                        json=_body("m", {"at": "first_token", "seconds": 5}))
    assert answer.status_code == 504 and "did not finish within 1s" in _error(answer)["message"]
    assert time.monotonic() - started < 3
    streamed = httpx.post(f"{web.url}/v1/chat/completions", timeout=20,
                          json=_body("m", {"at": "token", "after": 1, "seconds": 5}, stream=True))
    assert streamed.status_code == 200 and "did not finish within 1s" in streamed.text
    # No total by default: a non-streamed answer that takes 2 s (silent throughout) is not cut.
    slow = httpx.post(f"{web.url}/v1/chat/completions", timeout=20,
                      json=_body("slow", {"at": "first_token", "seconds": 2}))
    assert slow.status_code == 200 and slow.json()["usage"]["completion_tokens"] == 6


def test_engine_503_and_refused_connections_are_retried_on_another_replica(gateway_web, make_replica, fake_engine):
    from tests.conftest import free_port

    busy, good = fake_engine("m"), fake_engine("m")
    busy.mode = "error503"
    make_replica("m", busy.port)
    make_replica("m", good.port)
    make_replica("n", free_port())  # nothing listens there
    make_replica("n", good.port)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    with httpx.Client(base_url=web.url, timeout=20) as client:
        answers = [client.post("/v1/chat/completions", json=_body(model, stream=i % 2 == 1))
                   for i, model in enumerate(["m"] * 10 + ["n"] * 4)]
    assert [a.status_code for a in answers] == [200] * 14
    assert len(busy.requests) >= 1  # some went there first, and were answered by the other
    assert len(good.requests) == 14


def test_no_retry_once_a_byte_reached_the_client(gateway_web, make_replica, fake_engine):
    dying, good = fake_engine("m", events=5), fake_engine("m", events=5)
    dying.mode = "die_mid_stream"
    dying_replica = make_replica("m", dying.port)
    make_replica("m", good.port)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    broken = 0
    with httpx.Client(base_url=web.url, timeout=20) as client:
        for _ in range(10):
            with client.stream("POST", "/v1/chat/completions", json=_body("m", stream=True)) as answer:
                text = answer.read().decode()
                if answer.headers["x-llmgw-replica"] == str(dying_replica.id):
                    broken += 1
                    assert '"t0 "' in text and '"code": "stream_broken"' in text
                else:
                    assert text.rstrip().endswith("[DONE]")
    assert broken >= 1
    # Every broken stream stayed broken: the good engine took only the requests routed to it.
    assert len(good.requests) == 10 - broken
    assert len(dying.requests) == broken


def test_catalog_timeouts_are_strict():
    from replicas.validation import CatalogEntryInvalid, catalog_entry_clean

    entry = {"name": "m", "engine": "sim", "model": "/m"}
    assert catalog_entry_clean({**entry, "timeouts": {"ttft": 30, "idle": None}})["timeouts"] == {"ttft": 30.0}
    for bad, word in (({"tfft": 3}, "did you mean ttft"), ({"ttft": -1}, "greater than or equal to 0"),
                      ({"total": "x"}, "valid number")):
        with pytest.raises(CatalogEntryInvalid) as refused:
            catalog_entry_clean({**entry, "timeouts": bad})
        assert word in str(refused.value.errors["timeouts"])
