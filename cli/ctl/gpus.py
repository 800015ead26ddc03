"""``llmgw ctl gpus [--node N]`` and ``llmgw ctl gpus clear NODE INDEX``."""

from __future__ import annotations

from urllib.parse import quote

from .common import CtlError, api_call, output_flag, print_listing


def register(ctl_sub) -> None:
    gpus = ctl_sub.add_parser("gpus", help="list GPUs: health, the last Xid, latest readings")
    gpus.add_argument("--node", help="only this node's GPUs")
    output_flag(gpus)
    gpus.set_defaults(func=_gpus)
    verbs = gpus.add_subparsers(dest="gpus_command")
    clear = verbs.add_parser("clear", help="put a quarantined GPU back in service (operators)")
    clear.add_argument("node")
    clear.add_argument("index", type=int)
    clear.set_defaults(func=_clear)


def _value(value, unit: str = "") -> str:
    return "-" if value is None else f"{value:g}{unit}" if isinstance(value, float) else f"{value}{unit}"


def _gpus(args) -> int:
    query = f"?node={quote(args.node, safe='')}" if args.node else ""
    rows = api_call("GET", f"/api/v1/gpus/{query}")
    if args.node and not rows and args.output == "table":
        raise CtlError(f"no GPUs listed for node {args.node!r}; 'llmgw ctl nodes' lists the nodes")
    return print_listing(
        args, rows, ["node", "gpu", "health", "last xid", "util", "memory", "temp", "power", "reason"],
        lambda g: [g["node"], g["index"], g["health"], _value(g["last_xid"]), _value(g["util"], "%"),
                   "-" if g["mem_used_mib"] is None else f"{g['mem_used_mib']}/{g['mem_total_mib']} MiB",
                   _value(g["temp_c"], "C"), _value(g["power_w"], "W"), g["reason"] or ""],
    )


def _clear(args) -> int:
    if args.index < 0:
        raise CtlError(f"GPU index {args.index}: give the GPU's index on its node (0, 1, ...)")
    gpu = api_call("POST", f"/api/v1/nodes/{quote(args.node, safe='')}/gpus/{args.index}/clear/")
    print(f"GPU {gpu['index']} ({gpu['uuid']}) of {args.node} is back in service")
    return 0
