"""A node's inventory, from the heartbeats that bring news: registration,
GPUs, HCAs and fabric membership, and the engines its agent reports."""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from core.choices import EventSeverity
from core.events import event_record

from . import hooks
from .choices import NodeEventKind, NodeStatus
from .exceptions import InventoryRejected
from .models import Fabric, Gpu, GpuConflict, Hca, Node
from .services import NODE_STATES, node_transition


def _sync_fabrics(node: Node, inventory: dict[str, Any], *, new: bool) -> None:
    names = sorted({f["name"] for f in inventory["fabrics"]})
    if names:
        # The fabrics no node named before: created at once, whatever another
        # node registering at the same moment creates too.
        known = set(Fabric.objects.filter(name__in=names).values_list("name", flat=True))
        if len(known) < len(names):
            Fabric.objects.bulk_create([Fabric(name=n) for n in names if n not in known], ignore_conflicts=True)
    fabrics = list(Fabric.objects.filter(name__in=names)) if names else []
    if new:
        node.fabrics.add(*fabrics)
    else:
        node.fabrics.set(fabrics)


def _sync_gpus(node: Node, gpus: list[dict[str, Any]], now, *, new: bool) -> None:
    """Store the GPUs the node reports. What it no longer reports is marked
    missing, never deleted (the node keeps its claim on the uuid, and the
    replica holding it is failed through the hooks); a uuid another node
    holds stays with that node and the claim is recorded as a conflict.
    Nothing here refuses the heartbeat."""
    wanted = {g["uuid"]: g for g in gpus}
    mine = {} if new else {g.uuid: g for g in node.gpus.all()}
    held = {
        g.uuid: g
        for g in Gpu.objects.filter(uuid__in=[u for u in wanted if u not in mine]).select_related("node")
    }
    present = {u: g for u, g in wanted.items() if u not in held}
    vanished = [g for u, g in mine.items() if u not in present and g.missing_since is None]
    # Missing first: a missing GPU keeps its last index, outside the unique
    # (node, index) of the GPUs that are there (the others renumber).
    if vanished:
        Gpu.objects.filter(pk__in=[g.pk for g in vanished]).update(missing_since=now)
    # Free the indices the reported GPUs will take before writing.
    for uuid, gpu in mine.items():
        if uuid in present and gpu.index != present[uuid]["index"]:
            Gpu.objects.filter(pk=gpu.pk).update(index=100000 + gpu.pk)
    added = []
    for uuid, data in present.items():
        fields = {k: data[k] for k in ("index", "name", "memory_mib", "pci_bus_id")}
        if uuid not in mine:
            added.append(Gpu(node=node, uuid=uuid, **fields))
            continue
        if mine[uuid].missing_since is not None:
            event_record(
                kind=NodeEventKind.GPU_MISSING, subject=f"node/{node.name}", node=node,
                message=f"GPU {uuid} (index {data['index']}) is reported again", data={"gpu": uuid},
            )
        Gpu.objects.filter(pk=mine[uuid].pk).update(missing_since=None, **fields)
    # New GPUs in one statement; a uuid another node took meanwhile is an
    # IntegrityError, which refuses the whole inventory as a single create did.
    Gpu.objects.bulk_create(added)
    for gpu in vanished:
        event_record(
            kind=NodeEventKind.GPU_MISSING, subject=f"node/{node.name}", node=node, severity=EventSeverity.WARNING,
            message=f"GPU {gpu.uuid} (index {gpu.index}) is no longer reported; marked missing: nothing new is "
            "placed on it, and a replica using it fails and is rebuilt elsewhere",
            data={"gpu": gpu.uuid},
        )
    if vanished:
        for handler in hooks.gpus_vanished_handlers:
            handler(node=node, gpu_ids=[g.pk for g in vanished])
    if held or not new:
        _record_claims(node, held)


def _record_claims(node: Node, held: dict[str, Gpu]) -> None:
    """The node's claims on GPUs other nodes hold: the holder keeps them."""
    GpuConflict.objects.filter(claimant=node).exclude(gpu__in=held.values()).delete()
    known = set(GpuConflict.objects.filter(claimant=node).values_list("gpu_id", flat=True))
    for uuid, gpu in held.items():
        if gpu.pk in known:
            continue
        GpuConflict.objects.create(claimant=node, gpu=gpu)
        holder = gpu.node.name
        message = (
            f"node {node.name} reports GPU {uuid}, which node {holder} holds: {holder} keeps it and "
            f"{node.name} is not given it. Check that the two agents do not share a fake nvidia-smi or "
            "a cloned machine image"
        )
        for about in (node, gpu.node):
            event_record(
                kind=NodeEventKind.GPU_CONFLICT, subject=f"node/{about.name}", node=about,
                severity=EventSeverity.WARNING, message=message,
                data={"gpu": uuid, "holder": gpu.node.name, "claimant": node.name},
            )


HCA_FIELDS = ("port", "state", "phys_state", "link_layer", "rate", "guid", "gid")


