"""Placing pending replicas: a snapshot of the cluster, the pure ``place``
function of ``replicas.placement``, and persistence under row locks.

The snapshot is read once per batch and updated in memory as replicas are
placed; the database has the last word: a GPU allocated twice violates a
unique constraint, and the batch starts again from a fresh snapshot.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from django.conf import settings
from django.db import IntegrityError, connection, transaction

from core.bulk import rows_insert, rows_insert_returning
from core.choices import EventSeverity
from core.events import events_record
from core.models import Event
from nodes.choices import NodeStatus
from nodes.models import Fabric, Gpu, Hca, Node
from nodes.services import nodes_desired_changed

from . import defrag, placement
from .choices import PLACED, ReplicaEventKind, ReplicaStatus
from .engines import member_ports
from .launch import member_launch
from .models import CatalogEntry, GpuAllocation, Member, ModelRevision, PortAllocation, Replica
from .revisions import replica_launch
from .selectors import members_wanted
from .services import replicas_transition_scheduled
from .weights_cache import replicas_staging_begin, weights_need, weights_view
from .weights_placement import place_weights

logger = logging.getLogger(__name__)


class PlacementConflict(Exception):
    """The snapshot was stale: another worker took what we chose."""


def _orphaned_nodes(nodes: list[Node]) -> set[str]:
    """Nodes still running engines the control plane does not want there
    (a node back from the dead, fencing its old replicas): nothing new goes
    to them until those have stopped."""
    wanted = defaultdict(set)
    for node_name, member_pk in members_wanted().values_list("node__name", "pk"):
        wanted[node_name].add(f"m{member_pk}")
    orphaned = set()
    for node in nodes:
        for engine in node.engines or []:
            if engine.get("state") not in ("exited", "backoff") and engine.get("member") not in wanted[node.name]:
                orphaned.add(node.name)
    return orphaned


def cluster_snapshot() -> placement.ClusterSnapshot:
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
    # A missing or quarantined GPU is neither capacity nor free (Gpu.objects.in_service).
    for gpu_id, node_id, index in Gpu.objects.in_service().values_list("id", "node_id", "index"):
        total[node_id] += 1
        if gpu_id not in allocated:
            free[node_id].append(index)
    orphaned = _orphaned_nodes(nodes)
    snapshots = []
    for node_id, node in by_id.items():
        schedulable = node.status == NodeStatus.READY and node.name not in orphaned
        state = node.status if node.status != NodeStatus.READY else ("fencing old engines" if node.name in orphaned else "ready")
        snapshots.append(
            placement.NodeSnapshot(
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
    replicas = [placement.ExistingReplica(e["model"], e["fabric"], tuple(e["nodes"])) for e in existing.values()]
    return placement.ClusterSnapshot(snapshots, replicas)


class _PortBook:
    """Free ports per node, read once per batch."""

    def __init__(self, node_ids: set[int]) -> None:
        self.taken: dict[int, set[int]] = defaultdict(set)
        for node_id, port in PortAllocation.objects.filter(node_id__in=node_ids).values_list("node_id", "port"):
            self.taken[node_id].add(port)

    def take(self, node: Node, count: int) -> list[int]:
        taken = self.taken[node.id]
        ports = []
        for port in range(settings.LLMGW_PORT_MIN, settings.LLMGW_PORT_MAX + 1):
            if port not in taken:
                ports.append(port)
                if len(ports) == count:
                    taken.update(ports)
                    return ports
        raise PlacementConflict(
            f"node {node.name} has no free port in {settings.LLMGW_PORT_MIN}-{settings.LLMGW_PORT_MAX}"
        )


def nodes_lock(names) -> dict[str, Node]:
    """Lock the named nodes' rows in ascending pk (the lock order:
    docs/architecture.md), only their own rows, FOR NO KEY UPDATE; read with
    what launch specs use (replicas.launch), not the inventory's JSON."""
    return {
        n.name: n
        for n in Node.objects.select_for_update(of=("self",), no_key=True).filter(name__in=set(names))
        .only("id", "name", "status", "mgmt_addr", "mgmt_interface").order_by("pk")
    }


