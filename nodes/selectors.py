"""Reads about nodes."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.db.models import Prefetch, QuerySet
from django.utils import timezone

from . import hooks, liveness
from .models import Fabric, Gpu, GpuConflict, Hca, Node


def node_list() -> QuerySet[Node]:
    return Node.objects.prefetch_related(
        "fabrics",
        Prefetch("gpus", queryset=Gpu.objects.order_by("index")),
        Prefetch("hcas", queryset=Hca.objects.select_related("fabric").order_by("name")),
    )


def node_get(*, name: str) -> Node | None:
    return node_list().filter(name=name).first()


def _seen_at(node, ts: float | None) -> dt.datetime | None:
    return dt.datetime.fromtimestamp(ts, tz=dt.timezone.utc) if ts else node.last_heartbeat_at


def node_last_seen(nodes) -> dict[str, dt.datetime | None]:
    """Last heartbeat of each node: the liveness store's, or the stored copy."""
    seen = liveness.store().seen_all()
    return {node.name: _seen_at(node, seen.get(node.name)) for node in nodes}


def node_seen(node) -> dt.datetime | None:
    """One node's last heartbeat (one read, not every node's)."""
    return _seen_at(node, liveness.store().seen(node.name))


def node_desired_state(*, node_name: str, version: int) -> dict[str, Any]:
    """What the node should run, from the apps that place work on nodes."""
    members: list[dict[str, Any]] = []
    for provider in hooks.desired_member_providers:
        members.extend(provider(node_name=node_name))
    weights: list[dict[str, Any]] = []
    for provider in hooks.desired_weights_providers:
        weights.extend(provider(node_name=node_name))
    desired = {"version": version, "members": members}
    if weights:  # absent means none (agent.protocol.DesiredState's default)
        desired["weights"] = weights
    return desired


def node_replica_counts() -> dict[str, int]:
    counts: dict[str, int] = {}
    for counter in hooks.replica_counters:
        for name, count in counter().items():
            counts[name] = counts.get(name, 0) + count
    return counts


def node_gpu_conflicts() -> dict[str, list[dict[str, Any]]]:
    """{node name: the GPU claims it is part of}, as claimant and as holder."""
    result: dict[str, list[dict[str, Any]]] = {}
    rows = GpuConflict.objects.values_list("gpu__uuid", "gpu__node__name", "claimant__name", "since")
    for uuid, holder, claimant, since in rows.order_by("since", "pk"):
        conflict = {"gpu": uuid, "holder": holder, "claimant": claimant, "since": since}
        result.setdefault(claimant, []).append(conflict)
        result.setdefault(holder, []).append(conflict)
    return result


def fabric_list() -> QuerySet[Fabric]:
    return Fabric.objects.prefetch_related("nodes")


def age_seconds(when: dt.datetime | None) -> float | None:
    return None if when is None else max(0.0, (timezone.now() - when).total_seconds())


STALE_READINGS = 120.0  # seconds: older readings are shown as unknown


def gpu_health_list(*, node_name: str | None = None) -> list[dict[str, Any]]:
    """Every GPU that is there, with its state from the database and its
    latest readings from the telemetry store (the one merge of the two)."""
    from .telemetry import readings_of, store

    gpus = Gpu.objects.filter(missing_since=None).select_related("node").order_by("node__name", "index")
    if node_name is not None:
        gpus = gpus.filter(node__name=node_name)
    try:
        latest = store().latest(node_name)
    except Exception:  # noqa: BLE001 - Redis away: states from the database, no readings
        latest = {}
    now = timezone.now().timestamp()
    readings = {
        (name, r["index"]): (r, block.get("at"))
        for name, block in latest.items() if now - block.get("at", 0) < STALE_READINGS
        for r in readings_of(block)
    }
    rows = []
    for gpu in gpus:
        reading, at = readings.get((gpu.node.name, gpu.index), ({}, None))
        if gpu.quarantined_at is not None:
            health, reason = "quarantined", gpu.quarantine_reason
        elif reading and reading["health"] != "quarantined":
            health, reason = reading["health"], reading["reason"]
        else:
            # No reading, or one judged while the GPU was quarantined, before an
            # operator cleared it: the GPU's row is the truth, the next block says the rest.
            health, reason = "unknown", ""
        rows.append({
            "node": gpu.node.name, "index": gpu.index, "uuid": gpu.uuid, "name": gpu.name,
            "health": health, "reason": reason, "quarantined_at": gpu.quarantined_at,
            "last_xid": gpu.last_xid if gpu.last_xid is not None else reading.get("last_xid"),
            **{k: reading.get(k) for k in ("util", "mem_util", "mem_used_mib", "mem_total_mib", "temp_c", "power_w",
                                           "power_limit_w", "ecc_corrected", "ecc_uncorrected",
                                           "pending_retirement", "thermal_throttle")},
            "read_at": at,
        })
    return rows
