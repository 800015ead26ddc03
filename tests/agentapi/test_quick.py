"""The quick lane (agentapi/quick.py) answers a heartbeat that brings no news,
and a ping, from the event loop with the bytes the whole way (gunicorn's
parser, Django, the view) gives; any other shape goes the whole way."""

from __future__ import annotations

import json
import re
import time

import pytest

from agent.protocol import example_heartbeat
from agentapi.quick import parse, quick_lane_allowed
from nodes.models import Node
from nodes.services import node_cordon
from tests.agentapi.test_slow_clients import read_response, tls_connect

HEARTBEAT = "POST /agent/v1/nodes/node01/heartbeat HTTP/1.1\r\n"
BODY = json.dumps(example_heartbeat().to_dict()).encode()


def request(*headers: str, body: bytes = BODY, line: str = HEARTBEAT) -> bytes:
    head = line + "".join(h + "\r\n" for h in headers)
    if line.startswith("POST") and not any(h.lower().startswith(("content-length", "transfer-encoding"))
                                           for h in headers):
        head += f"Content-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + (body if line.startswith("POST") else b"")


AGENT_HEADERS = ("Host: agent-api", "Accept: */*", "Accept-Encoding: gzip, deflate", "Connection: keep-alive",
                 "User-Agent: python-httpx/0.28.1", "Content-Type: application/json")


def test_the_narrow_shapes_are_parsed():
    assert parse(request(*AGENT_HEADERS)) == ("node01", BODY)
    assert parse(request("Host: x", line="GET /agent/v1/ping HTTP/1.1\r\n")) == (None, b"")


@pytest.mark.parametrize("data", [
    request("Host: x", "X-Extra: 1"),  # any other header
    request("Host: x", "Connection: close"),
    request("Host: x", "Transfer-Encoding: chunked"),
    request("Host: x", "Expect: 100-continue"),
    request("Host: x", "Content-Length: 5", "Content-Length: 5", body=b"{}xyz"),
    request("Host: x", "Content-Length: 3"),  # the body is longer than declared
    request("Host: x") + b"GET",  # the start of a pipelined request
    request("Host: x\x01"),  # a control character
    request("Host : x"),  # space before the colon
    request("Host: x", "User-Agent: " + "a" * 2000),
    request("Host: x", line="POST /agent/v1/nodes/node01/heartbeat HTTP/1.0\r\n"),
    request("Host: x", line="POST /agent/v1/nodes/node01/heartbeat?x=1 HTTP/1.1\r\n"),
    request("Host: x", line="POST /agent/v1/nodes/Node01/heartbeat HTTP/1.1\r\n"),
    request("Host: x", line="POST /agent/v1/nodes/node%301/heartbeat HTTP/1.1\r\n"),
    request("Host: x", line="PUT /agent/v1/nodes/node01/heartbeat HTTP/1.1\r\n"),
    request("Host: x", line="GET /agent/v1/nodes/node01/desired HTTP/1.1\r\n"),
    request("Host: x", "Content-Length: 2", line="GET /agent/v1/ping HTTP/1.1\r\n") + b"{}",
], ids=["other header", "close", "chunked", "expect", "two lengths", "longer body", "pipelined", "control char",
        "space before colon", "long header", "http/1.0", "query", "uppercase id", "percent-encoded",
        "method", "other path", "ping with a body"])
def test_anything_else_goes_the_whole_way(data):
    assert parse(data) is None


def test_no_quick_lane_when_gunicorn_would_log_or_call_hooks():
    from gunicorn.config import Config

    assert quick_lane_allowed(Config())
    logging = Config()
    logging.set("accesslog", "-")
    assert not quick_lane_allowed(logging)
    hooked = Config()
    hooked.set("pre_request", lambda worker, req: None)
    assert not quick_lane_allowed(hooked)


def _comparable(response: bytes) -> bytes:
    return re.sub(rb"\r\nDate: [^\r]*", b"", response)


@pytest.mark.django_db(transaction=True)
def test_quick_answers_are_the_whole_ways_answers(agent_api_factory, client_cert, settings):
    # At debug level gunicorn's pre_request logs "METHOD path" for each
    # request that goes the whole way: the quick ones leave no such line.
    settings.LLMGW_AGENT_LOG_LEVEL = "debug"
    server = agent_api_factory()
    sock = tls_connect(server, client_cert("node01"))

    def whole_way_lines() -> int:
        return len(re.findall(r"\] (?:POST|GET) /agent/v1/", server.log()))

    try:
        for _ in range(3):  # registers; picks up the registration's status change; then cached
            sock.sendall(request(*AGENT_HEADERS))
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        assert Node.objects.get(name="node01").status == "ready"
        for quick, whole in [
            (request(*AGENT_HEADERS), request(*AGENT_HEADERS, "X-Whole-Way: 1")),
            (request("Host: agent-api", line="GET /agent/v1/ping HTTP/1.1\r\n"),
             request("Host: agent-api", "X-Whole-Way: 1", line="GET /agent/v1/ping HTTP/1.1\r\n")),
        ]:
            before = whole_way_lines()
            sock.sendall(quick)
            first = read_response(sock)
            sock.sendall(whole)
            second = read_response(sock)
            assert first.startswith(b"HTTP/1.1 200 ") and _comparable(first) == _comparable(second), (first, second)
            assert whole_way_lines() == before + 1, server.log()[-2000:]
    finally:
        sock.close()


@pytest.mark.django_db(transaction=True)
def test_a_changed_or_refused_heartbeat_is_answered_by_the_view(agent_api, client_cert):
    creds = client_cert("node01")
    sock = tls_connect(agent_api, creds)
    try:
        for _ in range(3):
            sock.sendall(request(*AGENT_HEADERS))
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        # A malformed heartbeat on the same connection: the view's 400, nothing stored.
        sock.sendall(request(*AGENT_HEADERS, body=b'{"gpus": 3}'))
        assert read_response(sock).startswith(b"HTTP/1.1 400 ")
        # Another node's URL with this certificate: the view's 403.
        sock.sendall(request(*AGENT_HEADERS, line="POST /agent/v1/nodes/node02/heartbeat HTTP/1.1\r\n"))
        assert read_response(sock).startswith(b"HTTP/1.1 403 ")
        # A node cordoned meanwhile: the same body is answered with the new
        # status (once the bump's publish has reached the worker: a millisecond).
        node_cordon(node_name="node01")
        status = Node.objects.get(name="node01").status
        assert status != "ready"
        deadline = time.monotonic() + 5
        while True:
            sock.sendall(request(*AGENT_HEADERS))
            answer = json.loads(read_response(sock).split(b"\r\n\r\n", 1)[1])
            if answer["status"] == status or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert answer["status"] == status, answer
    finally:
        sock.close()