def placements_persist(items: list[tuple[Replica, placement.Placement]]) -> list[Replica]:
    """Give pending replicas their placements' nodes, GPUs and ports, in one
    transaction. The unique GPU and port constraints have the last word: a
    stale snapshot raises IntegrityError and nothing of the batch is kept."""
    if not items:
        return []
    with transaction.atomic():
        # The lock order (docs/architecture.md): nodes in ascending pk, then
        # replicas in ascending pk; only their own rows, FOR NO KEY UPDATE.
        names = sorted({m.node for _, p in items for m in p.members})
        nodes = nodes_lock(names)
        for name in names:
            if name not in nodes or nodes[name].status != NodeStatus.READY:
                raise PlacementConflict(f"node {name} is no longer ready")
        # Those still pending; the caller's instances, with their model and
        # revision loaded, are written (a pending replica's launch is fixed).
        locked = set(
            Replica.objects.select_for_update(of=("self",), no_key=True)
            .filter(pk__in=[r.pk for r, _ in items], status=ReplicaStatus.PENDING).order_by("pk")
            .values_list("pk", flat=True)
        )
        items = [(r, p) for r, p in items if r.pk in locked]
        if not items:
            return []
        node_ids = [n.id for n in nodes.values()]
        nodes_by_id = {n.id: n.name for n in nodes.values()}
        gpu_ids = {
            (node_id, index): gpu_id
            for gpu_id, node_id, index in Gpu.objects.in_service().filter(node_id__in=node_ids)
            .values_list("id", "node_id", "index")
        }
        # Each node's HCAs per fabric (NCCL_IB_HCA of its members).
        hcas: dict[tuple[int, str], list[str]] = defaultdict(list)
        for node_id, hca, fabric in Hca.objects.filter(node_id__in=node_ids, fabric__isnull=False).values_list(
            "node_id", "name", "fabric__name"
        ):
            hcas[(node_id, fabric)].append(hca)
        fabrics = {f.name: f for f in Fabric.objects.filter(name__in={p.fabric for _, p in items if p.fabric})}
        book = _PortBook(set(node_ids))
        # Launch specs first: they depend on the placement, not on row ids,
        # so each member is written once, whole.
        members: list[Member] = []
        port_plan: list[dict[str, int]] = []
        for replica, plan in items:
            # Launched as its revision says, not as the entry is now (replicas.revisions).
            model = replica_launch(replica)
            planned = []
            for rank, spec in enumerate(plan.members):
                node = nodes[spec.node]
                purposes = member_ports(model.engine, nodes=model.nodes, rank=rank)
                planned.append((rank, spec, node, dict(zip(purposes, book.take(node, len(purposes)))) if purposes else {}))
            leader_ports = planned[0][3]
            for rank, spec, node, ports in planned:
                member = Member(replica=replica, node=node, rank=rank, gpus=list(spec.gpus))
                launch = member_launch(
                    model=model, member=member, node=node, fabric=plan.fabric, hcas=hcas[(node.id, plan.fabric)],
                    leader=planned[0][2], http_port=leader_ports["http"],
                    rendezvous_port=leader_ports.get("rendezvous"),
                    worker_port=next(iter(ports.values()), None) if rank else None,
                )
                member.argv, member.env, member.ports = launch["argv"], launch["env"], launch["ports"]
                member.serves_http, member.health_url = launch["serves_http"], launch["health_url"] or ""
                members.append(member)
                port_plan.append(ports)
            replica.fabric = fabrics.get(plan.fabric) if plan.fabric else None
        gone = sorted({f"{nodes_by_id[m.node_id]}:{i}" for m in members for i in m.gpus
                       if (m.node_id, i) not in gpu_ids})
        if gone:
            # The snapshot is older than a quarantine (or a GPU gone): place again.
            raise PlacementConflict(f"GPU {', '.join(gone)} is no longer in service")
        # COPY on PostgreSQL (core.bulk): the members with ids drawn first,
        # then their allocations, which nothing reads back.
        ids = rows_insert_returning(Member, [
            {"replica_id": m.replica_id, "node_id": m.node_id, "rank": m.rank, "gpus": m.gpus, "ports": m.ports,
             "argv": m.argv, "env": m.env, "serves_http": m.serves_http, "health_url": m.health_url}
            for m in members
        ])
        for member, pk in zip(members, ids):
            member.pk = pk
        rows_insert(GpuAllocation, [
            {"gpu_id": gpu_ids[(m.node_id, i)], "member_id": m.pk, "node_id": m.node_id}
            for m in members for i in m.gpus
        ])
        rows_insert(PortAllocation, [
            {"node_id": m.node_id, "port": port, "member_id": m.pk, "purpose": purpose}
            for m, ports in zip(members, port_plan) for purpose, port in ports.items()
        ])
        reasons = {
            replica.pk: f"on {plan.fabric or 'a fabric-less node'}: "
            + " + ".join(f"{m.node} GPUs {','.join(map(str, m.gpus))}" for m in plan.members)
            for replica, plan in items
        }
        replicas = [replica for replica, _ in items]
        replicas_transition_scheduled(replicas=replicas, reasons=reasons)
        replicas_staging_begin(replicas=replicas)
        nodes_desired_changed(node_names=names, held=True)
    return replicas


