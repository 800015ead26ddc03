"""Writes to nodes: registration, inventory, status, cordon, the lost-node sweep."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from . import hooks, liveness, watch
from .choices import LIVE, NODE_TRANSITIONS, EventKind, EventSeverity, NodeStatus
from .exceptions import InvalidTransition, InventoryRejected, NotFound
from .models import ControlPlaneClock, Event, Fabric, Gpu, Hca, Node

logger = logging.getLogger(__name__)


def event_record(
    *,
    kind: str,
    subject: str,
    message: str,
    node: Node | None = None,
    severity: str = EventSeverity.INFO,
    data: dict[str, Any] | None = None,
) -> Event:
    log = logger.warning if severity != EventSeverity.INFO else logger.info
    log("event kind=%s subject=%s %s", kind, subject, message)
    return Event.objects.create(
        kind=kind, subject=subject, message=message, node=node, severity=severity, data=data or {}
    )


def _bump_on_commit(node_names: list[str]) -> None:
    """After commit: invalidate the agent API's cached view of the nodes and
    wake their parked desired-state long-polls (one Redis round trip)."""
    transaction.on_commit(lambda: liveness.store().bump_many(node_names, channel=watch.CHANNEL))


def nodes_desired_changed(*, node_names: list[str]) -> None:
    """What the nodes should run changed: bump their versions (inside the
    caller's transaction) and tell their agents after commit."""
    Node.objects.filter(name__in=node_names).update(desired_version=F("desired_version") + 1)
    _bump_on_commit(node_names)


def node_desired_changed(*, node_name: str) -> None:
    nodes_desired_changed(node_names=[node_name])


def node_transition(
    *,
    node_name: str,
    to: str,
    reason: str = "",
    expected: str | None = None,
    severity: str = EventSeverity.INFO,
) -> Node | None:
    """The one place a node's status changes.

    With ``expected``, a compare-and-set: if the node is no longer in that
    status, nothing happens and None is returned.
    """
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(name=node_name).first()
        if node is None:
            raise NotFound(f"no node named {node_name!r}; 'llmgw ctl nodes' lists them")
        if expected is not None and node.status != expected:
            return None
        if to not in NODE_TRANSITIONS.get(node.status, set()):
            raise InvalidTransition(f"node {node_name} is {node.status}; it cannot become {to}")
        previous = node.status
        node.status = to
        node.status_changed_at = timezone.now()
        node.status_reason = reason[:255]
        node.save(update_fields=["status", "status_changed_at", "status_reason"])
        message = f"{previous} -> {to}" + (f": {reason}" if reason else "")
        event_record(
            kind=EventKind.NODE_STATUS,
            subject=f"node/{node_name}",
            message=message,
            node=node,
            severity=severity,
            data={"from": previous, "to": to},
        )
        _bump_on_commit([node_name])
    return node


def node_cordon(*, node_name: str) -> Node:
    return node_transition(node_name=node_name, to=NodeStatus.CORDONED, reason="cordoned by an operator")


def node_uncordon(*, node_name: str) -> Node:
    return node_transition(node_name=node_name, to=NodeStatus.READY, reason="uncordoned by an operator")


# --- heartbeats ---------------------------------------------------------------


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
    # leave its own 'fabric' empty (the serializer refuses contradictions).
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


# --- the lost-node sweep ------------------------------------------------------


def _clock_update(now: dt.datetime) -> dt.datetime | None:
    """Advance the control plane's own clock of hearing; return the moment from
    which nodes can be blamed for silence, or None if we cannot hear anyone."""
    deaf_after = settings.LLMGW_DEAF_AFTER
    listener = liveness.store().listener_alive_at()
    listener_silent = listener is None or now.timestamp() - listener > deaf_after
    with transaction.atomic():
        clock, _ = ControlPlaneClock.objects.select_for_update().get_or_create(pk=1)
        sweep_gap = clock.last_sweep_at is None or (now - clock.last_sweep_at).total_seconds() > deaf_after
        if listener_silent:
            if clock.deaf_since is None:
                clock.deaf_since = now
                event_record(
                    kind=EventKind.CONTROL_PLANE,
                    subject="control-plane",
                    message="the agent API has not been running for "
                    f"{deaf_after:.0f}s; no node will be declared lost until it is back",
                    severity=EventSeverity.WARNING,
                )
            clock.heard_since = None
        elif clock.heard_since is None or clock.deaf_since is not None or sweep_gap:
            clock.heard_since = now
            clock.deaf_since = None
            event_record(
                kind=EventKind.CONTROL_PLANE,
                subject="control-plane",
                message="hearing nodes again; every node gets a fresh grace period of "
                f"{settings.LLMGW_NODE_GRACE:.0f}s from now",
            )
        clock.last_sweep_at = now
        clock.save()
    return clock.heard_since


def _mass_silence(*, silent: int, live: int, now: dt.datetime) -> bool:
    """Most nodes going silent at the same moment is more likely our own
    network than a mass death: hold failovers and say so loudly (Kubernetes
    stops evicting when a whole zone looks unhealthy, for the same reason)."""
    fraction = settings.LLMGW_MASS_SILENCE_FRACTION
    holding = 0 < fraction < 1 and silent >= 2 and silent > fraction * live
    with transaction.atomic():
        clock = ControlPlaneClock.objects.select_for_update().get(pk=1)
        if holding and clock.holding_since is None:
            clock.holding_since = now
            event_record(
                kind=EventKind.CONTROL_PLANE,
                subject="control-plane",
                message=f"{silent} of {live} nodes went silent at once: suspecting the control plane's "
                "own network rather than the nodes, so no node is declared lost and no replica is "
                "failed over. Check the network between the control plane and the nodes; if the "
                "nodes really are down, set LLMGW_MASS_SILENCE_FRACTION=1 to let failover proceed",
                severity=EventSeverity.ERROR,
            )
        elif not holding and clock.holding_since is not None:
            clock.holding_since = None
            event_record(
                kind=EventKind.CONTROL_PLANE,
                subject="control-plane",
                message=f"no longer holding failovers ({silent} of {live} nodes silent)",
            )
        clock.save(update_fields=["holding_since"])
    return holding


def nodes_sweep_lost(*, now: dt.datetime | None = None) -> list[str]:
    """Mark nodes unheard for longer than the grace period as lost.

    Compare-and-set per node; safe to run concurrently and repeatedly.
    """
    now = now or timezone.now()
    grace = dt.timedelta(seconds=settings.LLMGW_NODE_GRACE)
    heard_since = _clock_update(now)
    if heard_since is None:
        return []
    store = liveness.store()
    seen = store.seen_all()
    stale_copies = []
    overdue = []
    # Nodes that fell silent together cross the deadline up to a heartbeat
    # apart: count as silent every node past half its grace, so that the first
    # one overdue is not failed over before the others are counted with it.
    silent = 0
    live = 0
    for node in Node.objects.filter(status__in=LIVE).only("id", "name", "status", "last_heartbeat_at", "status_changed_at"):
        live += 1
        last_ts = seen.get(node.name)
        last = timezone.datetime.fromtimestamp(last_ts, tz=dt.timezone.utc) if last_ts else node.last_heartbeat_at
        if last and (node.last_heartbeat_at is None or last - node.last_heartbeat_at > dt.timedelta(seconds=30)):
            node.last_heartbeat_at = last
            stale_copies.append(node)
        reference = max(filter(None, [last, node.status_changed_at, heard_since]))
        if now - reference > grace / 2:
            silent += 1
        if now - reference > grace:
            overdue.append((node, last))
    if stale_copies:
        Node.objects.bulk_update(stale_copies, ["last_heartbeat_at"], batch_size=500)
    if _mass_silence(silent=silent, live=live, now=now):
        return []
    lost = []
    for node, last in overdue:
        # A heartbeat may have landed since seen_all(): look once more.
        latest = store.seen(node.name)
        if latest and now.timestamp() - latest <= grace.total_seconds():
            continue
        silent_for = (now - (last or node.status_changed_at)).total_seconds()
        changed = node_transition(
            node_name=node.name,
            to=NodeStatus.LOST,
            expected=node.status,
            reason=f"no heartbeat for {silent_for:.0f}s (grace {grace.total_seconds():.0f}s)",
            severity=EventSeverity.ERROR,
        )
        if changed is not None:
            lost.append(node.name)
            for handler in hooks.node_lost_handlers:
                handler(node_name=node.name)
    return lost
