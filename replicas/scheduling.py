"""Placing pending replicas: a snapshot of the cluster, the pure ``place``
function of ``replicas.scheduler``, and persistence under row locks.

The snapshot is read once per batch and updated in memory as replicas are
placed; the database has the last word: a GPU allocated twice violates a
unique constraint, and the batch starts again from a fresh snapshot.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q

from nodes.choices import EventKind, EventSeverity, NodeStatus
from nodes.models import Fabric, Gpu, Node
from nodes.services import event_record, node_desired_changed

from . import scheduler
from .choices import PLACED, MemberState, ReplicaStatus
from .launch import member_launch
from .models import GpuAllocation, Member, Model, PortAllocation, Replica
from .services import replica_transition

logger = logging.getLogger(__name__)


class PlacementConflict(Exception):
    """The snapshot was stale: another worker took what we chose."""


def _orphaned_nodes(nodes: list[Node]) -> set[str]:
    """Nodes still running engines the control plane does not want there
    (a node back from the dead, fencing its old replicas): nothing new goes
    to them until those have stopped."""
    wanted = defaultdict(set)
    for node_name, member_pk in Member.objects.exclude(state=MemberState.GONE).filter(
        Q(replica__status__in=PLACED) | Q(replica__status=ReplicaStatus.STOPPING, replica__quiesced=False)
    ).values_list("node__name", "pk"):
        wanted[node_name].add(f"m{member_pk}")
    orphaned = set()
    for node in nodes:
        for engine in node.engines or []:
            if engine.get("state") != "exited" and engine.get("member") not in wanted[node.name]:
                orphaned.add(node.name)
    return orphaned


def cluster_snapshot() -> scheduler.ClusterSnapshot:
    # Lost nodes too, unschedulable: a reason names them, and never_fits must
    # not call a shape impossible while a node is only away.
    nodes = list(Node.objects.only("id", "name", "status", "engines"))
    by_id = {n.id: n for n in nodes}
    fabrics = defaultdict(list)
    for node_id, fabric in Node.fabrics.through.objects.values_list("node_id", "fabric__name"):
        fabrics[node_id].append(fabric)
    allocated = set(GpuAllocation.objects.values_list("gpu_id", flat=True))
    free = defaultdict(list)
    total = defaultdict(int)
    for gpu_id, node_id, index in Gpu.objects.values_list("id", "node_id", "index"):
        total[node_id] += 1
        if gpu_id not in allocated:
            free[node_id].append(index)
    orphaned = _orphaned_nodes(nodes)
    snapshots = []
    for node_id, node in by_id.items():
        schedulable = node.status == NodeStatus.READY and node.name not in orphaned
        state = node.status if node.status != NodeStatus.READY else ("fencing old engines" if node.name in orphaned else "ready")
        snapshots.append(
            scheduler.NodeSnapshot(
                node.name,
                fabrics=tuple(fabrics[node_id]),
                free_gpus=tuple(free[node_id]),
                total_gpus=total[node_id],
                schedulable=schedulable,
                state=state,
            )
        )
    existing = defaultdict(lambda: {"model": None, "fabric": None, "nodes": []})
    for replica_id, model, fabric, node_name in Member.objects.filter(replica__status__in=PLACED).values_list(
        "replica_id", "replica__model__name", "replica__fabric__name", "node__name"
    ):
        entry = existing[replica_id]
        entry["model"], entry["fabric"] = model, fabric
        entry["nodes"].append(node_name)
    replicas = [scheduler.ExistingReplica(e["model"], e["fabric"], tuple(e["nodes"])) for e in existing.values()]
    return scheduler.ClusterSnapshot(snapshots, replicas)


def _free_ports(node: Node, count: int) -> list[int]:
    taken = set(PortAllocation.objects.filter(node=node).values_list("port", flat=True))
    ports = []
    for port in range(settings.LLMGW_PORT_MIN, settings.LLMGW_PORT_MAX + 1):
        if port not in taken:
            ports.append(port)
            if len(ports) == count:
                return ports
    raise PlacementConflict(f"node {node.name} has no free port in {settings.LLMGW_PORT_MIN}-{settings.LLMGW_PORT_MAX}")


def replica_persist(*, replica_id: int, placement: scheduler.Placement) -> Replica | None:
    """Give a pending replica the placement's nodes, GPUs and ports."""
    with transaction.atomic():
        replica = Replica.objects.select_for_update().select_related("model").filter(pk=replica_id).first()
        if replica is None or replica.status != ReplicaStatus.PENDING:
            return None
        names = [m.node for m in placement.members]
        nodes = {n.name: n for n in Node.objects.select_for_update().filter(name__in=names).prefetch_related("hcas__fabric")}
        for name in names:
            if name not in nodes or nodes[name].status != NodeStatus.READY:
                raise PlacementConflict(f"node {name} is no longer ready")
        gpu_ids = {
            (node_id, index): gpu_id
            for gpu_id, node_id, index in Gpu.objects.filter(node__name__in=names).values_list("id", "node_id", "index")
        }
        from .engines import member_ports

        members, allocated = [], []
        for rank, spec in enumerate(placement.members):
            node = nodes[spec.node]
            member = Member.objects.create(replica=replica, node=node, rank=rank, gpus=list(spec.gpus))
            GpuAllocation.objects.bulk_create(
                [GpuAllocation(gpu_id=gpu_ids[(node.id, i)], member=member, node=node) for i in spec.gpus]
            )
            purposes = member_ports(replica.model.engine, nodes=replica.model.nodes, rank=rank)
            ports = dict(zip(purposes, _free_ports(node, len(purposes)))) if purposes else {}
            allocated += [PortAllocation(node=node, port=port, member=member, purpose=purpose)
                          for purpose, port in ports.items()]
            members.append((member, ports))
        PortAllocation.objects.bulk_create(allocated)
        leader, leader_ports = members[0][0].node, members[0][1]
        for member, ports in members:
            spec = member_launch(
                model=replica.model,
                member=member,
                node=nodes[member.node.name],
                fabric=placement.fabric,
                leader=leader,
                http_port=leader_ports["http"],
                rendezvous_port=leader_ports.get("rendezvous"),
                worker_port=next(iter(ports.values()), None) if member.rank else None,
            )
            member.argv, member.env, member.ports = spec["argv"], spec["env"], spec["ports"]
            member.serves_http, member.health_url = spec["serves_http"], spec["health_url"] or ""
            member.save(update_fields=["argv", "env", "ports", "serves_http", "health_url"])
        replica.fabric = Fabric.objects.get(name=placement.fabric) if placement.fabric else None
        replica.save(update_fields=["fabric"])
        where = " + ".join(f"{m.node} GPUs {','.join(map(str, m.gpus))}" for m in placement.members)
        replica_transition(
            replica_id=replica.pk,
            to=ReplicaStatus.SCHEDULED,
            expected=ReplicaStatus.PENDING,
            reason=f"on {placement.fabric or 'a fabric-less node'}: {where}",
        )
        for name in names:
            node_desired_changed(node_name=name)
    return replica


