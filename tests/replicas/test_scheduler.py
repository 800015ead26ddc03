"""The pure placement function: each rule, the seeds' scenario, reasons, invariants.

No database and no Django: these are plain functions over snapshots.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import replace

import pytest

from replicas.placement import (
    ClusterSnapshot,
    ExistingReplica,
    Member,
    NodeSnapshot,
    Placement,
    PlacementRequest,
    Unplaceable,
    apply,
    never_fits,
    place,
)


def node(name, fabric=None, free=8, total=8, **kwargs):
    fabrics = (fabric,) if isinstance(fabric, str) else tuple(fabric or ())
    gpus = range(free) if isinstance(free, int) else free
    return NodeSnapshot(name, fabrics=fabrics, free_gpus=tuple(gpus), total_gpus=total, **kwargs)


def seeds_cluster():
    return [node("node01", "ib-a"), node("node02", "ib-a"), node("node03", "ib-b"), node("node04", "ib-b")]


def req(nodes, gpus, model="llama-70b"):
    return PlacementRequest(model=model, nodes=nodes, gpus_per_node=gpus)


def placed(request, snapshot):
    result = place(request, snapshot)
    assert isinstance(result, Placement), result
    return result


# --- the seeds' scenario -------------------------------------------------------


def test_seeds_two_replicas_land_one_per_fabric():
    snapshot = ClusterSnapshot(seeds_cluster())
    first = placed(req(2, 4), snapshot)
    snapshot.allocate(first)
    second = placed(req(2, 4), snapshot)

    assert first == Placement(
        "llama-70b", "ib-a", (Member("node01", (0, 1, 2, 3)), Member("node02", (0, 1, 2, 3)))
    )
    assert second == Placement(
        "llama-70b", "ib-b", (Member("node03", (0, 1, 2, 3)), Member("node04", (0, 1, 2, 3)))
    )


def test_seeds_replacement_after_node02_is_lost_goes_to_ib_b_not_across_fabrics():
    snapshot = ClusterSnapshot(seeds_cluster())
    ib_a = placed(req(2, 4), snapshot)
    snapshot.allocate(ib_a)
    ib_b = placed(req(2, 4), snapshot)
    snapshot.allocate(ib_b)
    snapshot.release(ib_a)  # the ib-a replica failed and was reaped: node01's GPUs are free again
    nodes = [replace(n, schedulable=False, state="lost") if n.name == "node02" else n for n in snapshot.nodes.values()]
    after = ClusterSnapshot(nodes, [ExistingReplica("llama-70b", "ib-b", ("node03", "node04"))])

    replacement = placed(req(2, 4), after)

    assert replacement.fabric == "ib-b"
    assert replacement.members == (Member("node03", (4, 5, 6, 7)), Member("node04", (4, 5, 6, 7)))
    assert "node01" not in replacement.nodes
    after.allocate(replacement)
    # node01 sits idle: nothing else of this shape fits, and the reason says why.
    result = place(req(2, 4), after)
    assert isinstance(result, Unplaceable) and not result.never
    assert result.reason == (
        "needs 2 nodes x 4 GPUs in one fabric; ib-a: 1 node has 4+ free (node01: 8); ib-b: none; "
        "excluded as not schedulable: node02 (lost)"
    )


# --- fabrics and islands -------------------------------------------------------


def test_multi_node_replica_never_spans_two_fabrics():
    # One free node in each fabric: together they would fit, apart they do not.
    snapshot = ClusterSnapshot([node("a1", "ib-a"), node("a2", "ib-a", free=0), node("b1", "ib-b")])
    result = place(req(2, 8), snapshot)
    assert isinstance(result, Unplaceable)
    assert "ib-a: 1 node has 8+ free (a1: 8)" in result.reason
    assert "ib-b: 1 node has 8+ free (b1: 8)" in result.reason


def test_fabric_less_node_never_receives_a_multi_node_member():
    snapshot = ClusterSnapshot([node("island1"), node("island2"), node("a1", "ib-a"), node("a2", "ib-a", free=4)])
    for _ in range(3):
        result = place(req(2, 4), snapshot)
        if isinstance(result, Unplaceable):
            break
        assert result.fabric == "ib-a"
        assert not {"island1", "island2"} & set(result.nodes)
        snapshot.allocate(result)
    result = place(req(2, 4), snapshot)
    assert isinstance(result, Unplaceable)
    assert "2 fabric-less nodes take single-node replicas only" in result.reason


def test_multi_node_on_islands_only_never_fits():
    snapshot = ClusterSnapshot([node("island1"), node("island2")])
    result = place(req(2, 1), snapshot)
    assert isinstance(result, Unplaceable) and result.never
    assert "no node is in a fabric" in result.reason


def test_single_node_replica_goes_on_an_island_or_a_fabric_node():
    island_only = ClusterSnapshot([node("island1"), node("a1", "ib-a", free=0)])
    assert placed(req(1, 2), island_only) == Placement("llama-70b", None, (Member("island1", (0, 1)),))
    fabric_only = ClusterSnapshot([node("island1", free=0), node("a1", "ib-a")])
    assert placed(req(1, 2), fabric_only) == Placement("llama-70b", "ib-a", (Member("a1", (0, 1)),))


def test_single_node_prefers_an_island_at_equal_fit():
    snapshot = ClusterSnapshot([node("a1", "ib-a"), node("z-island")])
    assert placed(req(1, 8), snapshot).nodes == ("z-island",)


def test_node_in_two_fabrics_joins_either_but_replica_stays_in_one():
    both = node("ab1", ("ib-a", "ib-b"))
    snapshot = ClusterSnapshot([both, node("a1", "ib-a"), node("b1", "ib-b")])
    first = placed(req(2, 8), snapshot)
    assert first.fabric == "ib-a" and first.nodes == ("a1", "ab1")
    snapshot.allocate(first)
    # ab1 is now full: ib-b has only b1 left, so nothing fits.
    assert isinstance(place(req(2, 8), snapshot), Unplaceable)

    elsewhere = ExistingReplica("llama-70b", "ib-a", ("x",))
    snapshot = ClusterSnapshot([both, node("a1", "ib-a"), node("b1", "ib-b")], [elsewhere])
    spread = placed(req(2, 8), snapshot)
    assert spread.fabric == "ib-b" and spread.nodes == ("ab1", "b1")


# --- candidates ----------------------------------------------------------------


@pytest.mark.parametrize("state", ["cordoned", "lost", "registered", "draining"])
def test_unschedulable_nodes_are_never_candidates(state):
    snapshot = ClusterSnapshot([node("a1", "ib-a", schedulable=False, state=state), node("a2", "ib-a", free=2)])
    result = place(req(1, 4), snapshot)
    assert isinstance(result, Unplaceable) and not result.never
    assert f"excluded as not schedulable: a1 ({state})" in result.reason
    assert placed(req(1, 2), snapshot).nodes == ("a2",)


def test_nodes_without_enough_free_gpus_are_not_candidates():
    snapshot = ClusterSnapshot([node("a1", "ib-a", free=3), node("a2", "ib-a", free=4), node("a3", "ib-a", free=8)])
    assert set(placed(req(2, 4), snapshot).nodes) == {"a2", "a3"}
    assert isinstance(place(req(3, 4), snapshot), Unplaceable)


# --- spreading, then best fit --------------------------------------------------


def test_replicas_of_one_model_spread_across_fabrics_before_packing():
    # ib-a could hold both replicas on perfectly fitting nodes; spreading wins over fit.
    snapshot = ClusterSnapshot(
        [node("a1", "ib-a", free=4), node("a2", "ib-a", free=4), node("a3", "ib-a", free=4), node("a4", "ib-a", free=4),
         node("b1", "ib-b"), node("b2", "ib-b")]
    )
    first = placed(req(2, 4), snapshot)
    assert first.fabric == "ib-a" and first.nodes == ("a1", "a2")  # best fit among equals
    snapshot.allocate(first)
    second = placed(req(2, 4), snapshot)
    assert second.fabric == "ib-b"
    # Another model is not spread against llama: it packs onto the exact fit.
    assert placed(req(2, 4, model="other"), snapshot).nodes == ("a3", "a4")


def test_replicas_spread_across_nodes_within_a_fabric_before_packing():
    snapshot = ClusterSnapshot([node("a1", "ib-a"), node("a2", "ib-a")])
    first = placed(req(1, 2), snapshot)
    snapshot.allocate(first)
    second = placed(req(1, 2), snapshot)
    assert {first.nodes, second.nodes} == {("a1",), ("a2",)}
    snapshot.allocate(second)
    # Every node holds one now: the third packs by best fit.
    snapshot.allocate(placed(req(1, 5, model="other"), snapshot))  # a1 left with 1 free
    third = placed(req(1, 1), snapshot)
    assert third.nodes == ("a1",)


def test_islands_count_as_separate_failure_domains():
    snapshot = ClusterSnapshot([node("i1"), node("i2"), node("a1", "ib-a")])
    names = []
    for _ in range(3):
        result = placed(req(1, 4), snapshot)
        snapshot.allocate(result)
        names.append(result.nodes[0])
    assert sorted(names) == ["a1", "i1", "i2"]


def test_best_fit_chooses_nodes_closest_to_the_need():
    snapshot = ClusterSnapshot(
        [node("a1", "ib-a", free=8), node("a2", "ib-a", free=5), node("a3", "ib-a", free=4), node("a4", "ib-a", free=6)]
    )
    assert placed(req(2, 4), snapshot).nodes == ("a2", "a3")


def test_best_fit_chooses_the_fabric_stranding_fewest_gpus():
    snapshot = ClusterSnapshot(
        [node("a1", "ib-a"), node("a2", "ib-a"), node("b1", "ib-b", free=4), node("b2", "ib-b", free=5)]
    )
    assert placed(req(2, 4), snapshot).fabric == "ib-b"


def test_best_fit_single_node():
    snapshot = ClusterSnapshot([node("a1", "ib-a", free=8), node("a2", "ib-a", free=3), node("a3", "ib-a", free=2)])
    assert placed(req(1, 2), snapshot).nodes == ("a3",)


@pytest.mark.parametrize(
    ("free", "need", "expected"),
    [
        (range(8), 4, (0, 1, 2, 3)),
        ((0, 1, 2, 4), 1, (4,)),  # the smallest run that fits keeps 0-2 together
        ((0, 2, 3, 4, 6, 7), 2, (6, 7)),
        ((0, 2, 4, 6), 2, (0, 2)),  # no run long enough: the lowest
        ((1, 2, 3, 5, 6, 7), 3, (1, 2, 3)),
    ],
)
def test_gpu_indices_are_contiguous_then_lowest(free, need, expected):
    snapshot = ClusterSnapshot([node("a1", "ib-a", free=free)])
    assert placed(req(1, need), snapshot).members[0].gpus == expected


def test_members_are_ordered_by_rank_leader_first_by_name():
    snapshot = ClusterSnapshot([node("a3", "ib-a", free=4), node("a1", "ib-a"), node("a2", "ib-a", free=4)])
    result = placed(req(3, 4), snapshot)
    assert result.nodes == ("a1", "a2", "a3")


# --- determinism ---------------------------------------------------------------


def test_same_input_same_output_whatever_the_node_order():
    rng = random.Random(7)
    nodes = [node(f"n{i:03}", f"ib-{i % 4}", free=rng.randint(0, 8)) for i in range(60)] + [
        node(f"i{i:02}", free=rng.randint(0, 8)) for i in range(6)
    ]
    requests = [req(*rng.choice([(1, 1), (1, 8), (2, 4), (2, 8), (4, 2)]), model=rng.choice("xyz")) for _ in range(40)]

    def run(order):
        snapshot = ClusterSnapshot(order)
        out = []
        for request in requests:
            result = place(request, snapshot)
            assert result == place(request, snapshot)  # pure: asking twice changes nothing
            if isinstance(result, Placement):
                snapshot.allocate(result)
            out.append(result)
        return out

    shuffled = list(nodes)
    rng.shuffle(shuffled)
    assert run(nodes) == run(shuffled) == run(list(reversed(nodes)))


def test_apply_returns_an_updated_copy():
    snapshot = ClusterSnapshot(seeds_cluster())
    first = placed(req(2, 4), snapshot)
    after = apply(snapshot, first)
    assert snapshot.nodes["node01"].free_gpus == tuple(range(8))
    assert after.nodes["node01"].free_gpus == (4, 5, 6, 7)
    assert placed(req(2, 4), snapshot) == first
    assert placed(req(2, 4), after).fabric == "ib-b"


def test_allocate_refuses_a_gpu_that_is_not_free():
    snapshot = ClusterSnapshot(seeds_cluster())
    first = placed(req(2, 4), snapshot)
    snapshot.allocate(first)
    with pytest.raises(ValueError, match="not free"):
        snapshot.allocate(first)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="nodes"):
        req(0, 4)
    with pytest.raises(ValueError, match="gpus_per_node"):
        req(1, 0)
    with pytest.raises(ValueError, match="appears twice"):
        ClusterSnapshot([node("a1"), node("a1")])
    with pytest.raises(ValueError, match="total_gpus"):
        node("a1", free=9, total=8)


# --- reasons -------------------------------------------------------------------


def test_reason_names_few_nodes_and_counts_many():
    nodes = [node(f"a{i}", "ib-a", free=4 if i < 5 else 2) for i in range(8)] + [node("b1", "ib-b", free=4)]
    nodes += [node(f"c{i}", "ib-c", free=0) for i in range(3)] + [node("d1", "ib-d", free=1)]
    result = place(req(6, 4), ClusterSnapshot(nodes))
    assert isinstance(result, Unplaceable) and not result.never
    assert result.reason == (
        "needs 6 nodes x 4 GPUs in one fabric; ib-a: 5 nodes have 4+ free; ib-b: 1 node has 4+ free (b1: 4); "
        "ib-c, ib-d: none"
    )


def test_reason_for_a_single_node_request_mentions_islands_and_most_free():
    nodes = [node("a1", "ib-a", free=3), node("i1", free=6), node("i2", free=2),
             node("a2", "ib-a", schedulable=False, state="cordoned")]
    result = place(req(1, 8), ClusterSnapshot(nodes))
    assert isinstance(result, Unplaceable) and not result.never
    assert result.reason == (
        "needs 1 node x 8 GPUs; ib-a: none; fabric-less (2 nodes): none; most free on a schedulable node: 6 (i1); "
        "excluded as not schedulable: a2 (cordoned)"
    )


def test_reason_lists_many_excluded_nodes_briefly():
    nodes = [node(f"a{i}", "ib-a", schedulable=False, state="lost") for i in range(5)]
    result = place(req(2, 8), ClusterSnapshot(nodes))
    assert result.reason.endswith("excluded as not schedulable: a0 (lost), a1 (lost), a2 (lost) and 2 more")


# --- never fits ----------------------------------------------------------------


def test_never_fits_more_gpus_than_any_node_has():
    snapshot = ClusterSnapshot(seeds_cluster())
    assert never_fits(req(1, 9), snapshot) == "needs 9 GPUs per node, but the largest node has 8"
    result = place(req(1, 9), snapshot)
    assert isinstance(result, Unplaceable) and result.never and result.reason == never_fits(req(1, 9), snapshot)


def test_never_fits_more_nodes_than_any_fabric_has():
    snapshot = ClusterSnapshot(seeds_cluster() + [node("node05", "ib-b", total=4, free=4), node("island")])
    assert never_fits(req(3, 4), snapshot) is None  # ib-b has three nodes of 4+ GPUs
    assert never_fits(req(3, 8), snapshot) == (
        "needs 3 nodes x 8 GPUs in one fabric, but no fabric has 3 nodes of 8+ GPUs (ib-a: 2, ib-b: 2)"
    )


def test_never_fits_counts_busy_and_unschedulable_nodes():
    nodes = [node("a1", "ib-a", free=0), node("a2", "ib-a", schedulable=False, state="lost")]
    snapshot = ClusterSnapshot(nodes)
    assert never_fits(req(2, 8), snapshot) is None
    result = place(req(2, 8), snapshot)
    assert isinstance(result, Unplaceable) and not result.never


def test_never_fits_an_empty_cluster_says_so():
    assert never_fits(req(1, 1), ClusterSnapshot([])) == "no nodes are registered"


# --- randomized invariants -----------------------------------------------------


def reference_place(request, snapshot):
    """The rules written plainly (sort every candidate), to check the indexed search against."""
    model, k, need = request.model, request.nodes, request.gpus_per_node
    fabric_count = snapshot._fabric_count.get(model, {})
    node_count = snapshot._node_count.get(model, {})
    eligible = [n for n in snapshot.nodes.values() if n.schedulable and len(n.free_gpus) >= need]
    best = None
    if k == 1:
        for n in eligible:
            for fabric in n.fabrics or ("",):
                count = node_count.get(n.name, 0)
                domain = fabric_count.get(fabric, 0) if fabric else count
                key = (domain, count, len(n.free_gpus), 1 if fabric else 0, n.name, fabric)
                if best is None or key < best[0]:
                    best = (key, fabric or None, [n.name])
    else:
        for fabric in snapshot.fabrics:
            ranked = sorted(
                (node_count.get(n.name, 0), len(n.free_gpus), n.name) for n in eligible if fabric in n.fabrics
            )[:k]
            if len(ranked) < k:
                continue
            key = (fabric_count.get(fabric, 0), sum(r[0] for r in ranked), sum(r[1] - need for r in ranked), fabric)
            if best is None or key < best[0]:
                best = (key, fabric, [r[2] for r in ranked])
    return None if best is None else (best[1], tuple(sorted(best[2])))


def random_cluster(rng):
    fabrics = [f"ib-{c}" for c in "abcdef"[: rng.randint(0, 5)]]
    nodes = []
    for i in range(rng.randint(1, 40)):
        total = rng.choice([4, 8, 8, 8, 16])
        roll = rng.random()
        if not fabrics or roll < 0.15:
            member_of = ()
        elif roll < 0.22:
            member_of = tuple(rng.sample(fabrics, min(2, len(fabrics))))
        else:
            member_of = (rng.choice(fabrics),)
        free = sorted(rng.sample(range(total), rng.randint(0, total)))
        schedulable = rng.random() > 0.1
        nodes.append(
            NodeSnapshot(f"n{i:02}", fabrics=member_of, free_gpus=tuple(free), total_gpus=total,
                         schedulable=schedulable, state="ready" if schedulable else "cordoned")
        )
    return nodes


@pytest.mark.parametrize("seed", range(40))
def test_random_clusters_keep_every_invariant(seed):
    rng = random.Random(seed)
    nodes = random_cluster(rng)
    initial = {n.name: set(n.free_gpus) for n in nodes}
    snapshot = ClusterSnapshot(nodes)
    by_name = {n.name: n for n in nodes}
    allocated: set[tuple[str, int]] = set()
    live: list[Placement] = []
    for _ in range(60):
        if live and rng.random() < 0.15:
            gone = live.pop(rng.randrange(len(live)))
            snapshot.release(gone)
            allocated -= {(m.node, gpu) for m in gone.members for gpu in m.gpus}
            continue
        request = req(rng.choice([1, 1, 2, 3, 4]), rng.choice([1, 2, 4, 8, 16]), model=rng.choice("pqr"))
        expected = reference_place(request, snapshot)
        result = place(request, snapshot)
        if isinstance(result, Unplaceable):
            assert expected is None, (request, result.reason)
            assert result.reason
            continue
        assert (result.fabric, result.nodes) == expected
        assert len(result.members) == request.nodes == len(set(result.nodes))
        for member in result.members:
            info = by_name[member.node]
            assert info.schedulable
            assert len(member.gpus) == request.gpus_per_node
            assert set(member.gpus) <= initial[member.node]
            for gpu in member.gpus:
                assert (member.node, gpu) not in allocated, "GPU allocated twice"
                allocated.add((member.node, gpu))
            if request.nodes > 1:
                assert info.fabrics, "multi-node member on a fabric-less node"
                assert result.fabric in info.fabrics, "replica across fabrics"
            elif result.fabric is not None:
                assert result.fabric in info.fabrics
            else:
                assert not info.fabrics
        snapshot.allocate(result)
        live.append(result)
    for name, free in initial.items():
        taken = {gpu for node_name, gpu in allocated if node_name == name}
        assert set(snapshot.nodes[name].free_gpus) == free - taken


def test_node_snapshot_accepts_fabric_or_fabrics():
    single = NodeSnapshot("a1", fabric="ib-a", free_gpus=(3, 1, 2), total_gpus=8)
    assert (single.fabrics, single.fabric, single.free_gpus) == (("ib-a",), "ib-a", (1, 2, 3))
    several = NodeSnapshot("a2", fabrics=("ib-b", "ib-a"), free_gpus=(), total_gpus=8)
    assert (several.fabrics, several.fabric) == (("ib-a", "ib-b"), "ib-a")
    island = NodeSnapshot("i1", free_gpus=range(4))
    assert (island.fabrics, island.fabric, island.total_gpus) == ((), None, 4)


# --- randomized invariants with moves (replicas.defrag) --------------------------


@pytest.mark.parametrize("seed", range(40))
def test_random_clusters_with_moves_keep_every_invariant(seed):
    """Replicas come and go on random clusters; whatever cannot be placed gets
    room made by the planned moves, applied as the service applies them
    (replacement first, then the original): no GPU is ever taken twice, no
    replica spans two fabrics, no model ever has fewer replicas than before,
    and after the moves the pending replica fits."""
    from replicas.defrag import Movable, NoRoom, plan_room

    rng = random.Random(1000 + seed)
    nodes = random_cluster(rng)
    by_name = {n.name: n for n in nodes}
    snapshot = ClusterSnapshot(nodes)
    taken = {(n.name, gpu) for n in nodes for gpu in set(range(n.total_gpus)) - set(n.free_gpus)}
    live: dict[int, Placement] = {}
    ids = itertools.count(1)
    moved = 0

    def check(result):
        for member in result.members:
            assert by_name[member.node].schedulable
            for gpu in member.gpus:
                assert (member.node, gpu) not in taken, "GPU allocated twice"
                taken.add((member.node, gpu))
            if len(result.members) > 1:
                assert result.fabric in by_name[member.node].fabrics, "replica across fabrics"

    def add(result):
        check(result)
        snapshot.allocate(result)
        live[next(ids)] = result

    def remove(key):
        gone = live.pop(key)
        snapshot.release(gone)
        for member in gone.members:
            taken.difference_update((member.node, gpu) for gpu in member.gpus)

    for _ in range(80):
        if live and rng.random() < 0.1:
            remove(rng.choice(list(live)))
            continue
        request = req(rng.choice([1, 1, 1, 2, 2, 3]), rng.choice([1, 1, 2, 4, 8]), model=rng.choice("pqrs"))
        result = place(request, snapshot)
        if isinstance(result, Placement):
            add(result)
            continue
        if result.never:
            continue
        movable = [Movable(key, p.model, p.members[0].node, p.members[0].gpus)
                   for key, p in live.items() if len(p.members) == 1]
        plan = plan_room(request, snapshot, movable)
        if isinstance(plan, NoRoom):
            assert plan.reason.startswith("no set of moves makes room")
            continue
        assert plan.moves and len(plan.nodes) == request.nodes
        for move in plan.moves:
            original = live[move.replica]
            assert len(original.members) == 1 and original.model != request.model
            assert len(original.members[0].gpus) < request.nodes * request.gpus_per_node, "moved a larger replica"
            assert move.destination.members[0].node not in plan.nodes
            counts = Counter(p.model for p in live.values())
            add(move.destination)  # the replacement first ...
            assert Counter(p.model for p in live.values())[move.model] == counts[move.model] + 1
            remove(move.replica)  # ... then the original stops
            assert Counter(p.model for p in live.values())[move.model] == counts[move.model], "a model dipped"
            moved += 1
        result = place(request, snapshot)
        assert isinstance(result, Placement), (plan, result)
        add(result)
    assert all(len(snapshot.nodes[name].free_gpus) == by_name[name].total_gpus - sum(1 for n, _ in taken if n == name)
               for name in by_name)
    MOVES_MADE.append(moved)


MOVES_MADE: list[int] = []


def test_random_clusters_with_moves_made_moves():
    """The seeds above exercise moves, not only placements that fit anyway."""
    if len(MOVES_MADE) < 40:
        for seed in range(40):
            test_random_clusters_with_moves_keep_every_invariant(seed)
    assert sum(MOVES_MADE) >= 20 and sum(1 for m in MOVES_MADE if m) >= 10, MOVES_MADE
