"""A rollout to new weights stages them first: the pure targets and gate,
and the service on PostgreSQL with the nodes' weights reports as their
agents send them (the sources resolved from a loopback file server)."""

from __future__ import annotations

import pytest

from core.models import Event
from nodes import hooks
from replicas import rollout
from replicas.catalog import catalog_apply
from replicas.choices import ReplicaStatus, RolloutStatus
from replicas.models import Replica, Rollout, StagedWeights
from replicas.rollout_weights import NodeStage, staging_gate, staging_targets
from replicas.selectors import node_desired_members
from replicas.weights_cache import node_desired_weights, node_weights_report
from replicas.weights_placement import WeightsNeed, WeightsView
from tests.factories import node_with_gpus
from tests.replicas.test_rollout import _settle
from tests.weightservers import WeightsServer

FILES = {"r1": {"w.bin": b"1" * 3000}, "r2": {"w.bin": b"2" * 4000}}


def test_targets_are_the_originals_spares_and_landing_nodes_with_room():
    view = WeightsView(caches={"a", "b", "c", "d"}, room={"a": 10_000, "b": 10_000, "c": 10, "d": 10_000})
    need = WeightsNeed("m@r2", 4000)
    nodes, left = staging_targets(originals=["b", "a"], staged=["c"], landing=["a", "e"], view=view, need=need)
    assert nodes == ["a", "b"] and left == ["c", "e"]  # c: no room; e: no cache; d: not a likely node


def test_the_gate_waits_with_progress_then_passes_and_fails_on_no_space_or_a_lasting_error():
    def node(name, **kw):
        return NodeStage(name, total=100_000_000, **kw)

    waiting = staging_gate(key="m@r2", nodes=[node("a", complete=True), node("b", bytes=40_000_000, rate=10e6),
                                              node("c")], now=100.0, grace=30)
    assert waiting.waiting == ("staging weights m@r2: 1 of 3 nodes, 140.0 MB of 300.0 MB, about 6s left; "
                               "the old replicas keep serving") and not waiting.failed
    assert staging_gate(key="m@r2", nodes=[node("a", complete=True)], now=0, grace=30).waiting == ""
    retrying = staging_gate(key="m@r2", nodes=[node("a", error="HTTP 503 from the source", error_since=90.0)],
                            now=100.0, grace=30)
    assert "(retrying: a: HTTP 503 from the source)" in retrying.waiting and not retrying.failed
    lasting = staging_gate(key="m@r2", nodes=[node("a", error="HTTP 503 from the source", error_since=60.0)],
                           now=100.0, grace=30)
    assert lasting.failed == "a cannot stage m@r2: HTTP 503 from the source (for 40s)"
    full = staging_gate(key="m@r2", nodes=[node("a", error="no space: needs 100 more bytes", error_since=100.0)],
                        now=100.0, grace=30)
    assert full.failed.startswith("a cannot stage m@r2: no space")


def _report(node, *, holds=(), fetching=None, free=10**6):
    """What node's agent says of its cache: revisions held, one being fetched."""
    size = {r: len(FILES[r]["w.bin"]) for r in FILES}
    models = [{"model": "m", "revision": r, "bytes": size[r], "total": size[r], "complete": True, "rate": 0.0,
               "error": ""} for r in holds]
    if fetching:
        models.append({"model": "m", "revision": "r2", "total": 4000, "complete": False, "rate": 1000.0,
                       "bytes": 0, "error": "", **fetching})
    report = {"free_bytes": free, "budget_bytes": 10**7, "used_bytes": 0, "downloads": 0, "models": models}
    for handler in hooks.weights_report_handlers:  # as a heartbeat whose report changed calls them
        handler(node_name=node, report=report)
    assert node_weights_report in hooks.weights_report_handlers


@pytest.fixture
def served():
    with WeightsServer() as server:
        urls = {rev: server.add_files(f"m-{rev}", files, revision=rev) for rev, files in FILES.items()}
        yield server, urls


@pytest.fixture
def running(served, settings, no_reconcile_enqueue):
    """Three nodes of 4 GPUs holding m@r1, two replicas of m ready on r1."""
    settings.LLMGW_ROUTING_SETTLE = 0
    _, urls = served
    for i in range(3):
        node_with_gpus(f"node{i + 1:02d}", gpus=4, addr=f"127.0.1.{i + 1}")
        _report(f"node{i + 1:02d}", holds=["r1"])
    entry = {"name": "m", "engine": "sim", "model": "/models/m", "nodes": 1, "gpus_per_node": 4, "replicas": 2,
             "source": {"kind": "http", "url": urls["r1"]}}
    catalog_apply(entries=[entry])
    _settle(3)
    ready = list(Replica.objects.filter(status=ReplicaStatus.READY))
    assert len(ready) == 2
    return entry, urls, {m.node.name for r in ready for m in r.members.select_related("node")}