def _pending_note(replica: Replica, reason: str, never: bool) -> tuple[Replica, str, Event] | None:
    """Why a replica stays pending, if that changed: its new reason and Event."""
    current = replica.pending_reason
    if current == reason or current.startswith(reason + "; "):
        return None  # unchanged (a note the defragmentation added after "; " stays)
    if defrag.MAKING_ROOM in current and not never:
        # Moves for it are in flight (replicas.moves): keep saying so.
        reason += current[current.index(defrag.MAKING_ROOM):]
    return replica, reason, Event(
        kind=ReplicaEventKind.REPLICA_PENDING,
        subject=f"replica/{replica.pk}",
        message=f"{replica.model.name} replica {replica.pk} stays pending: {reason}",
        severity=EventSeverity.ERROR if never else EventSeverity.WARNING,
        data={"model": replica.model.name, "replica": replica.pk, "never": never},
    )


def _pending_notes_record(notes: list[tuple[Replica, str, Event]]) -> None:
    """Write the reasons of the replicas that stay pending, and their Events,
    in one transaction of a few statements (replicas in ascending pk, the lock
    order): a reason changes only while its replica is still pending."""
    if not notes:
        return
    meta, q = Replica._meta, connection.ops.quote_name
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.executemany(
                f"UPDATE {q(meta.db_table)} SET {q(meta.get_field('pending_reason').column)} = %s "
                f"WHERE {q(meta.pk.column)} = %s AND {q(meta.get_field('status').column)} = %s",
                [(reason, replica.pk, ReplicaStatus.PENDING) for replica, reason, _ in sorted(notes, key=lambda n: n[0].pk)],
            )
        events_record([event for _, _, event in notes])
    notes.clear()


def _pending_read() -> list[Replica]:
    """The pending replicas, oldest first, each with its model and revision:
    read once per model and revision (a few), not once per replica."""
    pending = list(Replica.objects.filter(status=ReplicaStatus.PENDING).order_by("id"))
    models = CatalogEntry.objects.in_bulk({r.model_id for r in pending})
    revisions = ModelRevision.objects.in_bulk({r.revision_id for r in pending if r.revision_id is not None})
    for replica in pending:
        # One gone meanwhile (a model removed) is left to load, as before.
        if replica.model_id in models:
            replica.model = models[replica.model_id]
        if replica.revision_id in revisions:
            replica.revision = revisions[replica.revision_id]
    return pending


def replicas_schedule_pending(*, attempts: int = 3, batch: int = 100) -> int:
    """Place every pending replica that fits, oldest first, ``batch`` per
    transaction. Returns how many were placed."""
    placed = 0
    for _ in range(attempts):
        pending = _pending_read()
        if not pending:
            return placed
        snapshot = cluster_snapshot()
        view = None  # the nodes' weights caches, read once a managed model needs them
        chosen: list[tuple[Replica, placement.Placement]] = []
        notes: list[tuple[Replica, str, Event]] = []
        conflict = False
        for index, replica in enumerate(pending):
            model = replica_launch(replica)
            request = placement.PlacementRequest(model.name, model.nodes, model.gpus_per_node)
            need = weights_need(model)
            if need is None:
                result = placement.place(request, snapshot)
            else:
                view = view or weights_view()
                result = place_weights(request, snapshot, view, need)
                if isinstance(result, placement.Placement):
                    view.reserve(result, need)
            if isinstance(result, placement.Unplaceable):
                note = _pending_note(replica, result.reason, result.never)
                if note:
                    notes.append(note)
            else:
                snapshot.allocate(result)
                chosen.append((replica, result))
            if chosen and (len(chosen) >= batch or index == len(pending) - 1):
                try:
                    placed += len(placements_persist(chosen))
                except (IntegrityError, PlacementConflict) as exc:
                    logger.info("placement conflict (%s); retrying from a fresh snapshot", exc)
                    conflict = True
                    break
                chosen = []
            if len(notes) >= batch:
                _pending_notes_record(notes)
        _pending_notes_record(notes)
        if not conflict:
            return placed
    return placed


def model_never_fits(model: CatalogEntry, *, snapshot: placement.ClusterSnapshot | None = None) -> str | None:
    request = placement.PlacementRequest(model.name, model.nodes, model.gpus_per_node)
    return placement.never_fits(request, snapshot or cluster_snapshot())
