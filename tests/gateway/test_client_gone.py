"""A client that goes away at any point gives back everything its request
held: the key's concurrency slot and token reservation (gateway/limits.py),
the replica's in-flight count, the upstream connection, a place in the
gateway's queue. Real gateway processes, real Redis, raw sockets as clients."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from .conftest import metric_samples, sample, wait_until
from .test_limits import clean_limits  # noqa: F401 - a fixture


pytestmark = pytest.mark.usefixtures("clean_limits")


def _request(key: str, body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)


def _chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "tell me"}], **extra}


def _inflight(web, replica) -> float:
    samples = metric_samples(httpx.get(f"{web.url}/metrics", timeout=5).text)
    return sample(samples, "llmgw_gateway_inflight_requests", model="m", replica=str(replica.pk))


def _upstream_was_closed(engine) -> None:
    """The held stream, let go, finds its connection closed by the gateway."""
    engine.mode = "normal"
    engine.release.set()
    wait_until(lambda: engine.disconnects, timeout=5, message="the engine finding the gateway gone")
    assert engine.finished_streams == 0


def _next_request_passes(web, key: str) -> None:
    """The key (one request at a time) is served again: its slot came back."""
    answer = httpx.post(f"{web.url}/v1/chat/completions", json=_chat("m"), timeout=10,
                        headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text


def test_a_client_gone_right_after_the_head_gives_back_its_slot(gateway_web, make_replica, fake_engine, api_key):
    from gateway.services import key_update

    engine = fake_engine("m", events=5)
    engine.mode = "hold"  # the first event, then nothing until released
    replica = make_replica("m", engine.port)
    key = api_key("one-at-a-time")
    key_update(name="one-at-a-time", max_concurrent=1)
    web = gateway_web()
    with socket.create_connection(("127.0.0.1", web.port), timeout=10) as client:
        client.sendall(_request(key, _chat("m", stream=True)))
        head = b""
        while b"\r\n\r\n" not in head:
            head += client.recv(1)  # the head, and not a byte of the body
        assert head.startswith(b"HTTP/1.1 200")
    wait_until(lambda: _inflight(web, replica) == 0, timeout=5, message="in flight back to 0")
    _upstream_was_closed(engine)
    _next_request_passes(web, key)


def test_a_client_gone_while_its_head_waits_to_be_written(gateway_web, make_replica, fake_engine, api_key):
    """The gap between a stream's head and its first chunk: the client reads nothing (its socket's buffers are
    full of an earlier answer, so the gateway's write of the head waits for room) and then closes. The relay
    never starts; the response's closer gives everything back."""
    from gateway.services import key_update

    big = fake_engine("big", events=2_500_000)  # a 7.5 MB answer: more than the kernel's buffers hold
    engine = fake_engine("m", events=5)
    engine.mode = "hold"
    make_replica("big", big.port)
    replica = make_replica("m", engine.port)
    other, key = api_key("unlimited"), api_key("one-at-a-time")
    key_update(name="one-at-a-time", max_concurrent=1)
    web = gateway_web()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", web.port))
    try:
        # Two requests on one connection: the big answer the client never reads, then the stream.
        client.sendall(_request(other, _chat("big")) + _request(key, _chat("m", stream=True)))
        wait_until(lambda: engine.requests, timeout=20, message="the stream reaching the engine")
        time.sleep(0.5)  # its first event back at the gateway, whose write of the head waits
        assert _inflight(web, replica) == 1
    finally:
        client.close()
    wait_until(lambda: _inflight(web, replica) == 0, timeout=5, message="in flight back to 0")
    _upstream_was_closed(engine)
    _next_request_passes(web, key)


def test_a_client_gone_while_queued_gives_back_its_slot_and_place(gateway_web, make_replica, fake_engine, api_key):
    from gateway.services import key_update
    from replicas.models import CatalogEntry

    engine = fake_engine("m", events=5)
    engine.mode = "hold"
    replica = make_replica("m", engine.port)
    CatalogEntry.objects.filter(name="m").update(args=["--max-num-seqs", "1"])
    filler, key = api_key("filler"), api_key("one-at-a-time")
    key_update(name="one-at-a-time", max_concurrent=1)
    web = gateway_web(LLMGW_GATEWAY_ENGINE_QUEUE="0", LLMGW_GATEWAY_QUEUE_WAIT="30")
    with socket.create_connection(("127.0.0.1", web.port), timeout=10) as first:
        first.sendall(_request(filler, _chat("m", stream=True)))  # takes the replica's one slot
        wait_until(lambda: len(engine.requests) == 1, timeout=10, message="the first request at the engine")
        with socket.create_connection(("127.0.0.1", web.port), timeout=10) as queued:
            queued.sendall(_request(key, _chat("m", stream=True)))
            wait_until(lambda: _waiting(web) == 1, timeout=5, message="the second request queued")
        wait_until(lambda: _waiting(web) == 0, timeout=5, message="the queue empty again")
        assert len(engine.requests) == 1  # the one that left never reached the engine
        engine.mode = "normal"
        engine.release.set()
    wait_until(lambda: _inflight(web, replica) == 0, timeout=5, message="in flight back to 0")
    _next_request_passes(web, key)


def _waiting(web) -> int:
    """Requests the gateway processes hold or queue for model m, as they publish it for the autoscaler."""
    from gateway.load_report import deployment_load

    return deployment_load().get("m", (0, 0, None))[1]
