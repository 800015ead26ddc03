"""Drains and failures that drop nothing: a steady stream of requests through
the gateway while a node is drained, and while a node dies."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from cli.wait import wait_until
from replicas.catalog import catalog_apply
from nodes.choices import NodeStatus
from nodes.models import Node
from replicas.choices import ReplicaStatus
from replicas.drain import drain_start
from replicas.models import Drain, Member, Replica
from tests.e2e.sim import fast_env

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MODEL = "small"


class Traffic:
    """Requests one after another from a few threads, each recorded; bounded in time."""

    def __init__(self, url: str, *, threads: int = 4, stream: bool = True, limit: float = 120,
                 model: str = MODEL) -> None:
        self.url, self.stream, self.limit, self.model = url, stream, limit, model
        self.results: list[tuple[float, bool, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def _one(self, client: httpx.Client) -> tuple[bool, str]:
        body = {"model": self.model, "stream": self.stream, "max_tokens": 8,
                "messages": [{"role": "user", "content": "hello there"}]}
        try:
            with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response:
                text = "".join(response.iter_text())
            if response.status_code != 200:
                return False, f"{response.status_code}: {text[:200]}"
            if self.stream and "[DONE]" not in text:
                return False, "stream cut short"
            return True, ""
        except httpx.HTTPError as exc:
            return False, repr(exc)

    def _run(self) -> None:
        deadline = time.monotonic() + self.limit
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set() and time.monotonic() < deadline:
                ok, why = self._one(client)
                self.results.append((time.monotonic(), ok, why))

    def __enter__(self) -> "Traffic":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def failures(self, after: float = 0.0) -> list[str]:
        return [why for at, ok, why in self.results if not ok and at >= after]

    def served(self, after: float = 0.0) -> int:
        """Requests answered whole that ended after ``after`` (time.monotonic)."""
        return sum(1 for at, ok, _ in list(self.results) if ok and at > after)

    def wait_served(self, count: int, *, after: float = 0.0, what: str) -> None:
        wait_until(lambda: self.served(after) >= count, timeout=60, message=f"{count} requests served {what}")


def _start(sim_cluster, web_factory, replicas: int):
    cluster = sim_cluster()
    web = web_factory(LLMGW_GATEWAY_OPEN="1", **fast_env())
    catalog_apply(entries=[{"name": MODEL, "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 8,
                            "replicas": replicas}])
    wait_until(lambda: Replica.objects.filter(status=ReplicaStatus.READY).count() == replicas, timeout=60,
               message="ready replicas")
    wait_until(lambda: httpx.get(f"{web.url}/v1/models", timeout=5).json()["data"], timeout=10,
               message="the gateway to route the model")
    return cluster, web


def test_drain_under_steady_traffic_drops_nothing(sim_cluster, web_factory):
    cluster, web = _start(sim_cluster, web_factory, replicas=2)
    original = Member.objects.filter(replica__status=ReplicaStatus.READY).select_related("node").first()
    with Traffic(web.url) as traffic:
        traffic.wait_served(10, what="before the drain")
        drain = drain_start(node_name=original.node.name)
        wait_until(lambda: Drain.objects.get(pk=drain.pk).status == "done", timeout=90, message="the drain")
        # The original stopped: what comes now is served by its replacement.
        traffic.wait_served(10, after=time.monotonic(), what="after the drain")
    assert len(traffic.results) > 50, "too little traffic to mean anything"
    assert traffic.failures() == []
    assert Replica.objects.get(pk=original.replica_id).status == ReplicaStatus.STOPPED


def test_lost_node_new_requests_go_to_the_remaining_replicas(sim_cluster, web_factory):
    cluster, web = _start(sim_cluster, web_factory, replicas=2)
    victim = Member.objects.filter(replica__status=ReplicaStatus.READY).select_related("node").first()
    with Traffic(web.url) as traffic:
        traffic.wait_served(10, what="before the kill")
        killed_at = time.monotonic()
        cluster.kill_node(victim.node.name)
        # Through the whole story: before the node is declared lost, and after.
        wait_until(lambda: Node.objects.get(pk=victim.node_id).status == NodeStatus.LOST, timeout=30,
                   message=f"{victim.node.name} declared lost")
        traffic.wait_served(10, after=time.monotonic(), what="after the node was declared lost")
    # What was in flight on the dead node may fail; what came after goes elsewhere.
    assert traffic.failures(after=killed_at + 1.0) == []
    served_after = [r for r in traffic.results if r[0] > killed_at + 1.0 and r[1]]
    assert len(served_after) > 20
