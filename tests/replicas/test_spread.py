"""A model kept spread (issue 27): the pure decisions of replicas.spread,
and through the services: a scale-down stops the replica whose loss best
keeps the model spread; two replicas sharing a node are spread again by a
move, replacement first, explained in an Event, off with LLMGW_SPREAD=0."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.models import Event
from nodes.services import node_cordon, node_uncordon
from replicas import reconcile
from replicas.choices import ReplicaStatus
from replicas.models import CatalogEntry, Replica
from replicas.snapshot import ExistingReplica, NodeSnapshot, PlacementRequest
from replicas.spread import SpreadReplica, crowding, node_moves_first, removal_order, respread
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


# Two fabrics of four nodes, 8 GPUs each: room for two 2-node replicas to
# share a node, or only a fabric, inside one fabric.
FABRIC = {"node01": "ib-a", "node02": "ib-a", "node05": "ib-a", "node07": "ib-a",
          "node03": "ib-b", "node04": "ib-b", "node06": "ib-b", "node08": "ib-b"}


def _free(**free):
    return [NodeSnapshot(n, fabric=FABRIC[n], free_gpus=tuple(range(f)), total_gpus=8) for n, f in free.items()]


def _existing(replicas):
    return [(r.id, ExistingReplica("m", r.fabric, r.nodes)) for r in replicas]


def test_two_2_node_replicas_whose_leaders_share_a_node_are_spread_whole_to_another_fabric():
    # The incident of issue 27: both leaders on node01.
    replicas = [SpreadReplica(1, "ib-a", ("node01", "node02")), SpreadReplica(2, "ib-a", ("node01", "node05"))]
    nodes = _free(node01=0, node02=4, node05=4, node03=8, node04=8, node06=0)
    move = respread("m", PlacementRequest("m", 2, 4), replicas, nodes, _existing(replicas))
    assert move is not None and move.replica == 2 and move.for_node
    assert move.destination.fabric == "ib-b" and set(move.destination.nodes) == {"node03", "node04"}
    assert all(len(m.gpus) == 4 for m in move.destination.members)
    assert "shares node01 with replica 1 of m" in move.reason


def test_two_2_node_replicas_sharing_a_node_are_spread_inside_their_fabric_when_no_other_fabric_has_room():
    replicas = [SpreadReplica(1, "ib-a", ("node01", "node02")), SpreadReplica(2, "ib-a", ("node02", "node05"))]
    # node05 keeps 4 free beside the original (the replacement starts first); ib-b has no two nodes of 4.
    nodes = _free(node01=4, node02=0, node05=4, node07=8, node03=4, node04=2, node06=0)
    move = respread("m", PlacementRequest("m", 2, 4), replicas, nodes, _existing(replicas))
    assert move is not None and move.replica == 2
    assert move.destination.fabric == "ib-a" and set(move.destination.nodes) == {"node05", "node07"}
    assert crowding(move.destination.fabric, move.destination.nodes, replicas[:1]) == (0, 1)
    # Without node07 the only pair of ib-a nodes with room includes node01, replica 1's: nothing moves.
    assert respread("m", PlacementRequest("m", 2, 4), replicas, nodes[:3] + nodes[4:], _existing(replicas)) is None


def test_two_replicas_sharing_only_a_fabric_move_to_a_fabric_with_room():
    replicas = [SpreadReplica(1, "ib-a", ("node01",)), SpreadReplica(2, "ib-a", ("node02",))]
    move = respread("m", PlacementRequest("m", 1, 4), replicas, _free(node01=4, node02=4, node03=8), _existing(replicas))
    assert move is not None and move.replica == 2 and not move.for_node
    assert move.destination.nodes == ("node03",) and move.destination.fabric == "ib-b"
    assert "shares fabric ib-a (on other nodes) with replica 1 of m" in move.reason
    # 2-node replicas alike, moved whole: never across two fabrics.
    pairs = [SpreadReplica(1, "ib-a", ("node01", "node02")), SpreadReplica(2, "ib-a", ("node05", "node07"))]
    move = respread("m", PlacementRequest("m", 2, 4), pairs,
                    _free(node01=4, node02=4, node05=4, node07=4, node03=4, node04=8, node06=2), _existing(pairs))
    assert move is not None and move.replica == 2
    assert move.destination.fabric == "ib-b" and set(move.destination.nodes) == {"node03", "node04"}


def test_a_fabric_move_only_when_it_shares_strictly_less():
    # Three replicas, two fabrics: one fabric holds two whatever moves.
    replicas = [SpreadReplica(1, "ib-a", ("node01",)), SpreadReplica(2, "ib-b", ("node03",)),
                SpreadReplica(3, "ib-a", ("node02",))]
    assert respread("m", PlacementRequest("m", 1, 1), replicas,
                    _free(node01=8, node02=8, node05=8, node03=8, node04=8, node06=8), _existing(replicas)) is None


def test_a_shared_node_is_undone_before_a_shared_fabric():
    # Within a model: the replicas sharing node01 are the most crowded, so one of them moves first.
    replicas = [SpreadReplica(1, "ib-a", ("node01",)), SpreadReplica(2, "ib-a", ("node01",)),
                SpreadReplica(3, "ib-a", ("node02",))]
    move = respread("m", PlacementRequest("m", 1, 1), replicas, _free(node01=6, node02=7, node03=8), _existing(replicas))
    assert move is not None and move.replica == 2 and move.for_node and move.destination.fabric == "ib-b"
    # Across models: a move off a shared node before one off a shared fabric, whatever the names.
    fabric_only = respread("a", PlacementRequest("a", 1, 1), replicas[::2], _free(node03=8), _existing(replicas[::2]))
    assert fabric_only is not None and not fabric_only.for_node
    assert [name for name, _ in node_moves_first([("a", fabric_only), ("b", move)])] == ["b", "a"]


@given(st.lists(st.sampled_from(sorted(FABRIC)), min_size=2, max_size=7))
def test_spread_moves_end_as_spread_as_the_room_allows(placed):
    """Applying moves one at a time (room for everyone: each node has 8 GPUs
    and each replica takes 1) ends, and ends with no two replicas on one node
    while there are nodes enough, and the fabrics as even as they can be."""
    replicas = [SpreadReplica(i, FABRIC[n], (n,)) for i, n in enumerate(placed, start=1)]
    for _ in range(len(replicas) * 2 + 1):
        used = {n: sum(1 for r in replicas if r.nodes[0] == n) for n in FABRIC}
        nodes = _free(**{n: 8 - used[n] for n in FABRIC})
        move = respread("m", PlacementRequest("m", 1, 1), replicas, nodes, _existing(replicas))
        if move is None:
            break
        replicas = [r if r.id != move.replica else SpreadReplica(r.id, move.destination.fabric, move.destination.nodes)
                    for r in replicas]
    else:
        raise AssertionError(f"spread moves did not end: {replicas}")
    on_node = [r.nodes[0] for r in replicas]
    assert len(set(on_node)) == min(len(replicas), len(FABRIC))
    per_fabric = [sum(1 for r in replicas if r.fabric == f) for f in ("ib-a", "ib-b")]
    assert max(per_fabric) - min(per_fabric) <= 1


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
def test_a_pending_replica_that_can_never_be_placed_does_not_stop_spread_moves(seeds_cluster, settings):  # noqa: F811
    settings.LLMGW_SPREAD = True
    huge = CatalogEntryFactory(name="huge", nodes=1, gpus_per_node=16, replicas=1)  # 8-GPU nodes: never
    model = CatalogEntryFactory(name="small", nodes=1, gpus_per_node=1, replicas=2)
    _crowd_on_node01(seeds_cluster, model)
    huge.refresh_from_db()
    assert huge.never_fits_reason
    assert Replica.objects.get(model=huge).status == ReplicaStatus.PENDING
    reconcile.replicas_reconcile()
    assert Replica.objects.filter(model=model, draining=True).count() == 1
    assert Replica.objects.filter(model=model, status=ReplicaStatus.SCHEDULED).count() == 1


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_a_pending_replica_that_may_fit_holds_spread_moves_for_a_bounded_time(seeds_cluster, settings):  # noqa: F811
    from replicas.respread import PENDING_PATIENCE

    settings.LLMGW_SPREAD = True
    model = CatalogEntryFactory(name="small", nodes=1, gpus_per_node=1, replicas=2)
    _crowd_on_node01(seeds_cluster, model)
    # Two whole 8-GPU nodes of one fabric: it fits the cluster, but not while node02 and node04 are cordoned
    # (node01 holds small), and no move makes room for it.
    node_cordon(node_name="node02")
    node_cordon(node_name="node04")
    big = CatalogEntryFactory(name="big", nodes=2, gpus_per_node=8, replicas=1)
    reconcile.replicas_reconcile()
    waiting = Replica.objects.get(model=big)
    assert waiting.status == ReplicaStatus.PENDING and not CatalogEntry.objects.get(pk=big.pk).never_fits_reason
    assert not Replica.objects.filter(model=model, draining=True).exists()  # churn: nothing moves yet
    Replica.objects.filter(pk=waiting.pk).update(
        status_changed_at=waiting.status_changed_at - PENDING_PATIENCE - dt.timedelta(seconds=1))
    reconcile.replicas_reconcile()
    assert Replica.objects.get(pk=waiting.pk).status == ReplicaStatus.PENDING
    assert Replica.objects.filter(model=model, draining=True).count() == 1


@pytest.mark.django_db
@pytest.mark.usefixtures("no_reconcile_enqueue")
def test_spread_moves_are_off_with_the_setting(seeds_cluster, settings):  # noqa: F811
    settings.LLMGW_SPREAD = False
    model = CatalogEntryFactory(name="small", nodes=1, gpus_per_node=1, replicas=2)
    _crowd_on_node01(seeds_cluster, model)
    reconcile.replicas_reconcile()
    assert not Replica.objects.filter(model=model, draining=True).exists()
    assert Replica.objects.filter(model=model).count() == 2