def _sync_hcas(node: Node, hcas: list[dict[str, Any]], memberships: list[dict[str, Any]], *, new: bool) -> None:
    # Membership is what the node states under 'fabrics'; an HCA report may
    # leave its own 'fabric' empty (validation refuses contradictions).
    stated = {hca: f["name"] for f in memberships for hca in f["hcas"]}
    fabric_of = {h["name"]: h["fabric"] or stated.get(h["name"]) for h in hcas}
    wanted = {h["name"]: h for h in hcas}
    if not new:
        node.hcas.exclude(name__in=wanted).delete()
    named = {f for f in fabric_of.values() if f}
    fabrics = {f.name: f for f in Fabric.objects.filter(name__in=named)} if named else {}
    stored = {} if new else {h.name: h for h in node.hcas.all()}
    added = []
    for name, data in wanted.items():
        fields = {k: data[k] for k in HCA_FIELDS}
        fields["fabric"] = fabrics.get(fabric_of[name]) if fabric_of[name] else None
        hca = stored.get(name)
        if hca is None:
            added.append(Hca(node=node, name=name, **fields))
        elif any(getattr(hca, k) != fields[k] for k in HCA_FIELDS) or hca.fabric_id != (
            fields["fabric"].pk if fields["fabric"] else None
        ):
            Hca.objects.filter(pk=hca.pk).update(**fields)
    Hca.objects.bulk_create(added)


def node_heartbeat_apply(
    *, node_name: str, inventory: dict[str, Any], inventory_hash: str, engines: list[dict[str, Any]]
) -> Node:
    """A heartbeat that brings news: a new node, a changed inventory, changed
    engines, or a node coming back. Stores everything or nothing."""
    now = timezone.now()
    try:
        with transaction.atomic():
            node = Node.objects.select_for_update(no_key=True).filter(name=node_name).first()
            new = node is None
            if new:
                # Created whole, in one statement; the row is ours until commit.
                node = Node.objects.create(
                    name=node_name, status=NodeStatus.REGISTERED, status_changed_at=now,
                    mgmt_addr=inventory["mgmt_addr"], mgmt_interface=inventory["mgmt_interface"],
                    agent_version=inventory["agent_version"], discovery_errors=inventory["discovery_errors"],
                    inventory_hash=inventory_hash, engines=engines, last_heartbeat_at=now,
                )
                event_record(
                    kind=NodeEventKind.NODE_REGISTERED,
                    subject=f"node/{node_name}",
                    message=f"registered by its first heartbeat ({len(inventory['gpus'])} GPUs, "
                    f"fabrics: {', '.join(f['name'] for f in inventory['fabrics']) or 'none'})",
                    node=node,
                )
            stored_hash = "" if new else node.inventory_hash
            if stored_hash != inventory_hash:
                # A new node has nothing stored yet: its inventory is written
                # without first reading what it had.
                _sync_fabrics(node, inventory, new=new)
                _sync_gpus(node, inventory["gpus"], now, new=new)
                _sync_hcas(node, inventory["hcas"], inventory["fabrics"], new=new)
                if stored_hash and node.discovery_errors != inventory["discovery_errors"]:
                    event_record(
                        kind=NodeEventKind.NODE_INVENTORY,
                        subject=f"node/{node_name}",
                        message="discovery errors: " + ("; ".join(inventory["discovery_errors"]) or "none"),
                        node=node,
                        severity=EventSeverity.WARNING if inventory["discovery_errors"] else EventSeverity.INFO,
                    )
                elif not stored_hash and inventory["discovery_errors"]:
                    event_record(
                        kind=NodeEventKind.NODE_INVENTORY,
                        subject=f"node/{node_name}",
                        message="discovery errors: " + "; ".join(inventory["discovery_errors"]),
                        node=node,
                        severity=EventSeverity.WARNING,
                    )
                node.mgmt_addr = inventory["mgmt_addr"]
                node.mgmt_interface = inventory["mgmt_interface"]
                node.agent_version = inventory["agent_version"]
                node.discovery_errors = inventory["discovery_errors"]
                node.inventory_hash = inventory_hash
            if new:
                # Ready in the same transaction (an Event for each step): a
                # node just created holds no members, so there is no engine
                # report to apply against them.
                NODE_STATES.apply(node, to=NodeStatus.READY, reason="first heartbeat")
                return node
            node.engines = engines
            node.last_heartbeat_at = now
            node.save()
            if node.status == NodeStatus.LOST:
                # Back from the dead: whatever it held was failed when it was
                # declared lost. Should that follow-up not have run (a worker
                # that died right after the sweep's commit), it runs now,
                # before anything the node reports is believed.
                for handler in hooks.node_lost_handlers:
                    handler(node_name=node_name)
            for handler in hooks.engine_report_handlers:
                handler(node=node, engines=engines)
    except IntegrityError as exc:
        raise InventoryRejected(f"inventory conflicts with what is stored: {exc}") from exc
    if node.status in (NodeStatus.REGISTERED, NodeStatus.LOST):
        reason = "first heartbeat" if node.status == NodeStatus.REGISTERED else (
            "heartbeating again; it comes back empty, its replicas were rebuilt elsewhere"
        )
        node_transition(node_name=node_name, to=NodeStatus.READY, reason=reason, expected=node.status)
        node.refresh_from_db()
    return node

