"""issue 27, under churn: a lost node's replica lets its stream in flight
finish while its replacement starts; a model's replicas are spread again
after drains and scale-downs."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from django.db import transaction

from cli.wait import wait_until
from nodes.choices import NodeStatus
from nodes.models import Node
from replicas.catalog import catalog_apply
from replicas.choices import ReplicaStatus
from replicas.models import Member, Replica
from tests.e2e.sim import GRACE, fast_env

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def alive(pid: int | None) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, TypeError):
        return False


class Stream:
    """One streamed chat completion in a thread: when its first bytes came,
    when it ended, what it said."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.first_at: float | None = None
        self.ended_at: float | None = None
        self.status: int | None = None
        self.text = ""
        self.error = ""
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        body = {"model": self.model, "stream": True, "messages": [{"role": "user", "content": "hello there"}]}
        try:
            with httpx.Client(timeout=60) as client, \
                    client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response:
                self.status = response.status_code
                for chunk in response.iter_text():
                    if self.first_at is None:
                        self.first_at = time.monotonic()
                    self.text += chunk
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        self.ended_at = time.monotonic()

    def start(self) -> "Stream":
        self.thread.start()
        return self


def test_a_lost_nodes_replica_finishes_its_stream_while_its_replacement_starts(sim_cluster, web_factory):
    """The leader's agent is frozen past the grace (SIGSTOP: the machine
    hangs, its engine serves on): the node is lost and the replica failed,
    a replacement is placed on the other fabric at once, and the member on
    the live node keeps running until the stream in flight has ended whole
    (it once got SIGTERM 3 ms after the decision, and the stream ended with
    stream_broken)."""
    overrides = {"LLMGW_STOP_GRACE": "60"}
    cluster = sim_cluster(**overrides)
    web = web_factory(LLMGW_GATEWAY_OPEN="1", **{**fast_env(), **overrides})
    # 14 tokens 0.8 s apart: a stream of about 11 s, longer than the grace and the failover.
    catalog_apply(entries=[{"name": "big", "engine": "sim", "model": "/m", "nodes": 2, "gpus_per_node": 8,
                            "replicas": 1, "args": ["--token-delay", "0.8"]}])
    wait_until(lambda: Replica.objects.filter(status=ReplicaStatus.READY).count() == 1, timeout=60,
               message="a ready replica")
    wait_until(lambda: httpx.get(f"{web.url}/v1/models", timeout=5).json()["data"], timeout=10,
               message="the gateway to route the model")
    original = Replica.objects.get(status=ReplicaStatus.READY)
    leader, worker = list(original.members.select_related("node").order_by("rank"))
    stream = Stream(web.url, "big").start()
    wait_until(lambda: stream.first_at is not None, timeout=20, message="the stream to begin")
    cluster.freeze_agent(leader.node.name)
    try:
        wait_until(lambda: Node.objects.get(pk=leader.node_id).status == NodeStatus.LOST, timeout=GRACE + 15,
                   message=f"{leader.node.name} declared lost")
        wait_until(lambda: Replica.objects.get(pk=original.pk).status == ReplicaStatus.FAILED, timeout=10,
                   message="the replica failed")
        failed_at = time.monotonic()
        # Out of routing at once: a new request goes nowhere (no other replica yet), not to it.
        wait_until(lambda: httpx.get(f"{web.url}/v1/models", timeout=5).json()["data"] == [], timeout=5,
                   message="the failed replica out of the gateway's routes")
        replacement = wait_until(
            lambda: Replica.objects.filter(model__name="big", status__in=[
                ReplicaStatus.SCHEDULED, ReplicaStatus.STARTING, ReplicaStatus.READY]).exclude(pk=original.pk).first(),
            timeout=15, message="a replacement placed")
        assert replacement.fabric_id != original.fabric_id
        # Still streaming from the failed replica's leader (once it was cut here: stream_broken).
        assert stream.ended_at is None, f"the stream ended already: {stream.error} {stream.text[-300:]!r}"
        assert alive(worker.pid), "the live member was stopped with a stream in flight"
        stream.thread.join(timeout=60)
        assert stream.status == 200 and not stream.error, (stream.status, stream.error)
        assert "stream_broken" not in stream.text and stream.text.rstrip().endswith("data: [DONE]"), stream.text[-500:]
        assert stream.ended_at > failed_at
        # Once nothing is in flight, the live member stops (well within the grace).
        wait_until(lambda: not alive(worker.pid), timeout=30, message="the failed replica's live member stopped")
        wait_until(lambda: Replica.objects.get(pk=original.pk).status == ReplicaStatus.STOPPED, timeout=30,
                   message="the failed replica stopped")
        wait_until(lambda: Replica.objects.filter(model__name="big", status=ReplicaStatus.READY).count() == 1,
                   timeout=60, message="the replacement ready")
    finally:
        cluster.thaw_agent(leader.node.name)
    assert not Member.objects.filter(replica=original).exclude(state="gone").exists()


