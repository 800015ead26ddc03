"""Placement that knows where the weights are (replicas/weights_placement.py,
pure), and staging on the control plane (replicas/weights_cache.py):
holders first whenever a replica fits among them, a node without room never
chosen and the reason says so, scheduled -> staging -> starting with
progress, and the desired state that tells the agents."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.protocol import WEIGHTS_PATH_ARG
from core.models import Event
from replicas import reconcile
from replicas.choices import ReplicaStatus
from replicas.models import CachedWeights, CatalogEntry, NodeCache, Replica
from replicas.placement import ClusterSnapshot, NodeSnapshot, Placement, PlacementRequest, Unplaceable
from replicas.selectors import node_desired_members
from replicas.weights_cache import node_desired_weights, node_weights_report, weights_view
from replicas.weights_placement import WeightsNeed, WeightsView, place_weights
from tests.factories import node_with_gpus

GB = 10**9
NEED = WeightsNeed(key="m@abc", total=140 * GB)


def snap(*names, fabric=None, free=8):
    return ClusterSnapshot([NodeSnapshot(n, fabrics=(fabric,) if fabric else (), free_gpus=tuple(range(free)),
                                         total_gpus=8) for n in names])


def view(holders=(), room=None, caches=None):
    room = room or {}
    return WeightsView(caches=set(caches if caches is not None else room), holders={NEED.key: set(holders)},
                       room=dict(room))


# --- pure ---------------------------------------------------------------------------------------


def test_a_holder_is_chosen_over_a_better_fit_without_the_weights():
    snapshot = ClusterSnapshot([NodeSnapshot("a", free_gpus=(0, 1), total_gpus=8),  # best fit for 2
                                NodeSnapshot("b", free_gpus=tuple(range(8)), total_gpus=8)])
    result = place_weights(PlacementRequest("m", 1, 2), snapshot, view(holders={"b"}, room={"a": 200 * GB}), NEED)
    assert isinstance(result, Placement) and result.nodes == ("b",)


def test_without_a_holder_only_nodes_with_room_are_candidates_and_the_reason_names_the_others():
    snapshot = snap("a", "b", "c")
    v = view(room={"a": 10 * GB, "b": 500 * GB}, caches={"a", "b"})
    result = place_weights(PlacementRequest("m", 1, 8), snapshot, v, NEED)
    assert isinstance(result, Placement) and result.nodes == ("b",)
    v = view(room={"a": 10 * GB, "b": 100 * GB}, caches={"a", "b"})
    result = place_weights(PlacementRequest("m", 1, 8), snapshot, v, NEED)
    assert isinstance(result, Unplaceable)
    assert "too little free space for the weights: a: 10.0 GB free, b: 100.0 GB free" in result.reason
    assert "keep no weights cache (agent.yaml 'weights'): c" in result.reason


def test_weights_placed_by_hand_go_only_to_nodes_that_report_them():
    need = WeightsNeed(key=NEED.key, total=0, fetchable=False)
    snapshot = snap("a", "b")
    assert place_weights(PlacementRequest("m", 1, 8), snapshot, view(holders={"b"}, room={"a": 10**15}), need).nodes == ("b",)
    result = place_weights(PlacementRequest("m", 1, 8), snapshot, view(room={"a": 10**15}), need)
    assert isinstance(result, Unplaceable) and "placed by hand" in result.reason


def test_partial_bytes_count_toward_what_is_left_to_fetch():
    v = view(room={"a": 50 * GB}, caches={"a"})
    v.partial[("a", NEED.key)] = 100 * GB
    assert place_weights(PlacementRequest("m", 1, 8), snap("a"), v, NEED).nodes == ("a",)


@settings(max_examples=150, deadline=None)
@given(
    frees=st.lists(st.integers(0, 8), min_size=2, max_size=8),
    held=st.lists(st.booleans(), min_size=8, max_size=8),
    rooms=st.lists(st.sampled_from([0, 50 * GB, 200 * GB]), min_size=8, max_size=8),
    nodes=st.integers(1, 3), gpus=st.sampled_from([1, 2, 4, 8]),
)
def test_holders_are_picked_every_time_one_fits_and_a_node_without_room_never(frees, held, rooms, nodes, gpus):
    names = [f"n{i}" for i in range(len(frees))]
    snapshot = ClusterSnapshot([NodeSnapshot(n, fabrics=("ib-a",), free_gpus=tuple(range(f)), total_gpus=8)
                                for n, f in zip(names, frees)])
    holders = {n for n, h in zip(names, held) if h}
    v = view(holders=holders, room=dict(zip(names, rooms)))
    request = PlacementRequest("m", nodes, gpus)
    result = place_weights(request, snapshot, v, NEED)
    holders_fit = sum(1 for n, f in zip(names, frees) if n in holders and f >= gpus) >= nodes
    if holders_fit:
        assert isinstance(result, Placement) and set(result.nodes) <= holders
    if isinstance(result, Placement):
        assert all(n in holders or v.room[n] >= NEED.total for n in result.nodes)
    else:
        able = sum(1 for n, f in zip(names, frees) if f >= gpus and (n in holders or v.room[n] >= NEED.total))
        assert able < nodes


# --- on the control plane -----------------------------------------------------------------------

pytestmark_db = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue")]

MANIFEST = {"kind": "http", "revision": "r1", "total_bytes": 3000,
            "files": [{"name": "w.bin", "size": 3000, "sha256": "a" * 64, "url": "http://127.0.0.1:9/w.bin"}]}


def cache_report(node, *, free=10**6, complete=None, partial=None, error=""):
    models = [{"model": "m", "revision": "r1", "bytes": 3000, "total": 3000, "complete": True, "rate": 0.0,
               "error": ""}] if complete else []
    if partial is not None:
        models = [{"model": "m", "revision": "r1", "bytes": partial, "total": 3000, "complete": False,
                   "rate": 1000.0, "error": error}]
    node_weights_report(node_name=node, report={"free_bytes": free, "budget_bytes": 10**7, "used_bytes": 0,
                                                "downloads": 1 if partial is not None else 0, "models": models})


def model(**kwargs):
    return CatalogEntry.objects.create(name="m", engine="sim", weights="/models/m", replicas=1,
                                       source={"kind": "http", "url": "http://127.0.0.1:9/"}, manifest=MANIFEST,
                                       **kwargs)


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_a_replica_goes_to_the_node_that_holds_its_weights():
    for name in ("node01", "node02", "node03"):
        node_with_gpus(name)
        cache_report(name, complete=(name == "node02"))
    model()
    reconcile.replicas_reconcile()
    replica = Replica.objects.get()
    assert replica.status == ReplicaStatus.SCHEDULED
    assert [m.node.name for m in replica.members.all()] == ["node02"]
    (member,) = node_desired_members(node_name="node02")
    assert member["weights"] == "m@r1" and WEIGHTS_PATH_ARG in member["argv"]
    assert member["argv"][member["argv"].index("--weights") + 1] == WEIGHTS_PATH_ARG


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_a_node_without_space_is_never_chosen_and_the_reason_says_so():
    node_with_gpus("node01")
    cache_report("node01", free=100)
    model()
    reconcile.replicas_reconcile()
    replica = Replica.objects.get()
    assert replica.status == ReplicaStatus.PENDING
    assert "too little free space for the weights: node01: 100 B free" in replica.pending_reason
    # Weights no replica uses may be evicted: they count as room.
    CachedWeights.objects.create(node=NodeCache.objects.get().node, model="old", revision="x", bytes=5000,
                                 total=5000, complete=True)
    assert weights_view().room["node01"] == 5100
    reconcile.replicas_reconcile()
    assert Replica.objects.get().status == ReplicaStatus.STAGING


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_staging_then_starting_with_progress_events_and_desired_state():
    node_with_gpus("node01")
    cache_report("node01")
    model()
    reconcile.replicas_reconcile()
    replica = Replica.objects.get()
    assert replica.status == ReplicaStatus.STAGING
    assert "fetching m@r1 (3000 bytes) on node01" in replica.status_reason
    # While staging the agent is told what to fetch, not what to run.
    assert node_desired_members(node_name="node01") == []
    (weights,) = node_desired_weights(node_name="node01")
    assert weights["files"] == [{k: MANIFEST["files"][0][k] for k in ("name", "size", "sha256", "url")}]
    cache_report("node01", partial=1500)
    replica.refresh_from_db()
    assert replica.staging["bytes"] == 1500 and replica.staging["total"] == 3000
    assert replica.staging["rate"] == 1000.0 and replica.staging["eta"] == 1.5
    assert Event.objects.filter(kind="weights", message__contains="50% staged").exists()
    # An error the agent retries is a warning (no space fails it: tests/replicas/test_weights_staging.py).
    cache_report("node01", partial=1500, error="w.bin: ConnectionError: refused")
    assert Event.objects.filter(kind="weights", message__contains="node01 cannot stage m@r1: w.bin: Conn").exists()
    assert Replica.objects.get().status == ReplicaStatus.STAGING
    cache_report("node01", complete=True)
    replica.refresh_from_db()
    assert replica.status == ReplicaStatus.STARTING and "weights m@r1 staged on node01" in replica.status_reason
    assert [m["weights"] for m in node_desired_members(node_name="node01")] == ["m@r1"]
    moves = [(e["from"], e["to"]) for e in Event.objects.filter(kind="replica.status", data__has_key="from").order_by("pk")
             .values_list("data", flat=True)]
    assert moves == [("pending", "scheduled"), ("scheduled", "staging"), ("staging", "starting")]


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_in_place_weights_are_looked_for_on_every_node():
    node_with_gpus("node01")
    CatalogEntry.objects.create(name="byhand", engine="sim", weights="/models/byhand", replicas=1,
                                source={"kind": "none"}, manifest={"kind": "none", "revision": "local",
                                                                   "path": "/models/byhand", "files": [],
                                                                   "total_bytes": 0})
    assert node_desired_weights(node_name="node01") == [
        {"model": "byhand", "revision": "local", "files": [], "path": "/models/byhand"}]
    reconcile.replicas_reconcile()
    replica = Replica.objects.get()
    assert replica.status == ReplicaStatus.PENDING and "placed by hand" in replica.pending_reason


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
@pytest.mark.parametrize(("engine", "flag"), [("vllm", "serve"), ("sglang", "--model-path"), ("sim", "--weights")])
def test_engines_are_given_the_local_path_of_managed_weights(engine, flag):
    node_with_gpus("node01")
    cache_report("node01", complete=True)
    CatalogEntry.objects.create(name="m", engine=engine, weights="org/m", replicas=1, manifest=MANIFEST,
                                source={"kind": "http", "url": "http://127.0.0.1:9/"})
    reconcile.replicas_reconcile()
    (member,) = node_desired_members(node_name="node01")
    assert member["argv"][member["argv"].index(flag) + 1] == WEIGHTS_PATH_ARG  # the agent puts the path in
    assert "org/m" not in member["argv"]
