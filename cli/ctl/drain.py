"""``llmgw ctl drain``: move every replica off a node, and optionally watch it happen."""

from __future__ import annotations

import time

from .common import CtlError, api_call


def register(ctl_sub) -> None:
    drain = ctl_sub.add_parser("drain", help="move every replica off a node, one at a time")
    drain.add_argument("node")
    drain.add_argument("--wait", action="store_true", help="wait until the node is drained (or the drain is blocked)")
    drain.add_argument("--timeout", type=float, default=600)
    drain.set_defaults(func=_drain)


def _drain(args) -> int:
    drain = api_call("POST", "/api/v1/drains/", json={"node": args.node})
    print(f"draining {args.node}: {drain['remaining']} replica(s) to move")
    if not args.wait:
        return 0
    deadline = time.monotonic() + args.timeout
    seen = 0
    while time.monotonic() < deadline:
        drain = api_call("GET", f"/api/v1/drains/{drain['id']}/")
        for line in drain["log"][seen:]:
            print(f"  {line}")
        seen = len(drain["log"])
        if drain["status"] == "done":
            return 0
        if drain["status"] == "blocked":
            print(f"the drain of {args.node} is blocked; the replicas that cannot move keep running")
            return 1
        time.sleep(1)
    raise CtlError(f"the drain of {args.node} did not finish in {args.timeout:.0f}s; 'llmgw ctl replicas' shows where it is")
