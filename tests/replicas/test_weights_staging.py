"""A staging replica that cannot get its weights gives up
(replicas/weights_cache.py: staging_verdict, pure, and
replicas_staging_advance): a node that reports no room fails it at once, one
that makes no progress for LLMGW_STAGING_TIMEOUT fails it then; the reason
names the node and the cause, the reconcile places a replacement elsewhere
(weights_view keeps the node off those weights meanwhile), and a replica
that makes progress is left to finish."""

from __future__ import annotations

import time

import pytest

from replicas import reconcile
from replicas.choices import ReplicaStatus
from replicas.models import Replica
from replicas.placement import ClusterSnapshot, NodeSnapshot, PlacementRequest, Unplaceable
from replicas.services import members_report
from replicas.weights_cache import replicas_staging_advance, staging_verdict, weights_view
from replicas.weights_placement import WeightsNeed, WeightsView, place_weights
from nodes.models import Node
from tests.factories import node_with_gpus
from tests.replicas.test_weights_placement import cache_report, model

# --- pure ---------------------------------------------------------------------------------------


def stage(bytes_=0, error="", progressed=1000.0):
    return {"bytes": bytes_, "total": 3000, "rate": 0.0, "error": error, "progressed": progressed}


def test_no_space_gives_up_at_once_and_names_the_node():
    nodes = {"a": stage(1000), "b": stage(0, error="no space: needs 3000 more bytes")}
    assert staging_verdict(key="m@r1", nodes=nodes, holding=set(), now=1001.0, timeout=900) == (
        "b", "no space: needs 3000 more bytes")


def test_no_progress_for_the_timeout_gives_up_with_the_last_error():
    nodes = {"a": stage(1000, error="w.bin: ConnectionError: refused")}
    assert staging_verdict(key="m@r1", nodes=nodes, holding=set(), now=1899.0, timeout=900) is None
    node, cause = staging_verdict(key="m@r1", nodes=nodes, holding=set(), now=1900.0, timeout=900)
    assert node == "a"
    assert cause == ("no progress for 900s (LLMGW_STAGING_TIMEOUT), 1.0 kB of 3.0 kB fetched; "
                     "last error: w.bin: ConnectionError: refused")


def test_a_node_that_holds_the_weights_is_done_whatever_it_last_said():
    nodes = {"a": stage(0, error="no space: old", progressed=0.0)}
    assert staging_verdict(key="m@r1", nodes=nodes, holding={"a"}, now=10**6, timeout=900) is None


def test_a_node_that_could_not_stage_lately_is_not_a_candidate_and_the_reason_says_so():
    need = WeightsNeed(key="m@r1", total=3000)
    snapshot = ClusterSnapshot([NodeSnapshot(n, free_gpus=tuple(range(8)), total_gpus=8) for n in ("a", "b")])
    view = WeightsView(caches={"a", "b"}, room={"a": 10**6, "b": 10**6},
                       failed={("a", "m@r1"): "no progress for 900s"})
    assert place_weights(PlacementRequest("m", 1, 8), snapshot, view, need).nodes == ("b",)
    view.failed[("b", "m@r1")] = "no space: needs 3000 more bytes"
    result = place_weights(PlacementRequest("m", 1, 8), snapshot, view, need)
    assert isinstance(result, Unplaceable)
    assert ("could not stage them lately (tried again after LLMGW_STAGING_TIMEOUT): a (no progress for 900s), "
            "b (no space: needs 3000 more bytes)") in result.reason
    # A holder is a holder: the failure was about fetching.
    view.holders["m@r1"] = {"a"}
    assert place_weights(PlacementRequest("m", 1, 8), snapshot, view, need).nodes == ("a",)


# --- on the control plane -----------------------------------------------------------------------


