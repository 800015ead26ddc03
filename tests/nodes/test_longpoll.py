"""The desired-state long-poll: parked without a thread, woken by a change."""

import threading
import time

import httpx
import pytest
from django.db import transaction

from agent.protocol import example_heartbeat
from cli.wait import wait_until
from nodes.services import node_desired_changed
from tests.conftest import mtls_client

pytestmark = pytest.mark.django_db(transaction=True)

# The listener logs each long-poll it parks at DEBUG (nodes.watch.parkable).
DEBUG = {"LLMGW_LOG_LEVEL": "DEBUG"}


def parked(server, node: str) -> int:
    """How many long-polls of this node the listener has parked so far."""
    return server.log().count(f"long-poll parked node={node} ")


def _register(server, client, node):
    r = client.post(f"{server.url}/agent/v1/nodes/{node}/heartbeat", json=example_heartbeat(gpus=0, fabric=None).to_dict())
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("liveness", ["redis", "database"])
def test_change_wakes_parked_longpoll(agent_api_factory, client_cert, liveness):
    env = dict(DEBUG) if liveness == "redis" else dict(DEBUG, LLMGW_REDIS_URL="")
    server = agent_api_factory(threads=2, **env)
    cert, key, ca = client_cert("node01")
    with mtls_client(cert, key, ca, timeout=20) as client:
        _register(server, client, "node01")
        result = {}

        def poll():
            try:
                r = client.get(f"{server.url}/agent/v1/nodes/node01/desired", params={"version": 0, "wait": 60})
            except httpx.HTTPError as exc:  # the client's 20 s ran out: nothing woke it
                result.update(error=repr(exc))
                return
            result.update(status=r.status_code, body=r.json())

        thread = threading.Thread(target=poll)
        thread.start()
        # Parked before the change: the change wakes it, rather than being read at once.
        wait_until(lambda: parked(server, "node01"), timeout=10, message="the long-poll parked")
        assert thread.is_alive(), "the long-poll answered before anything changed"
        with transaction.atomic():
            node_desired_changed(node_name="node01")
        # Woken by the change: its own wait (60 s) is twice this deadline.
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert result.get("status") == 200, f"the change did not wake the parked long-poll: {result}"
        assert result["body"]["version"] == 1


def test_longpoll_times_out_with_same_version_and_stale_version_answers_at_once(agent_api, client_cert):
    cert, key, ca = client_cert("node01")
    with mtls_client(cert, key, ca, timeout=20) as client:
        _register(agent_api, client, "node01")
        # The registration's own change notice may still be on its way to the
        # listener, and wakes a long-poll parked before it lands (an early
        # answer is allowed). Once one long-poll has come back, it has landed.
        r = client.get(f"{agent_api.url}/agent/v1/nodes/node01/desired", params={"version": 0, "wait": 1})
        assert r.status_code == 200 and r.json()["version"] == 0
        start = time.monotonic()
        r = client.get(f"{agent_api.url}/agent/v1/nodes/node01/desired", params={"version": 0, "wait": 1})
        assert r.status_code == 200 and r.json()["version"] == 0
        assert time.monotonic() - start >= 0.9  # it waited: nothing had changed
        # A stale version answers at once: within the client's 20 s, its 60 s wait unused.
        r = client.get(f"{agent_api.url}/agent/v1/nodes/node01/desired", params={"version": 7, "wait": 60})
        assert r.json() == {"version": 0, "members": []}


def test_longpoll_for_another_node_is_refused(agent_api, client_cert):
    cert, key, ca = client_cert("node01")
    with mtls_client(cert, key, ca, timeout=20) as client:
        _register(agent_api, client, "node01")
        r = client.get(f"{agent_api.url}/agent/v1/nodes/node02/desired", params={"version": 0, "wait": 10})
    assert r.status_code == 403
    assert "node01" in r.json()["error"] and "node02" in r.json()["error"]


def test_parked_longpolls_hold_no_thread(agent_api_factory, client_cert):
    """More waiting agents than pool threads, and heartbeats still get through."""
    server = agent_api_factory(threads=2, **DEBUG)
    nodes = [f"node{i:02d}" for i in range(1, 9)]
    certs = {n: client_cert(n) for n in nodes}
    clients = {n: mtls_client(*certs[n], timeout=30) for n in nodes}
    try:
        for n in nodes:
            _register(server, clients[n], n)
        threads = [
            threading.Thread(
                target=lambda n=n: clients[n].get(
                    f"{server.url}/agent/v1/nodes/{n}/desired", params={"version": 0, "wait": 60}
                )
            )
            for n in nodes[1:]
        ]
        for t in threads:
            t.start()
        wait_until(lambda: all(parked(server, n) for n in nodes[1:]), timeout=20,
                   message="seven long-polls parked")
        r = clients["node01"].post(
            f"{server.url}/agent/v1/nodes/node01/heartbeat", json=example_heartbeat(gpus=0, fabric=None).to_dict()
        )
        assert r.status_code == 200
        # Answered while seven long-polls wait on two threads: none of them holds one.
        assert all(t.is_alive() for t in threads), "the long-polls should still be waiting"
        with transaction.atomic():
            for n in nodes[1:]:
                node_desired_changed(node_name=n)
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
    finally:
        for c in clients.values():
            c.close()
