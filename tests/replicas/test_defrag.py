"""Planning moves that make room (replicas.defrag): pure functions over snapshots."""

from __future__ import annotations

import yaml

from cli.demo import SAMPLE_CATALOG
from replicas.defrag import Movable, NoRoom, RoomPlan, plan_room
from replicas.placement import ClusterSnapshot, ExistingReplica, Placement, PlacementRequest, Unplaceable, place
from replicas.weights_placement import WeightsNeed, WeightsView

from .test_scheduler import node


def demo_after_node02_lost():
    """The demo's catalog placed on its four nodes, then node02 lost and its replica reaped."""
    snapshot = ClusterSnapshot([node("node01", "ib-a"), node("node02", "ib-a"), node("node03", "ib-b"),
                                node("node04", "ib-b")])
    placed = []
    for entry in yaml.safe_load(SAMPLE_CATALOG)["models"]:
        for _ in range(entry["replicas"]):
            result = place(PlacementRequest(entry["name"], entry["nodes"], entry["gpus_per_node"]), snapshot)
            snapshot.allocate(result)
            placed.append(result)
    survivors = [p for p in placed if "node02" not in p.nodes]
    nodes = [n for n in snapshot.nodes.values()]
    for p in placed:
        if "node02" in p.nodes:
            snapshot.release(p)
    nodes = [node(n.name, n.fabric, free=n.free_gpus, schedulable=n.name != "node02",
                  state="lost" if n.name == "node02" else "ready") for n in snapshot.nodes.values()]
    after = ClusterSnapshot(nodes, [ExistingReplica(p.model, p.fabric, p.nodes) for p in survivors])
    movable = [Movable(i, p.model, p.members[0].node, p.members[0].gpus)
               for i, p in enumerate(survivors, start=1) if len(p.members) == 1]
    return after, survivors, movable


LLAMA = PlacementRequest("llama-70b-sim", 2, 4)


def test_demo_the_one_gpu_replica_moves_out_of_the_way_on_ib_b():
    snapshot, survivors, movable = demo_after_node02_lost()
    stuck = place(LLAMA, snapshot)
    assert isinstance(stuck, Unplaceable) and not stuck.never
    assert "node01: 7" in stuck.reason  # what it has, not only the 4 it needs

    plan = plan_room(LLAMA, snapshot, movable)

    assert isinstance(plan, RoomPlan)
    assert (plan.fabric, plan.nodes) == ("ib-b", ("node03", "node04"))
    (move,) = plan.moves
    assert (move.model, move.source, move.destination.nodes) == ("qwen-7b-sim", "node03", ("node01",))
    snapshot.allocate(move.destination)
    original = next(p for i, p in enumerate(survivors, start=1) if i == move.replica)
    snapshot.release(original)
    after = place(LLAMA, snapshot)
    assert isinstance(after, Placement) and after.fabric == "ib-b" and after.nodes == ("node03", "node04")


def test_no_move_helps_when_the_other_nodes_are_full_and_says_why():
    snapshot = ClusterSnapshot([node("a1", "ib-a", free=3), node("a2", "ib-a", free=4), node("b1", "ib-b", free=0)])
    movable = [Movable(1, "qwen", "a1", (7,))]

    plan = plan_room(LLAMA, snapshot, movable)

    assert isinstance(plan, NoRoom)
    assert plan.reason == (
        "no set of moves makes room (ib-b: 1 schedulable node(s) of 4+ GPUs; "
        "ib-a: qwen replica 1 (1 GPUs) would fit nowhere else)"
    )


def test_replicas_as_large_as_the_pending_one_or_of_its_model_never_move():
    snapshot = ClusterSnapshot([node("a1", "ib-a", free=0), node("a2", "ib-a", free=2), node("i1", free=8)])
    movable = [Movable(1, "big", "a1", tuple(range(8))), Movable(2, LLAMA.model, "a2", (2, 3, 4, 5, 6, 7))]
    plan = plan_room(LLAMA, snapshot, movable)
    assert isinstance(plan, NoRoom)
    assert plan.reason == "no set of moves makes room (ib-a: only 0 node(s) could be cleared to 4 free)"


def test_fewest_then_smallest_moves_first():
    snapshot = ClusterSnapshot([node("a1", "ib-a", free=2), node("a2", "ib-a", free=4), node("i1", free=8)])
    movable = [Movable(1, "q", "a1", (4,)), Movable(2, "q", "a1", (5,)), Movable(3, "r", "a1", (6, 7)),
               Movable(4, "s", "a1", (0, 1, 2))]
    plan = plan_room(PlacementRequest("llama", 2, 4), snapshot, movable)
    assert isinstance(plan, RoomPlan)
    # One move of 2 GPUs, not two of one, nor the 3-GPU replica.
    assert [m.replica for m in plan.moves] == [3]
    assert plan.moves[0].destination.nodes == ("i1",)