def staging_replica():
    """Two nodes with room; the model's replica staging on one of them: (replica, its node, the other)."""
    for name in ("node01", "node02"):
        node_with_gpus(name)
        cache_report(name)
    model()
    reconcile.replicas_reconcile()
    replica = Replica.objects.get()
    assert replica.status == ReplicaStatus.STAGING
    (here,) = replica.members.values_list("node__name", flat=True)
    return replica, here, ({"node01", "node02"} - {here}).pop()


def replaced_on(failed: Replica, here: str) -> Replica:
    """The reconcile after the failure (its GPUs freed by the agent's next
    heartbeat) places a replacement; returns it."""
    members_report(node=Node.objects.get(name=here), engines=[])
    reconcile.replicas_reconcile()
    failed.refresh_from_db()
    assert failed.status == ReplicaStatus.STOPPED
    return Replica.objects.exclude(pk=failed.pk).get()


def shift_progress(replica: Replica, seconds: float) -> None:
    state = dict(replica.staging)
    state["nodes"] = {n: {**v, "progressed": v["progressed"] - seconds} for n, v in state["nodes"].items()}
    Replica.objects.filter(pk=replica.pk).update(staging=state)


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_a_node_reporting_no_room_fails_the_replica_and_it_is_replaced_elsewhere():
    replica, here, other = staging_replica()
    cache_report(here, partial=0, error="no space: needs 3000 more bytes, the cache has 100 free")
    replica.refresh_from_db()
    assert replica.status == ReplicaStatus.FAILED
    assert replica.failed_reason == (f"{here} cannot stage m@r1: no space: needs 3000 more bytes, the cache has "
                                     "100 free; a replacement is placed elsewhere")
    replacement = replaced_on(replica, here)
    assert replacement.status == ReplicaStatus.STAGING
    assert list(replacement.members.values_list("node__name", flat=True)) == [other]


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_no_progress_past_the_timeout_fails_the_replica_and_it_is_replaced_elsewhere(settings):
    settings.LLMGW_STAGING_TIMEOUT = 60
    replica, here, other = staging_replica()
    cache_report(here, partial=1000, error="w.bin: ConnectionError: refused")
    replicas_staging_advance(now=time.time() + 50)
    replica.refresh_from_db()
    assert replica.status == ReplicaStatus.STAGING
    replicas_staging_advance(now=time.time() + 61)
    replica.refresh_from_db()
    assert replica.status == ReplicaStatus.FAILED
    assert replica.failed_reason.startswith(f"{here} cannot stage m@r1: no progress for 6")
    assert ("(LLMGW_STAGING_TIMEOUT), 1.0 kB of 3.0 kB fetched; last error: w.bin: ConnectionError: refused; "
            "a replacement is placed elsewhere") in replica.failed_reason
    # Its node has GPUs and room, but is not chosen for these weights for LLMGW_STAGING_TIMEOUT.
    assert set(weights_view().failed) == {(here, "m@r1")}
    replacement = replaced_on(replica, here)
    assert replacement.status == ReplicaStatus.STAGING
    assert list(replacement.members.values_list("node__name", flat=True)) == [other]


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_a_replica_making_progress_is_not_failed(settings):
    settings.LLMGW_STAGING_TIMEOUT = 60
    replica, here, _ = staging_replica()
    cache_report(here, partial=1000)
    replica.refresh_from_db()
    shift_progress(replica, 59)
    # An error that changes, no byte more: not progress.
    cache_report(here, partial=1000, error="w.bin: ConnectionError: refused")
    replica.refresh_from_db()
    assert time.time() - replica.staging["nodes"][here]["progressed"] >= 59
    # More bytes: the clock starts again, however long it waited before.
    cache_report(here, partial=2000)
    replicas_staging_advance(now=time.time() + 30)
    replica.refresh_from_db()
    assert replica.status == ReplicaStatus.STAGING
    reconcile.replicas_reconcile()
    assert Replica.objects.get().status == ReplicaStatus.STAGING
    cache_report(here, complete=True)
    assert Replica.objects.get().status == ReplicaStatus.STARTING