def _record_pending(replica: Replica, reason: str, never: bool) -> None:
    if replica.pending_reason == reason:
        return
    Replica.objects.filter(pk=replica.pk, status=ReplicaStatus.PENDING).update(pending_reason=reason)
    event_record(
        kind=EventKind.REPLICA_PENDING,
        subject=f"replica/{replica.pk}",
        message=f"{replica.model.name} replica {replica.pk} stays pending: {reason}",
        severity=EventSeverity.ERROR if never else EventSeverity.WARNING,
        data={"model": replica.model.name, "replica": replica.pk, "never": never},
    )


def replicas_schedule_pending(*, attempts: int = 3) -> int:
    """Place every pending replica that fits, oldest first. Returns how many were placed."""
    placed = 0
    for _ in range(attempts):
        pending = list(Replica.objects.filter(status=ReplicaStatus.PENDING).select_related("model").order_by("id"))
        if not pending:
            return placed
        snapshot = cluster_snapshot()
        conflict = False
        for replica in pending:
            model = replica.model
            request = scheduler.PlacementRequest(model.name, model.nodes, model.gpus_per_node)
            result = scheduler.place(request, snapshot)
            if isinstance(result, scheduler.Unplaceable):
                _record_pending(replica, result.reason, result.never)
                continue
            try:
                if replica_persist(replica_id=replica.pk, placement=result) is not None:
                    placed += 1
                    snapshot.allocate(result)
            except (IntegrityError, PlacementConflict) as exc:
                logger.info("placement conflict replica=%s: %s; retrying from a fresh snapshot", replica.pk, exc)
                conflict = True
                break
        if not conflict:
            return placed
    return placed


def model_never_fits(model: Model, *, snapshot: scheduler.ClusterSnapshot | None = None) -> str | None:
    request = scheduler.PlacementRequest(model.name, model.nodes, model.gpus_per_node)
    return scheduler.never_fits(request, snapshot or cluster_snapshot())
