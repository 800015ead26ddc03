"""The cluster grid's live update as compact data (``/cluster/grid.json``).

The page is rendered on the server (``ui.cluster``); every few seconds
``ui/static/ui/cluster.js`` fetches this and renders the same markup in the
browser. A GPU is a few characters here instead of a ``<span>`` with its
classes and title: at 1,050 nodes x 8 GPUs the HTML partial weighs about
700 KiB and this about 70 KiB (bench/ui.py).

The document::

    {"v": 1,
     "totals": [["ready", 1040], ...],            # nodes per state
     "legend": [[replica id, "model"], ...], "legend_more": 12,
     "models": ["llama-70b", ...],                # model names, indexed below
     "replicas": {"1jk": 0, ...},                 # replica id (base 36) -> model index
     "fabrics": [{"name": "ib-a", "collapsed": false, "counts": [["ready", 63]],
                  "nodes": ["node01|ready|4 s|0.3.1|1jk,1jk,,~qXid 79,~mSINCE,,,|4431-000", ...]}],
     "extra": {"node01": {"d": 1, "o": ["ib-b"], "e": [...], "w": [...]}}}

A node is ``name|status|heartbeat age|agent version|GPUs|utilisation``. Its
GPUs are tokens by index, separated by ``,``: the holding replica's id in
base 36 (empty: free), then any attributes, each ``~`` + one letter + its
value: ``~m`` missing since (the time), ``~c`` claimed by other nodes too
(their names joined by ``+``), ``~q`` quarantined and ``~d`` degraded (the
reason, for the cell's title; ``%``, ``~``, ``,`` and ``|`` in it written as
``%25``, ``%7E``, ``%2C`` and ``%7C``, which ``decodeURIComponent`` reads
back). A per-GPU field is one of two shapes, both read by ``gpuCell`` in
cluster.js: a rare one is one more attribute letter, written by ``gpu_token``;
one that every GPU has is a column, one more ``|`` field after the GPUs with
one character per GPU, which ``gpuCell`` gets as ``gpu.columns[n]``. The one
column is utilisation in fifths (``0``-``4``, the cell's class ``u0``-``u4``;
``-``: no fresh reading for that GPU), e.g. ``|4431-000``: 9 bytes a node
where ``~u4`` on every GPU would be 24; a node with no fresh reading at all
has no column. Node ids hold no ``|``, ``,``, ``~`` or ``+``; rare per-node
fields (draining, other fabrics, discovery errors, warnings, an agent version
holding ``|``) are in ``extra``, by node name.
"""

from __future__ import annotations

from typing import Any

from .cluster import Filters, _clock, age_text, grid_rows

BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"


def base36(number: int) -> str:
    if number == 0:
        return "0"
    digits = []
    while number:
        number, digit = divmod(number, 36)
        digits.append(BASE36[digit])
    return "".join(reversed(digits))


_REASON_ESCAPES = str.maketrans({"%": "%25", "~": "%7E", ",": "%2C", "|": "%7C"})


def gpu_token(held: tuple[int, str] | None, missing_since, claimants: list[str] | None,
              mark: tuple[str, str] | None = None) -> str:
    token = base36(held[0]) if held is not None else ""
    if missing_since is not None:
        token += f"~m{_clock(missing_since)}"
    if claimants:
        token += f"~c{'+'.join(claimants)}"
    if mark is not None:  # ~q quarantined, ~d degraded, with the reason
        token += f"~{mark[0][0]}{mark[1].translate(_REASON_ESCAPES)}"
    return token


def utilisation_column(fifths: list[int | None]) -> str:
    """One character per GPU (see above); empty when no GPU has a fresh reading."""
    if all(f is None for f in fifths):
        return ""
    return "|" + "".join("-" if f is None else str(f) for f in fifths)


def cluster_live(filters: Filters = Filters(), *, legend_max: int = 40) -> dict[str, Any]:
    rows = grid_rows(filters)
    models: dict[str, int] = {}
    replicas: dict[str, int] = {}
    fabrics = []
    extra: dict[str, dict[str, Any]] = {}
    for column, nodes in rows.columns:
        lines = []
        for node in nodes:
            tokens, fifths = [], []
            for _index, held, missing_since, claimants, fifth, mark in node.gpus:
                if held is not None:
                    key = base36(held[0])
                    if key not in replicas:
                        replicas[key] = models.setdefault(held[1], len(models))
                tokens.append(gpu_token(held, missing_since, claimants, mark))
                fifths.append(fifth)
            version = node.agent_version
            more: dict[str, Any] = {}
            if "|" in version:  # what an agent sends is data: it keeps its own field
                more["v"], version = version, ""
            lines.append(f"{node.name}|{node.status}|{age_text(node.age)}|{version}|{','.join(tokens)}{utilisation_column(fifths)}")
            if node.draining:
                more["d"] = 1
            if node.other_fabrics:
                more["o"] = node.other_fabrics
            if node.discovery_errors:
                more["e"] = [str(e) for e in node.discovery_errors]
            if node.warnings:
                more["w"] = node.warnings
            if more:
                extra[node.name] = more
        fabrics.append({"name": column.name, "collapsed": column.collapsed, "counts": list(column.counts.items()),
                        "nodes": [] if column.collapsed else lines})
    legend = sorted(rows.legend.items())
    return {
        "v": 1,
        "totals": list(rows.totals.items()),
        "legend": [list(entry) for entry in legend[:legend_max]],
        "legend_more": max(0, len(legend) - legend_max),
        "models": list(models),
        "replicas": replicas,
        "fabrics": fabrics,
        "extra": extra,
    }
