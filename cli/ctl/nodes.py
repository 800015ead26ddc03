"""``llmgw ctl nodes``, ``cordon``, ``uncordon``, ``fabrics``."""

from __future__ import annotations

from urllib.parse import quote

from .common import age, api_call, output_flag, print_listing


def register(ctl_sub) -> None:
    nodes = ctl_sub.add_parser("nodes", help="list nodes")
    output_flag(nodes)
    nodes.set_defaults(func=_nodes)
    for verb in ("cordon", "uncordon"):
        cmd = ctl_sub.add_parser(verb, help=f"{verb} a node")
        cmd.add_argument("node")
        cmd.set_defaults(func=_node_action, verb=verb)
    fabrics = ctl_sub.add_parser("fabrics", help="list fabrics and their nodes")
    output_flag(fabrics)
    fabrics.set_defaults(func=_fabrics)


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f}G"


def _cached(entry: dict | None) -> tuple[str, str]:
    """A node's weights cache for the listing: free space, and what it holds."""
    if entry is None:
        return "-", "-"
    held = [f"{m['model']}@{m['revision'][:12]}" + ("" if m["complete"] else
                                                     f" ({100 * m['bytes'] // max(1, m['total'])}%)")
            for m in entry["models"]]
    return _gb(entry["free_bytes"]), ",".join(held) or "none"


def _nodes(args) -> int:
    caches = {c["node"]: c for c in api_call("GET", "/api/v1/weights/")["nodes"]}
    return print_listing(
        args, api_call("GET", "/api/v1/nodes/"),
        ["node", "state", "fabrics", "gpus", "heartbeat", "replicas", "cache", "weights", "notes"],
        lambda n: [n["name"], n["status"], ",".join(n["fabrics"]) or "-", len(n["gpus"]),
                   age(n["heartbeat_age_seconds"]), n["replicas"], *_cached(caches.get(n["name"])),
                   "; ".join(n["discovery_errors"])],
    )


def _node_action(args) -> int:
    node = api_call("POST", f"/api/v1/nodes/{quote(args.node, safe='')}/{args.verb}/")
    print(f"{node['name']} is {node['status']}")
    return 0


def _fabrics(args) -> int:
    return print_listing(
        args, api_call("GET", "/api/v1/fabrics/"), ["fabric", "nodes"], lambda f: [f["name"], ", ".join(f["nodes"])]
    )
