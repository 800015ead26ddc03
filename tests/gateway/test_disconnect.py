"""A client that goes away stops its request's work whatever the answer's
shape: the web process's protocol calls the gateway back when the connection
is lost (web/protocol.py), and under a server that offers no such callback
(uvicorn's own protocol) the gateway watches receive() itself."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from .conftest import metric_samples, sample, wait_until

OURS = None  # what 'llmgw up' passes: web.protocol:HttpProtocol
STOCK = "httptools"  # uvicorn's own: no disconnect callback in the scope


def _code_count(base_url: str, replica, code: str) -> float:
    with httpx.Client(base_url=base_url, timeout=5) as client:
        samples = metric_samples(client.get("/metrics").text)
    try:
        return sample(samples, "llmgw_gateway_requests_total", model="m", replica=str(replica.pk),
                      endpoint="chat", code=code)
    except KeyError:
        return 0


def _inflight(base_url: str, replica) -> float:
    with httpx.Client(base_url=base_url, timeout=5) as client:
        samples = metric_samples(client.get("/metrics").text)
    return sample(samples, "llmgw_gateway_inflight_requests", model="m", replica=str(replica.pk))


def _request(body: bytes = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}') -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


@pytest.mark.parametrize("protocol", [OURS, STOCK], ids=["ours", "stock"])
def test_a_whole_answer_the_client_left_is_cancelled_while_the_engine_still_works(
        protocol, gateway_web, make_replica, fake_engine):
    engine = fake_engine("m")
    engine.mode = "hang"  # answers nothing until released: only the disconnect can end the gateway's wait
    replica = make_replica("m", engine.port)
    web = gateway_web(http=protocol, LLMGW_GATEWAY_OPEN="1")
    with socket.create_connection((web.host, web.port), timeout=5) as sock:
        sock.sendall(_request())
        wait_until(lambda: engine.requests, timeout=5, message="the engine receiving the request")
        assert _inflight(web.url, replica) == 1
    wait_until(lambda: _code_count(web.url, replica, "499") == 1, timeout=5,
               message="the gateway counting the request as given up by its client")
    assert _inflight(web.url, replica) == 0
    assert not engine.release.is_set()  # the engine never answered: the gateway stopped waiting by itself
    engine.release.set()


def test_pipelined_requests_are_answered_in_order_and_each_stops_on_a_disconnect(
        gateway_web, make_replica, fake_engine):
    """Two requests in one write: the second's head replaces the protocol's current request before the first
    is answered. Both are answered, in order; then, pipelined behind one the engine holds, a client that
    leaves stops the one that runs (uvicorn's own protocol tells only the one waiting behind it)."""
    engine = fake_engine("m")
    replica = make_replica("m", engine.port)
    web = gateway_web(LLMGW_GATEWAY_OPEN="1")
    with socket.create_connection((web.host, web.port), timeout=5) as sock:
        sock.sendall(_request() + _request())
        data, deadline = b"", time.monotonic() + 5
        while data.count(b"HTTP/1.1 200") < 2 and time.monotonic() < deadline:
            data += sock.recv(65536)
    assert data.count(b"HTTP/1.1 200") == 2, data[:400]
    assert data.count(b'"chat.completion"') == 2
    assert len(engine.requests) == 2

    engine.mode = "hang"
    with socket.create_connection((web.host, web.port), timeout=5) as sock:
        sock.sendall(_request() + _request())
        wait_until(lambda: len(engine.requests) == 3, timeout=5, message="the engine receiving the first")
    wait_until(lambda: _code_count(web.url, replica, "499") == 1, timeout=5,
               message="the running request stopped when its client left")
    assert _inflight(web.url, replica) == 0
    time.sleep(0.3)
    assert len(engine.requests) == 3  # the one behind it never started
    # The running request was told it had lost its client (uvicorn would answer it 500 into the void).
    assert "returned without starting response" not in web.log_path.read_text()
    engine.release.set()


def test_the_protocol_and_the_gateway_name_one_extension():
    from gateway.asgi import DISCONNECT_EXTENSION as asked
    from web.protocol import DISCONNECT_EXTENSION as offered

    assert asked == offered
