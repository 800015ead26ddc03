"""The cluster grid: every node and GPU with the replica holding it.

Built from one query per table with ``values()`` (no model instances), so a
cluster of 1,000 nodes x 8 GPUs renders in a few hundred milliseconds; see
bench/ui.py.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from urllib.parse import quote

from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from nodes import liveness, telemetry
from nodes.choices import NodeStatus
from nodes.models import Gpu, GpuConflict, Node
from nodes.selectors import STALE_READINGS
from replicas.choices import DRAIN_ACTIVE
from replicas.models import Drain, GpuAllocation

# Replica colours: twelve hues picked in CSS (.r0 .. .r11).
PALETTE = 12
NO_FABRIC = "no fabric"


@dataclass
class NodeCard:
    name: str
    status: str
    agent_version: str
    discovery_errors: list
    age: float | None
    draining: bool
    other_fabrics: list[str]
    gpus: str = ""  # the cells' HTML, already escaped
    warnings: list[str] = field(default_factory=list)  # missing GPUs, GPU claims in conflict
    html: SafeString = mark_safe("")


@dataclass
class FabricColumn:
    name: str
    nodes: list[NodeCard]
    collapsed: bool = False
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class LegendEntry:
    colour: str
    label: str


@dataclass
class Cluster:
    fabrics: list[FabricColumn]
    legend: list[LegendEntry]
    legend_more: int
    totals: dict[str, int]
    fabric_names: list[str]


@dataclass(frozen=True)
class Filters:
    fabric: str = ""
    state: str = ""
    name: str = ""
    collapsed: frozenset[str] = frozenset()

    @classmethod
    def from_query(cls, query) -> "Filters":
        states = set(NodeStatus.values)
        state = query.get("state", "")
        return cls(
            fabric=query.get("fabric", "")[:64],
            state=state if state in states else "",
            name=query.get("name", "").strip()[:63],
            collapsed=frozenset(query.getlist("collapse")),
        )


def _age(seen: dict[str, float], name: str, stored: dt.datetime | None, now: float) -> float | None:
    ts = seen.get(name)
    if ts is None and stored is not None:
        ts = stored.timestamp()
    return None if ts is None else max(0.0, now - ts)


def age_text(seconds: float | None) -> str:
    """A heartbeat age in a few characters: '4 s', '3 min', '2 h', 'never'."""
    if seconds is None:
        return "never"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} d"


def card_html(card: NodeCard, node_url: str) -> SafeString:
    """A node's card. Written here rather than in a template: a thousand cards
    and eight thousand GPU cells through the template engine take most of a
    second; this takes a few milliseconds (bench/ui.py)."""
    name = escape(card.name)
    classes = f"node {card.status}" + (" draining" if card.draining else "")
    meta = [f'<span title="last heartbeat">♥ {age_text(card.age)}</span>']
    if card.agent_version:
        meta.append(f"<span>agent {escape(card.agent_version)}</span>")
    if card.draining and card.status != NodeStatus.DRAINING:
        meta.append('<span class="badge st-draining">draining</span>')
    if card.other_fabrics:
        meta.append(f"<span>also {escape(', '.join(card.other_fabrics))}</span>")
    errors = ""
    if card.discovery_errors:
        count = len(card.discovery_errors)
        first = str(card.discovery_errors[0])
        errors = (f'<div class="errors" title="{escape("; ".join(map(str, card.discovery_errors)))}">'
                  f'⚠ {count} discovery error{"s" if count > 1 else ""}: '
                  f'{escape(first[:60] + ("…" if len(first) > 60 else ""))}</div>')
    for warning in card.warnings:
        errors += f'<div class="errors">⚠ {escape(warning)}</div>'
    return mark_safe(
        f'<article class="{classes}" data-node="{name}"><header><a href="{node_url}{quote(card.name)}/">{name}</a>'
        f'<span class="badge st-{card.status}">{card.status}</span></header>'
        f'<div class="meta">{"".join(meta)}</div>{errors}<div class="gpus">{card.gpus}</div></article>'
    )


def _clock(at: dt.datetime) -> str:
    return timezone.localtime(at).strftime("%Y-%m-%d %H:%M")


def _gpu_warnings() -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    """GPU claims in conflict: ({node id: its warnings}, {GPU id: the nodes claiming it})."""
    warnings_of: dict[int, list[str]] = {}
    claimed_by: dict[int, list[str]] = {}
    rows = GpuConflict.objects.order_by("since", "pk").values_list(
        "gpu_id", "gpu__index", "gpu__node_id", "gpu__node__name", "claimant_id", "claimant__name")
    for gpu_id, index, holder_id, holder, claimant_id, claimant in rows:
        claimed_by.setdefault(gpu_id, []).append(claimant)
        warnings_of.setdefault(holder_id, []).append(f"GPU {index} also claimed by {claimant}")
        warnings_of.setdefault(claimant_id, []).append(f"claims GPU {index} of {holder}, which holds it")
    return warnings_of, claimed_by


def _marked_cell(index: int, held: tuple[int, str] | None, missing_since, claimants: list[str] | None,
                 health: tuple[str, str] | None = None, shade: str = "") -> str:
    """A GPU that is missing, claimed by another node, quarantined or
    degraded: marked, and its title says so."""
    colour = "free" if held is None else replica_colour(held[0])
    title = f"GPU {index}: " + ("free" if held is None else f"{held[1]} #{held[0]}")
    classes = "gpu " + colour + shade
    if missing_since is not None:
        classes += " missing"
        title += f"; missing since {_clock(missing_since)}"
    if claimants:
        classes += " conflict"
        title += f"; also claimed by {', '.join(claimants)}"
    if health is not None:
        classes += f" {health[0]}"
        title += f"; {health[0]}: {health[1]}"
    return f'<span class="{classes}" title="{escape(title)}"></span>'


def gpu_readings() -> dict[tuple[str, int], tuple[int | None, str, str]]:
    """{(node name, GPU index): (utilisation, health, reason)} from the latest readings."""
    try:
        latest = telemetry.store().latest()
    except Exception:  # noqa: BLE001 - Redis away: the grid without readings
        return {}
    now = timezone.now().timestamp()
    return {(name, r["index"]): (r["util"], r["health"], r["reason"])
            for name, block in latest.items() if now - block.get("at", 0) < STALE_READINGS
            for r in telemetry.readings_of(block)}


def replica_colour(replica_id: int) -> str:
    return f"r{replica_id % PALETTE}"


@dataclass
class NodeRow:
    """One node as both renderings read it: the server's HTML (``card_html``)
    and the live update's compact data (``ui.cluster_live``)."""

    name: str
    status: str
    agent_version: str
    discovery_errors: list
    age: float | None
    draining: bool
    other_fabrics: list[str]
    warnings: list[str]
    # (index, (replica id, model) or None, missing since or None, claimants or None), by index.
    gpus: list[tuple[int, tuple[int, str] | None, dt.datetime | None, list[str] | None]]