@pytest.mark.django_db
def test_new_weights_are_staged_on_the_likely_nodes_before_the_first_replacement(running):
    entry, urls, serving = running
    catalog_apply(entries=[{**entry, "source": {"kind": "http", "url": urls["r2"]}}])
    rollout.rollouts_step()
    current = Rollout.objects.get()
    # The two originals' nodes and the free one a surge lands on, asked through StagedWeights.
    assert sorted(current.staging["nodes"]) == ["node01", "node02", "node03"]
    assert set(StagedWeights.objects.values_list("why", flat=True)) == {"rollout"}
    assert current.waiting_for.startswith("staging weights m@r2: 0 of 3 nodes, 0 B of 12.0 kB")
    assert not Replica.objects.filter(rolling=True).exists() and not Replica.objects.filter(revision__number=2).exists()
    # An original keeps its own weights (r1); its node fetches r2 beside them.
    node = sorted(serving)[0]
    assert {m["weights"] for m in node_desired_members(node_name=node)} == {"m@r1"}
    assert [w["revision"] for w in node_desired_weights(node_name=node)] == ["r1", "r2"]

    _report("node01", holds=["r1", "r2"])
    _report("node02", holds=["r1"], fetching={"bytes": 1000})
    rollout.rollouts_step()
    current.refresh_from_db()
    assert current.waiting_for.startswith("staging weights m@r2: 1 of 3 nodes, 5.0 kB of 12.0 kB, about 3s left")
    assert not Replica.objects.filter(rolling=True).exists()

    for name in ("node02", "node03"):
        _report(name, holds=["r1", "r2"])
    _settle(16)
    done = Rollout.objects.get()
    assert done.status == RolloutStatus.DONE, done.waiting_for
    staged_at = next(i for i, line in enumerate(done.log) if "weights m@r2 staged on node01, node02, node03" in line)
    assert staged_at < next(i for i, line in enumerate(done.log) if "replacing replica" in line)
    replacements = list(Replica.objects.filter(revision__number=2, status=ReplicaStatus.READY))
    assert len(replacements) == 2
    for replica in replacements:
        moves = [(e["from"], e["to"]) for e in Event.objects.filter(subject=f"replica/{replica.pk}", kind="replica.status")
                 .values_list("data", flat=True) if "from" in e]
        assert ("scheduled", "staging") not in moves, moves
    assert not StagedWeights.objects.exists()  # the rollout's rows went with it


@pytest.mark.django_db
def test_no_space_fails_the_rollout_and_the_old_replicas_serve(running):
    entry, urls, serving = running
    old = set(Replica.objects.filter(status=ReplicaStatus.READY).values_list("pk", flat=True))
    catalog_apply(entries=[{**entry, "source": {"kind": "http", "url": urls["r2"]}}])
    rollout.rollouts_step()
    _report("node02", holds=["r1"], fetching={"error": "no space: needs 4000 more bytes, the cache has 10 free"})
    rollout.rollouts_step()
    failed = Rollout.objects.get()
    assert failed.status == RolloutStatus.FAILED
    assert failed.status_reason == ("the new weights could not be staged: node02 cannot stage m@r2: no space: needs "
                                    "4000 more bytes, the cache has 10 free; the old replicas keep serving")
    _settle(3)
    assert set(Replica.objects.filter(status=ReplicaStatus.READY).values_list("pk", flat=True)) == old
    assert not Replica.objects.filter(revision__number=2).exists() and not StagedWeights.objects.exists()
    # Resumed once the space is freed: staged again from the start.
    _report("node02", holds=["r1"], fetching={"bytes": 0})
    rollout.rollout_resume(name="m", actor="ops")
    rollout.rollouts_step()
    again = Rollout.objects.get()
    assert again.status == RolloutStatus.RUNNING and again.waiting_for.startswith("staging weights m@r2: 0 of 3")


@pytest.mark.django_db
def test_an_error_that_lasts_fails_it_after_the_grace(running, settings):
    settings.LLMGW_ROLLOUT_STAGING_GRACE = 0
    entry, urls, _ = running
    catalog_apply(entries=[{**entry, "source": {"kind": "http", "url": urls["r2"]}}])
    rollout.rollouts_step()
    _report("node03", fetching={"error": "w.bin: sha256 mismatch (fetching again)"})
    rollout.rollouts_step()
    failed = Rollout.objects.get()
    assert failed.status == RolloutStatus.FAILED
    assert "node03 cannot stage m@r2: w.bin: sha256 mismatch (fetching again)" in failed.status_reason


@pytest.mark.django_db
def test_a_change_that_keeps_the_weights_stages_nothing(running):
    entry, _, _ = running
    catalog_apply(entries=[{**entry, "args": ["--token-delay", "0.01"]}])
    rollout.rollouts_step()
    assert Rollout.objects.get().staging.get("done") and not StagedWeights.objects.exists()
    assert Replica.objects.filter(rolling=True).exists()


@pytest.mark.django_db
def test_paused_it_keeps_staging_and_a_failure_waits_for_resume(running):
    entry, urls, _ = running
    catalog_apply(entries=[{**entry, "source": {"kind": "http", "url": urls["r2"]}}])
    rollout.rollouts_step()
    rollout.rollout_pause(name="m", actor="ops")
    _report("node01", holds=["r1"], fetching={"bytes": 2000})
    rollout.rollouts_step()
    paused = Rollout.objects.get()
    assert paused.status == RolloutStatus.PAUSED
    assert paused.waiting_for.startswith("paused; staging weights m@r2: 0 of 3 nodes, 2.0 kB of 12.0 kB")
    _report("node01", holds=["r1"], fetching={"error": "no space: needs 2000 more bytes"})
    rollout.rollouts_step()
    paused.refresh_from_db()
    assert paused.status == RolloutStatus.PAUSED and paused.waiting_for.startswith(
        "paused; staging failed (node01 cannot stage m@r2: no space")
    _report("node01", holds=["r1"], fetching={"bytes": 2000})  # room made
    rollout.rollout_resume(name="m", actor="ops")
    rollout.rollouts_step()
    resumed = Rollout.objects.get()
    assert resumed.status == RolloutStatus.RUNNING and resumed.waiting_for.startswith("staging weights m@r2: 0 of 3")
    assert StagedWeights.objects.filter(why="rollout").count() == 3
    # Short of space again: running, it fails at once, and its rows go.
    _report("node01", holds=["r1"], fetching={"error": "no space: needs 2000 more bytes"})
    rollout.rollouts_step()
    assert Rollout.objects.get().status == RolloutStatus.FAILED
    assert not StagedWeights.objects.exists()
