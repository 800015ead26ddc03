"""A drain says what it waits for, and "blocked" only when nothing under way
can free what it needs (issue 25, item 2): the printed log of
``llmgw ctl drain NODE --wait`` against the real web process, while this
test plays the reconcile and the agents' reports (as tests/replicas/test_drains.py
does) until the drain ends."""

from __future__ import annotations

import subprocess
import time

import pytest

from replicas import reconcile
from replicas.choices import ReplicaStatus
from replicas.drainwait import Release, replacement_wait
from replicas.models import Member, Replica
from replicas.snapshot import NodeSnapshot, PlacementRequest
from tests.conftest import REPO, server_env
from tests.factories import CatalogEntryFactory, node_with_gpus
from tests.replicas.test_drains import _report_all

pytestmark = pytest.mark.django_db(transaction=True)

LLMGW = str(REPO / ".venv" / "bin" / "llmgw")


@pytest.fixture(autouse=True)
def _settle(settings):
    # A replaced original keeps its GPUs this long (routing settles, then it
    # stops), as on a real cluster: the drain's next replica finds them held.
    settings.LLMGW_ROUTING_SETTLE = 2


def _drain_wait(web, token, tmp_path, node: str, timeout: float = 90) -> tuple[int, str]:
    """Run ``ctl drain NODE --wait`` while the control plane's loop turns here."""
    env = server_env(LLMGW_URL=web.url, LLMGW_TOKEN=token, LLMGW_DATA_DIR=str(tmp_path / "nowhere"))
    proc = subprocess.Popen([LLMGW, "ctl", "drain", node, "--wait", "--timeout", str(timeout)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout + 30
        while proc.poll() is None and time.monotonic() < deadline:
            reconcile.replicas_reconcile()
            _report_all()
            time.sleep(0.3)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, output


def test_the_first_move_frees_the_seconds_gpus_and_the_log_says_so(web_factory, admin_token, tmp_path,
                                                                   no_reconcile_enqueue):
    """node01 holds 'pair' (with node02) and 'solo'. Draining node01 moves
    'pair' to node03+node04 first; 'solo' fits only on node02, whose GPUs
    'pair''s original gives back once it stops. Never blocked: waiting."""
    node_with_gpus("node01", gpus=8, fabric="ib-a", addr="127.0.1.1")
    node_with_gpus("node02", gpus=4, fabric="ib-a", addr="127.0.1.2")
    CatalogEntryFactory(name="pair", nodes=2, gpus_per_node=4, replicas=1)
    CatalogEntryFactory(name="solo", nodes=1, gpus_per_node=4, replicas=1)
    for _ in range(3):
        reconcile.replicas_reconcile()
        _report_all()
    pair = Replica.objects.get(model__name="pair", status=ReplicaStatus.READY)
    solo = Replica.objects.get(model__name="solo", status=ReplicaStatus.READY)
    assert pair.pk < solo.pk
    assert {m.node.name for m in Member.objects.filter(replica=solo).select_related("node")} == {"node01"}
    node_with_gpus("node03", gpus=4, fabric="ib-a", addr="127.0.1.3")
    node_with_gpus("node04", gpus=4, fabric="ib-a", addr="127.0.1.4")

    rc, output = _drain_wait(web_factory(), admin_token, tmp_path, "node01")

    assert rc == 0, output
    assert "blocked" not in output and "cannot be moved" not in output, output
    assert (f"solo replica {solo.pk}: its replacement does not fit yet, waiting for pair replica {pair.pk}'s move "
            f"off node01 to release 4 GPUs on node02") in output, output
    assert "done: 2 replica(s) moved" in output, output
    moved = Replica.objects.get(model__name="solo", status=ReplicaStatus.READY)
    assert {m.node.name for m in Member.objects.filter(replica=moved).select_related("node")} == {"node02"}


def test_a_truly_blocked_drain_still_says_blocked(web_factory, admin_token, tmp_path, no_reconcile_enqueue):
    """'wide' needs 6 GPUs on one node; node02 has 4, and nothing under way
    frees more: the drain is blocked and says so."""
    node_with_gpus("node01", gpus=8, addr="127.0.1.1")
    CatalogEntryFactory(name="wide", gpus_per_node=6, replicas=1)
    reconcile.replicas_reconcile()
    _report_all()
    node_with_gpus("node02", gpus=4, addr="127.0.1.2")

    rc, output = _drain_wait(web_factory(), admin_token, tmp_path, "node01")

    assert rc == 1, output
    assert "blocked: 1 replica(s) cannot be moved anywhere" in output, output
    assert "the drain of node01 is blocked" in output, output
    assert "waiting for" not in output, output


# --- the decision alone ----------------------------------------------------------


def _nodes(**free: tuple[int, ...]) -> list[NodeSnapshot]:
    return [NodeSnapshot(name, fabrics=("ib-a",), free_gpus=gpus, total_gpus=4) for name, gpus in free.items()]


def test_the_release_that_makes_it_fit_is_named_and_one_that_does_not_is_not():
    request = PlacementRequest("solo", 1, 4)
    nodes = _nodes(node02=(), node03=(0, 1))
    small = Release("qwen replica 3, stopping,", (("node03", (2,)),))
    big = Release("pair replica 1's move off node01", (("node02", (0, 1, 2, 3)),))
    assert replacement_wait(request, nodes, [small]) is None
    assert replacement_wait(request, nodes, [small, big]) == (
        "waiting for pair replica 1's move off node01 to release 4 GPUs on node02")
    # Two releases that fit only together are both named.
    half = Release("x replica 9, stopping,", (("node03", (3,)),))
    assert replacement_wait(request, nodes, [small, half]) == (
        "waiting for qwen replica 3, stopping, to release 1 GPU on node03; "
        "x replica 9, stopping, to release 1 GPU on node03")
    assert replacement_wait(request, _nodes(node02=(0, 1, 2, 3)), []) == "its replacement fits now and is being placed"