@dataclass
class GridRows:
    columns: list[tuple[FabricColumn, list[NodeRow]]]
    legend: dict[int, str]  # replica id -> model, every replica holding a GPU
    totals: dict[str, int]
    fabric_names: list[str]


def grid_rows(filters: Filters = Filters()) -> GridRows:
    """The grid's nodes, filtered, with their GPUs and who holds them: one
    query per table with ``values()``."""
    now = timezone.now().timestamp()
    seen = liveness.store().seen_all()
    node_rows = list(
        Node.objects.order_by("name").values(
            "id", "name", "status", "agent_version", "discovery_errors", "last_heartbeat_at"
        )
    )
    fabrics_of: dict[int, list[str]] = {}
    for node_id, fabric in Node.fabrics.through.objects.values_list("node_id", "fabric__name").order_by("fabric__name"):
        fabrics_of.setdefault(node_id, []).append(fabric)
    draining = set(Drain.objects.filter(status__in=DRAIN_ACTIVE).values_list("node_id", flat=True))
    holder: dict[int, tuple[int, str]] = {
        gpu_id: (replica_id, model)
        for gpu_id, replica_id, model in GpuAllocation.objects.values_list(
            "gpu_id", "member__replica_id", "member__replica__model__name"
        )
    }
    warnings_of, claimed_by = _gpu_warnings()
    gpus_of: dict[int, list] = {}
    legend: dict[int, str] = {}
    gpus = Gpu.objects.order_by("node_id", "index").values_list("id", "node_id", "index", "missing_since")
    for gpu_id, node_id, index, missing_since in gpus:
        held = holder.get(gpu_id)
        if held is not None:
            legend.setdefault(held[0], held[1])
        if missing_since is not None:
            warnings_of.setdefault(node_id, []).append(f"GPU {index} missing since {_clock(missing_since)}")
        gpus_of.setdefault(node_id, []).append((index, held, missing_since, claimed_by.get(gpu_id)))

    columns: dict[str, tuple[FabricColumn, list[NodeRow]]] = {}
    totals = {status: 0 for status in NodeStatus.values}
    needle = filters.name.lower()
    for row in node_rows:
        totals[row["status"]] += 1
        fabrics = fabrics_of.get(row["id"], [])
        home = fabrics[0] if fabrics else NO_FABRIC
        column = columns.get(home)
        if column is None:
            column = columns[home] = (FabricColumn(home, [], collapsed=home in filters.collapsed), [])
        counts = column[0].counts
        counts[row["status"]] = counts.get(row["status"], 0) + 1
        if filters.fabric and home != filters.fabric:
            continue
        if filters.state and row["status"] != filters.state:
            continue
        if needle and needle not in row["name"].lower():
            continue
        column[1].append(NodeRow(
            name=row["name"],
            status=row["status"],
            agent_version=row["agent_version"],
            discovery_errors=row["discovery_errors"] or [],
            age=_age(seen, row["name"], row["last_heartbeat_at"], now),
            draining=row["id"] in draining,
            other_fabrics=fabrics[1:],
            warnings=warnings_of.get(row["id"], []),
            gpus=gpus_of.get(row["id"], []),
        ))
    ordered = sorted(columns.values(), key=lambda c: (c[0].name == NO_FABRIC, c[0].name))
    names = [c[0].name for c in ordered]
    if filters.fabric:
        ordered = [c for c in ordered if c[0].name == filters.fabric]
    return GridRows(columns=ordered, legend=legend, totals={k: v for k, v in totals.items() if v}, fabric_names=names)


