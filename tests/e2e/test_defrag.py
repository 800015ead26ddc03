"""The demo's story on its own catalog and topology: node02 dies, and its
llama replica comes back on ib-b because the 1-GPU qwen replica in its way is
moved first (replacement ready, then the original stopped), with a steady
stream of requests to qwen through the gateway and none failing."""

from __future__ import annotations

import time

import httpx
import pytest
import yaml

from cli.demo import SAMPLE_CATALOG
from cli.wait import wait_until
from core.models import Event
from nodes.choices import NodeStatus
from nodes.models import Node
from replicas.catalog import catalog_apply
from replicas.choices import ReplicaStatus
from replicas.models import Member, Replica
from tests.e2e.sim import GRACE, fast_env
from tests.e2e.test_drain_traffic import Traffic

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# From node02 declared lost to the replacement ready: the move's replacement
# starting and passing its health check, the original's routing settling and
# its engine stopping, then the llama replica starting: seconds, generously bounded.
READY_AFTER_LOST = 60


def _ready(model: str, **filters) -> int:
    return Replica.objects.filter(model__name=model, status=ReplicaStatus.READY, **filters).count()


def test_demo_node02_killed_llama_comes_back_on_ib_b_after_one_move(sim_cluster, web_factory):
    cluster = sim_cluster()  # the demo's four nodes: node01+node02 on ib-a, node03+node04 on ib-b, 8 GPUs each
    web = web_factory(LLMGW_GATEWAY_OPEN="1", **fast_env())
    catalog_apply(entries=yaml.safe_load(SAMPLE_CATALOG)["models"], prune=False)
    wait_until(lambda: _ready("llama-70b-sim") == 2 and _ready("qwen-7b-sim") == 2, timeout=90,
               message="the demo's catalog ready")
    qwen_nodes = sorted(Member.objects.filter(replica__model__name="qwen-7b-sim").values_list("node__name", flat=True))
    assert qwen_nodes == ["node01", "node03"]  # as the demo places them: node03 left with 3 free
    wait_until(lambda: httpx.get(f"{web.url}/v1/models", timeout=5).json()["data"], timeout=10,
               message="the gateway to route")

    with Traffic(web.url, model="qwen-7b-sim", limit=180) as traffic:
        traffic.wait_served(10, what="before the kill")
        cluster.kill_node("node02")
        wait_until(lambda: Node.objects.get(name="node02").status == NodeStatus.LOST, timeout=GRACE + 20,
                   message="node02 declared lost")
        lost_at = time.monotonic()
        wait_until(lambda: _ready("llama-70b-sim", fabric__name="ib-b") == 2, timeout=READY_AFTER_LOST,
                   message="the llama replacement ready on ib-b")
        took = time.monotonic() - lost_at
        # Served on after the move and the replacement: qwen from where it was moved to.
        traffic.wait_served(10, after=time.monotonic(), what="after the llama replacement was ready")

    moved = Event.objects.get(message__startswith="moving qwen-7b-sim replica")
    replacement = Replica.objects.filter(model__name="llama-70b-sim", fabric__name="ib-b").order_by("-id").first()
    assert moved.message.startswith(
        f"moving qwen-7b-sim replica {moved.data['replica']} from node03 to node01 to make room for "
        f"llama-70b-sim replica {replacement.pk} on ib-b"
    )
    original = Replica.objects.get(pk=moved.data["replica"])
    assert original.status == ReplicaStatus.STOPPED
    scheduled = Event.objects.get(subject=f"replica/{replacement.pk}", message__contains="pending -> scheduled")
    stopped = Event.objects.get(subject=f"replica/{original.pk}", message__contains="ready -> stopping")
    assert moved.created_at < stopped.created_at < scheduled.created_at
    assert set(Member.objects.filter(replica=replacement).values_list("node__name", flat=True)) == {"node03", "node04"}
    assert _ready("qwen-7b-sim") == 2
    assert len(traffic.results) > 50, "too little traffic to mean anything"
    assert traffic.failures() == []
    print(f"llama replacement ready on ib-b {took:.1f}s after node02 was declared lost")
