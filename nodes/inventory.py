"""A node's inventory, from the heartbeats that bring news: registration,
GPUs, HCAs and fabric membership, and the engines its agent reports."""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from . import hooks
from .choices import EventKind, EventSeverity, NodeStatus
from .events import event_record
from .exceptions import InventoryRejected
from .models import Fabric, Gpu, Hca, Node
from .services import node_transition


def _sync_fabrics(node: Node, inventory: dict[str, Any]) -> None:
    names = sorted({f["name"] for f in inventory["fabrics"]})
    fabrics = []
    for name in names:
        fabric, _ = Fabric.objects.get_or_create(name=name)
        fabrics.append(fabric)
    node.fabrics.set(fabrics)


def _sync_gpus(node: Node, gpus: list[dict[str, Any]]) -> None:
    wanted = {g["uuid"]: g for g in gpus}
    node.gpus.exclude(uuid__in=wanted).delete()
    existing = {g.uuid: g for g in node.gpus.all()}
    # Free the indices that will be reused by other GPUs before writing.
    for uuid, gpu in existing.items():
        if gpu.index != wanted[uuid]["index"]:
            gpu.index = 100000 + gpu.pk
            gpu.save(update_fields=["index"])
    for uuid, data in wanted.items():
        fields = {k: data[k] for k in ("index", "name", "memory_mib", "pci_bus_id")}
        if uuid in existing:
            Gpu.objects.filter(pk=existing[uuid].pk).update(**fields)
        else:
            other = Gpu.objects.filter(uuid=uuid).select_related("node").first()
            if other is not None:
                raise InventoryRejected(
                    f"GPU {uuid} is already reported by node {other.node.name}; a GPU belongs "
                    "to one node. Check that the two agents are not sharing a fake nvidia-smi "
                    "or a cloned machine image"
                )
            Gpu.objects.create(node=node, uuid=uuid, **fields)


def _sync_hcas(node: Node, hcas: list[dict[str, Any]], memberships: list[dict[str, Any]]) -> None:
    # Membership is what the node states under 'fabrics'; an HCA report may
    # leave its own 'fabric' empty (validation refuses contradictions).
    stated = {hca: f["name"] for f in memberships for hca in f["hcas"]}
    fabric_of = {h["name"]: h["fabric"] or stated.get(h["name"]) for h in hcas}
    wanted = {h["name"]: h for h in hcas}
    node.hcas.exclude(name__in=wanted).delete()
    fabrics = {f.name: f for f in Fabric.objects.filter(name__in={f for f in fabric_of.values() if f})}
    for name, data in wanted.items():
        fields = {k: data[k] for k in ("port", "state", "phys_state", "link_layer", "rate", "guid", "gid")}
        fields["fabric"] = fabrics.get(fabric_of[name]) if fabric_of[name] else None
        Hca.objects.update_or_create(node=node, name=name, defaults=fields)


def node_heartbeat_apply(
    *, node_name: str, inventory: dict[str, Any], inventory_hash: str, engines: list[dict[str, Any]]
) -> Node:
    """A heartbeat that brings news: a new node, a changed inventory, changed
    engines, or a node coming back. Stores everything or nothing."""
    now = timezone.now()
    try:
        with transaction.atomic():
            node = Node.objects.select_for_update().filter(name=node_name).first()
            if node is None:
                node = Node.objects.create(name=node_name, status=NodeStatus.REGISTERED, status_changed_at=now)
                event_record(
                    kind=EventKind.NODE_REGISTERED,
                    subject=f"node/{node_name}",
                    message=f"registered by its first heartbeat ({len(inventory['gpus'])} GPUs, "
                    f"fabrics: {', '.join(f['name'] for f in inventory['fabrics']) or 'none'})",
                    node=node,
                )
            if node.inventory_hash != inventory_hash:
                _sync_fabrics(node, inventory)
                _sync_gpus(node, inventory["gpus"])
                _sync_hcas(node, inventory["hcas"], inventory["fabrics"])
                if node.inventory_hash and node.discovery_errors != inventory["discovery_errors"]:
                    event_record(
                        kind=EventKind.NODE_INVENTORY,
                        subject=f"node/{node_name}",
                        message="discovery errors: " + ("; ".join(inventory["discovery_errors"]) or "none"),
                        node=node,
                        severity=EventSeverity.WARNING if inventory["discovery_errors"] else EventSeverity.INFO,
                    )
                elif not node.inventory_hash and inventory["discovery_errors"]:
                    event_record(
                        kind=EventKind.NODE_INVENTORY,
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
            node.engines = engines
            node.last_heartbeat_at = now
            node.save()
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