def legend_entries(legend: dict[int, str]) -> list[LegendEntry]:
    return [LegendEntry(replica_colour(rid), f"{model} #{rid}") for rid, model in sorted(legend.items())]


def cluster_grid(filters: Filters = Filters(), *, legend_max: int = 40) -> Cluster:
    node_url = reverse("ui-node", args=["x"])[:-2]
    rows = grid_rows(filters)
    held_label: dict[int, str] = {}
    fabrics = []
    for column, nodes in rows.columns:
        for node in nodes:
            cells = []
            for index, held, missing_since, claimants in node.gpus:
                if missing_since is not None or claimants:
                    cell = _marked_cell(index, held, missing_since, claimants)
                elif held is None:
                    cell = f'<span class="gpu free" title="GPU {index}: free"></span>'
                else:
                    replica_id, model = held
                    label = held_label.get(replica_id)
                    if label is None:
                        label = held_label[replica_id] = f'{replica_colour(replica_id)}" title="{escape(model)} #{replica_id}'
                    cell = f'<span class="gpu {label}, GPU {index}"></span>'
                cells.append(cell)
            card = NodeCard(
                name=node.name, status=node.status, agent_version=node.agent_version,
                discovery_errors=node.discovery_errors, age=node.age, draining=node.draining,
                other_fabrics=node.other_fabrics, gpus="".join(cells), warnings=node.warnings,
            )
            card.html = card_html(card, node_url)
            column.nodes.append(card)
        fabrics.append(column)
    entries = legend_entries(rows.legend)
    return Cluster(
        fabrics=fabrics,
        legend=entries[:legend_max],
        legend_more=max(0, len(entries) - legend_max),
        totals=rows.totals,
        fabric_names=rows.fabric_names,
    )
