"""Hostile clients of /v1 and /metrics: refused from the headers before a
body byte is read, bounded in time, and never able to stall the event loop
or make a 500 with nesting."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from .test_errors import _assert_openai_error

BIG = 32 * 1024 * 1024


def _read_response(sock: socket.socket, timeout: float) -> bytes:
    """What the server answered on ``sock`` (headers and body) within ``timeout`` seconds."""
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep:
                length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")]
                if length and len(body) >= length[0]:
                    break
    except TimeoutError:
        pass
    return data


def _headers(web, path: str, length: int, authorization: str | None = None) -> socket.socket:
    sock = socket.create_connection((web.host, web.port), timeout=10)
    lines = [f"POST {path} HTTP/1.1", f"Host: {web.host}", "Content-Type: application/json",
             f"Content-Length: {length}"]
    if authorization:
        lines.append(f"Authorization: {authorization}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return sock


@pytest.mark.parametrize("authorization", [None, "Bearer sk-llmgw-wrong"])
def test_no_valid_key_is_401_before_the_body(gateway_web, api_key, authorization):
    api_key()
    web = gateway_web()
    sock = _headers(web, "/v1/chat/completions", BIG, authorization)
    with sock:
        answer = _read_response(sock, timeout=10)  # no body byte sent: an answer now is an answer from the headers
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 401"), answer[:300]
    assert b"connection: close" in rest.lower()
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_api_key"


def test_metrics_without_its_token_is_401_before_the_body(gateway_web):
    web = gateway_web(LLMGW_METRICS_TOKEN="scrape-me")
    with _headers(web, "/metrics", BIG) as sock:
        assert _read_response(sock, timeout=10).startswith(b"HTTP/1.1 405")
    assert httpx.get(f"{web.url}/metrics", timeout=10).status_code == 401
    assert httpx.get(f"{web.url}/metrics", timeout=10, headers={"Authorization": "Bearer nope"}).status_code == 401
    scraped = httpx.get(f"{web.url}/metrics", timeout=10, headers={"Authorization": "Bearer scrape-me"})
    assert scraped.status_code == 200 and "llmgw_gpus_free" in scraped.text


def test_metrics_without_a_token_answers_loopback_only(settings, rf):
    from gateway.views import _metrics_refusal

    settings.LLMGW_METRICS_TOKEN = ""
    assert _metrics_refusal(rf.get("/metrics", REMOTE_ADDR="127.0.0.1")) is None
    assert _metrics_refusal(rf.get("/metrics", REMOTE_ADDR="::1")) is None
    assert _metrics_refusal(rf.get("/metrics", REMOTE_ADDR="10.1.2.3")).status_code == 403
    settings.LLMGW_METRICS_TOKEN = "t"
    assert _metrics_refusal(rf.get("/metrics", REMOTE_ADDR="127.0.0.1")).status_code == 401
    assert _metrics_refusal(rf.get("/metrics", REMOTE_ADDR="10.1.2.3", HTTP_AUTHORIZATION="Bearer t")) is None


def test_a_body_that_does_not_arrive_in_time_is_408(gateway_web, api_key):
    key = api_key()
    web = gateway_web(LLMGW_GATEWAY_BODY_TIMEOUT="1")
    with _headers(web, "/v1/chat/completions", 1000, f"Bearer {key}") as sock:
        sock.sendall(b'{"model": "m", ')
        answer = _read_response(sock, timeout=15)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "body_timeout" and "within 1 s" in error["message"]


@pytest.mark.parametrize("inline_bytes", ["1000000", "1000"], ids=["inline", "in-a-process"])
def test_deep_nesting_is_a_400_naming_it(gateway_web, make_replica, fake_engine, api_key, inline_bytes):
    engine = fake_engine("m")
    make_replica("m", engine.port)
    key = api_key()
    web = gateway_web(LLMGW_GATEWAY_INLINE_PARSE_BYTES=inline_bytes)
    depth = 100_000
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    for body in ("[" * depth + "]" * depth,
                 '{"model": "m", "messages": ' + "[" * depth + "]" * depth + "}"):
        response = httpx.post(f"{web.url}/v1/chat/completions", content=body, headers=headers, timeout=30)
        error = _assert_openai_error(response, 400, "invalid_request")
        assert "nested too deeply" in error["message"]
    assert not engine.requests
    # and the same gateway still serves
    ok = httpx.post(f"{web.url}/v1/chat/completions", headers=headers, timeout=30,
                    json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert ok.status_code == 200


def test_metrics_keeps_answering_while_a_large_body_is_parsed(gateway_web, make_replica, fake_engine, api_key):
    """A body of a million small objects takes the parser over a second: the
    event loop must not be the one doing it."""
    engine = fake_engine("m")
    make_replica("m", engine.port)
    key = api_key()
    web = gateway_web()
    body = json.dumps({"model": "not-served", "messages": [{"role": "user", "content": "x"}] * 900_000}).encode()
    assert 25 * 1024 * 1024 < len(body) < BIG
    started = time.monotonic()
    json.loads(body)
    parse = time.monotonic() - started  # about what the server's parse takes, on this machine now
    answered: dict[str, float] = {}

    def big() -> None:
        response = httpx.post(f"{web.url}/v1/chat/completions", content=body, timeout=120,
                              headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        assert response.status_code == 404  # parsed whole, then refused by model name
        answered["big"] = time.monotonic()

    with httpx.Client(base_url=web.url, timeout=60) as scraper:
        assert scraper.get("/metrics").status_code == 200  # warm: the routing table is loaded
        sender = threading.Thread(target=big)
        sender.start()
        scrapes: list[float] = []
        while sender.is_alive():
            assert scraper.get("/metrics").status_code == 200
            scrapes.append(time.monotonic())
            time.sleep(0.05)  # the scenario: a scraper every 50 ms while the big body is parsed
        sender.join()
    assert "big" in answered
    # Scrapes kept coming back in the moments before the big request's
    # answer, while its body was being parsed. Parsed on the event loop, none
    # could: the loop answered nothing between the parse's start and the
    # big answer, which it sends first when the parse ends.
    late = [t for t in scrapes if answered["big"] - 0.8 * parse < t < answered["big"]]
    assert len(late) >= 2, (parse, [round(answered["big"] - t, 2) for t in scrapes[-5:]])