def test_a_single_node_replica_can_get_room_on_an_island():
    snapshot = ClusterSnapshot([node("i1", free=5), node("i2", free=4)])
    plan = plan_room(PlacementRequest("big", 1, 8), snapshot, [Movable(1, "q", "i1", (5, 6, 7))])
    assert isinstance(plan, RoomPlan) and plan.fabric is None and plan.nodes == ("i1",)
    assert plan.moves[0].destination.nodes == ("i2",)


# --- managed weights: the same rule as place_weights ----------------------------------------------

Q_WEIGHTS = WeightsNeed(key="q@r1", total=100)
BIG_WEIGHTS = WeightsNeed(key="big@r1", total=1000)


def test_a_moved_replica_goes_where_its_weights_are_or_can_be():
    # 'b' is the tightest fit for the 1-GPU replica, as plain placement picks it; it keeps no cache.
    snapshot = ClusterSnapshot([node("a", free=7), node("b", free=1), node("c", free=4), node("d", free=6)])
    moved = [Movable(1, "q", "a", (7,), Q_WEIGHTS)]
    request = PlacementRequest("big", 1, 8)
    assert plan_room(request, snapshot, moved).moves[0].destination.nodes == ("b",)

    holder = WeightsView(caches={"c", "d"}, holders={"q@r1": {"d"}}, room={"c": 500, "d": 0})
    view = WeightsView(caches=set(holder.caches), holders={}, room=dict(holder.room))
    # A holder first, over a tighter fit with room; else a node with room; never 'b'.
    assert plan_room(request, snapshot, moved, view=holder).moves[0].destination.nodes == ("d",)
    assert plan_room(request, snapshot, moved, view=view).moves[0].destination.nodes == ("c",)
    assert view.room == {"c": 500, "d": 0} and not view.partial  # the caller's view is left as it was

    view.room["c"] = 50
    plan = plan_room(request, snapshot, moved, view=view)
    assert isinstance(plan, NoRoom)
    assert plan.reason == ("no set of moves makes room (fabric-less nodes: q replica 1 (1 GPUs) would fit nowhere "
                           "else that holds or has room for its weights (q@r1))")
    # A replica whose weights are not managed goes anywhere it fits.
    plain = [Movable(1, "q", "a", (7,))]
    assert plan_room(request, snapshot, plain, view=view).moves[0].destination.nodes == ("b",)


def test_two_moved_replicas_do_not_count_the_same_room_twice():
    snapshot = ClusterSnapshot([node("a", free=6), node("c", free=4), node("d", free=4)])
    moved = [Movable(1, "q", "a", (6,), Q_WEIGHTS), Movable(2, "r", "a", (7,), WeightsNeed("r@r1", 100))]
    view = WeightsView(caches={"c", "d"}, room={"c": 150, "d": 150})
    plan = plan_room(PlacementRequest("big", 1, 8), snapshot, moved, view=view)
    assert isinstance(plan, RoomPlan)
    assert sorted(m.destination.nodes[0] for m in plan.moves) == ["c", "d"]


def test_room_is_made_only_on_nodes_that_may_take_the_pending_replicas_weights():
    snapshot = ClusterSnapshot([node("p1", free=7), node("p2", free=7), node("s", free=2)])
    moved = [Movable(1, "q", "p1", (7,)), Movable(2, "q", "p2", (7,))]
    request = PlacementRequest("big", 1, 8)
    assert plan_room(request, snapshot, moved).nodes == ("p1",)  # by name, all else equal
    both = {"p1": 10**6, "p2": 10**6, "s": 10**6}
    assert plan_room(request, snapshot, moved, view=WeightsView(caches={"p2", "s"}, room=both),
                     need=BIG_WEIGHTS).nodes == ("p2",)
    # Both may: the one that holds them, so that it starts without a download.
    view = WeightsView(caches={"p1", "p2", "s"}, holders={"big@r1": {"p2"}}, room=both)
    assert plan_room(request, snapshot, moved, view=view, need=BIG_WEIGHTS).nodes == ("p2",)
    # Neither may: the reason says so.
    plan = plan_room(request, snapshot, moved, view=WeightsView(caches={"s"}, room=both), need=BIG_WEIGHTS)
    assert isinstance(plan, NoRoom)
    assert plan.reason == ("no set of moves makes room (fabric-less nodes: only 0 node(s) could be cleared to 8 free "
                           "(and 2 without room for big@r1))")
