"""``llmgw ctl drain``: move every replica off a node, and optionally watch it
happen; ``--cancel`` ends a drain under way."""

from __future__ import annotations

import time
from urllib.parse import quote

from .common import CtlError, api_call

ACTIVE = ("running", "blocked")
# How long --wait watches a blocked drain before it gives up on it (seconds).
BLOCKED_SETTLE = 15.0


def register(ctl_sub) -> None:
    drain = ctl_sub.add_parser(
        "drain", help="move every replica off a node, one at a time (--cancel ends a drain under way)")
    drain.add_argument("node")
    drain.add_argument("--wait", action="store_true", help="wait until the node is drained (or the drain is blocked)")
    drain.add_argument("--timeout", type=float, default=600)
    drain.add_argument("--cancel", action="store_true",
                       help="end the node's drain: its replicas stop moving and keep running; the node stays cordoned")
    drain.set_defaults(func=_drain)


def _print_outcomes(drain: dict) -> None:
    for replica, entry in sorted(drain.get("replicas", {}).items(), key=lambda kv: int(kv[0])):
        reason = f": {entry['reason']}" if entry.get("reason") else ""
        print(f"  {entry['model']} replica {replica}: {entry['outcome']}{reason}")


def _cancel(args) -> int:
    drains = api_call("GET", f"/api/v1/drains/?node={quote(args.node, safe='')}")
    active = [d for d in drains if d["status"] in ACTIVE]
    if not active:
        last = f"; its last drain is {drains[0]['status']}" if drains else ""
        raise CtlError(f"{args.node} has no drain under way{last}")
    drain = api_call("POST", f"/api/v1/drains/{active[0]['id']}/cancel/")
    print(f"drain {drain['id']} of {args.node} cancelled: {drain['moved']} replica(s) moved; "
          f"{args.node} stays cordoned ('llmgw ctl uncordon {args.node}' puts it back in service)")
    _print_outcomes(drain)
    return 0


def _drain(args) -> int:
    if args.cancel:
        return _cancel(args)
    drain = api_call("POST", "/api/v1/drains/", json={"node": args.node})
    print(f"draining {args.node}: {drain['remaining']} replica(s) to move")
    if not args.wait:
        return 0
    deadline = time.monotonic() + args.timeout
    seen = 0
    blocked_since = None
    while time.monotonic() < deadline:
        drain = api_call("GET", f"/api/v1/drains/{drain['id']}/")
        for line in drain["log"][seen:]:
            print(f"  {line}")
        seen = len(drain["log"])
        if drain["status"] == "done":
            return 0
        if drain["status"] != "blocked":
            blocked_since = None
        elif blocked_since is None:
            # A blocked drain is tried again as the cluster changes (GPUs a
            # stopping replica frees, a node back): given up on only once it
            # has stayed blocked a while.
            blocked_since = time.monotonic()
        elif time.monotonic() - blocked_since >= BLOCKED_SETTLE:
            print(f"the drain of {args.node} is blocked; the replicas that cannot move keep running:")
            _print_outcomes(drain)
            return 1
        if drain["status"] == "cancelled":
            print(f"the drain of {args.node} was ended")
            return 1
        time.sleep(1)
    raise CtlError(f"the drain of {args.node} did not finish in {args.timeout:.0f}s; 'llmgw ctl replicas' shows where it is")
