"""A model kept spread (issue 27): the pure decisions of replicas.spread,
and through the services: a scale-down stops the replica whose loss best
keeps the model spread; two replicas sharing a node are spread again by a
move, replacement first, explained in an Event, off with LLMGW_SPREAD=0."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.models import Event
from nodes.services import node_cordon, node_uncordon
from replicas import reconcile
from replicas.choices import ReplicaStatus
from replicas.models import Replica
from replicas.snapshot import NodeSnapshot, PlacementRequest
from replicas.spread import SpreadReplica, crowding, removal_order, respread
from tests.factories import CatalogEntryFactory

from .test_services import _no_settle, _placement, _report, seeds_cluster  # noqa: F401 - fixtures


def test_removal_order_stops_a_crowded_replica_before_the_newest_spread_one():
    replicas = [SpreadReplica(1, "ib-a", ("node01",)), SpreadReplica(2, "ib-a", ("node01",)),
                SpreadReplica(3, "ib-b", ("node03",))]
    assert removal_order(replicas)[0] == 2
    # Equally spread: one not yet ready goes first, then the newest.
    spread = [SpreadReplica(1, "ib-a", ("node01",)), SpreadReplica(2, "ib-b", ("node03",), ready=False),
              SpreadReplica(3, None, ("island1",))]
    assert removal_order(spread) == [2, 3, 1]


@given(st.lists(st.sampled_from(["node01", "node02", "node03"]), min_size=1, max_size=6))
def test_what_a_scale_down_keeps_is_as_spread_as_it_can_be(placed):
    fabric = {"node01": "ib-a", "node02": "ib-a", "node03": "ib-b"}
    replicas = [SpreadReplica(i, fabric[n], (n,)) for i, n in enumerate(placed, start=1)]
    order = removal_order(replicas)
    assert sorted(order) == [r.id for r in replicas]
    for keep in range(1, len(replicas)):
        kept = [r for r in replicas if r.id in order[len(order) - keep:]]
        # As many distinct nodes as there can be among the replicas on offer.
        assert len({r.nodes[0] for r in kept}) == min(keep, len(set(placed)))


def _nodes(**free):
    fabric = {"node01": "ib-a", "node02": "ib-a", "node03": "ib-b", "node04": "ib-b"}
    return [NodeSnapshot(n, fabric=fabric[n], free_gpus=tuple(range(f)), total_gpus=8) for n, f in free.items()]


def test_respread_moves_one_of_two_replicas_sharing_a_node_to_another_fabric():
    from replicas.snapshot import ExistingReplica

    replicas = [SpreadReplica(1, "ib-a", ("node01",)), SpreadReplica(2, "ib-a", ("node01",))]
    existing = [(r.id, ExistingReplica("m", r.fabric, r.nodes)) for r in replicas]
    move = respread("m", PlacementRequest("m", 1, 4), replicas, _nodes(node01=0, node02=8, node03=8, node04=8),
                    existing)
    assert move is not None and move.replica == 2 and move.destination.fabric == "ib-b"
    assert crowding(move.destination.fabric, move.destination.nodes, replicas[:1]) == (0, 0)
    assert "shares node01 with replica 1 of m" in move.reason


def test_respread_moves_nothing_when_no_better_spread_fits():
    from replicas.snapshot import ExistingReplica

    replicas = [SpreadReplica(1, "ib-a", ("node01",)), SpreadReplica(2, "ib-a", ("node01",))]
    existing = [(r.id, ExistingReplica("m", r.fabric, r.nodes)) for r in replicas]
    # Room only on node01 itself.
    assert respread("m", PlacementRequest("m", 1, 4), replicas, _nodes(node01=8, node02=2, node03=0), existing) is None
    # Already spread: nothing to do.
    apart = [SpreadReplica(1, "ib-a", ("node01",)), SpreadReplica(2, "ib-b", ("node03",))]
    assert respread("m", PlacementRequest("m", 1, 4), apart, _nodes(node02=8, node04=8),
                    [(r.id, ExistingReplica("m", r.fabric, r.nodes)) for r in apart]) is None


# --- through the services ----------------------------------------------------------


def _converge(cluster, times: int = 2) -> None:
    for _ in range(times):
        for node in cluster.values():
            node.refresh_from_db()
            _report(node)


def _nodes_of(model: str) -> list[str]:
    return sorted(n for r in Replica.objects.filter(model__name=model, status=ReplicaStatus.READY)
                  for n in _placement(r))


def _crowd_on_node01(cluster, model):
    """Both replicas of ``model`` on node01: the others cordoned while it is placed."""
    for name in ("node02", "node03", "node04"):
        node_cordon(node_name=name)
    reconcile.replicas_reconcile()
    _converge(cluster)
    assert _nodes_of(model.name) == ["node01", "node01"]
    for name in ("node02", "node03", "node04"):
        node_uncordon(node_name=name)


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_a_scale_down_keeps_the_model_spread(seeds_cluster, settings):  # noqa: F811
    settings.LLMGW_SPREAD = False
    model = CatalogEntryFactory(name="small", nodes=1, gpus_per_node=1, replicas=2)
    _crowd_on_node01(seeds_cluster, model)
    model.replicas = 3
    model.save()
    reconcile.replicas_reconcile()
    _converge(seeds_cluster)
    newest = Replica.objects.filter(model=model).latest("pk")
    assert set(_placement(newest)) == {"node03"}
    model.replicas = 2
    model.save()
    reconcile.replicas_reconcile()
    # Not the newest (it alone is elsewhere): one of the two on node01.
    assert Replica.objects.get(pk=newest.pk).status == ReplicaStatus.READY
    assert _nodes_of("small") == ["node01", "node03"]


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_two_replicas_on_one_node_are_spread_again_replacement_first(seeds_cluster, settings):  # noqa: F811
    settings.LLMGW_SPREAD = True
    model = CatalogEntryFactory(name="small", nodes=1, gpus_per_node=1, replicas=2)
    _crowd_on_node01(seeds_cluster, model)
    reconcile.replicas_reconcile()
    moving = Replica.objects.get(model=model, draining=True)
    replacement = Replica.objects.get(model=model, status=ReplicaStatus.SCHEDULED)
    assert set(_placement(replacement)) == {"node03"}  # the other fabric
    event = Event.objects.get(subject=f"replica/{moving.pk}", message__startswith="moving small replica")
    assert "to spread the model" in event.message and "shares node01" in event.message
    assert "LLMGW_SPREAD=0" in event.message
    reconcile.replicas_reconcile()  # bounded: nothing more while it is in flight
    assert Replica.objects.filter(model=model).count() == 3
    assert Replica.objects.get(pk=moving.pk).status == ReplicaStatus.READY  # serving until its replacement is
    _converge(seeds_cluster)
    reconcile.replicas_reconcile()
    assert Replica.objects.get(pk=moving.pk).status == ReplicaStatus.STOPPING
    assert _nodes_of("small") == ["node01", "node03"]
    reconcile.replicas_reconcile()
    assert Replica.objects.filter(model=model, draining=True).exclude(status__in=[
        ReplicaStatus.STOPPING, ReplicaStatus.STOPPED]).count() == 0


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_spread_moves_are_off_with_the_setting(seeds_cluster, settings):  # noqa: F811
    settings.LLMGW_SPREAD = False
    model = CatalogEntryFactory(name="small", nodes=1, gpus_per_node=1, replicas=2)
    _crowd_on_node01(seeds_cluster, model)
    reconcile.replicas_reconcile()
    assert not Replica.objects.filter(model=model, draining=True).exists()
    assert Replica.objects.filter(model=model).count() == 2