def _ready_nodes(model: str) -> list[str]:
    return sorted(Member.objects.filter(replica__model__name=model, replica__status=ReplicaStatus.READY,
                                        replica__draining=False).values_list("node__name", flat=True))


def test_a_models_replicas_are_spread_again_after_drains_and_scale_downs(sim_cluster):
    """Cordons, a drain and a scale-down leave every replica of a model on
    node01 (each drain and scale-down doing what it must); once the nodes are
    back in service, one replica moves to the other fabric, replacement
    first, and the model's two replicas no longer share a node or a fabric."""
    from core.models import Event
    from nodes.services import node_cordon, node_uncordon
    from replicas.catalog import model_scale
    from replicas.choices import DrainStatus
    from replicas.drain import drain_start
    from replicas.models import Drain

    cluster = sim_cluster()  # node01, node02 on ib-a; node03, node04 on ib-b
    catalog_apply(entries=[{"name": "small", "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 2,
                            "replicas": 2}])
    wait_until(lambda: _ready_nodes("small") == ["node01", "node03"], timeout=60, message="small on node01 and node03")
    node_cordon(node_name="node02")
    node_cordon(node_name="node04")
    model_scale(name="small", replicas=3)
    wait_until(lambda: len(_ready_nodes("small")) == 3, timeout=60, message="three ready replicas")
    drain = drain_start(node_name="node03")
    wait_until(lambda: Drain.objects.get(pk=drain.pk).status == DrainStatus.DONE, timeout=90,
               message="the drain of node03")
    assert _ready_nodes("small") == ["node01", "node01", "node01"]
    model_scale(name="small", replicas=2)
    wait_until(lambda: _ready_nodes("small") == ["node01", "node01"], timeout=30, message="scaled down to two")
    # Nowhere better to go yet: nothing moves.
    time.sleep(3)
    assert not Replica.objects.filter(model__name="small", draining=True).exclude(
        status__in=[ReplicaStatus.STOPPED, ReplicaStatus.STOPPING]).exists()
    # Back in service together: a spread tick between two uncordons would see only node02 back (it once did,
    # on a loaded machine, and moved the replica there: a node apart, not a fabric).
    with transaction.atomic():
        for name in ("node02", "node03", "node04"):
            node_uncordon(node_name=name)
    # Spread again, and the moved original gone (it stops once its replacement is ready).
    wait_until(lambda: len(set(_ready_nodes("small"))) == 2 and not Replica.objects.filter(
        model__name="small", status__in=[ReplicaStatus.READY, ReplicaStatus.STOPPING], draining=True).exists(),
        timeout=90, message="small spread again")
    nodes = _ready_nodes("small")
    assert "node01" in nodes and {n for n in nodes if n != "node01"} <= {"node03", "node04"}, nodes
    moved = Event.objects.filter(kind="replica.status", message__contains="to spread the model")
    assert moved.count() == 1, [e.message for e in moved]
    assert Replica.objects.filter(model__name="small", status=ReplicaStatus.READY).count() == 2
