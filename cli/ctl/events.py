"""``llmgw ctl events``: what happened, newest first."""

from __future__ import annotations

from .common import api_call, output_flag, print_listing


def register(ctl_sub) -> None:
    events = ctl_sub.add_parser("events", help="recent events, newest first")
    events.add_argument("--node")
    events.add_argument("--limit", type=int, default=50)
    output_flag(events)
    events.set_defaults(func=_events)


def _events(args) -> int:
    params = {"limit": args.limit}
    if args.node:
        params["node"] = args.node
    return print_listing(
        args, api_call("GET", "/api/v1/events/", params=params),
        ["time", "severity", "subject", "message"],
        lambda e: [e["created_at"][:19].replace("T", " "), e["severity"], e["subject"], e["message"]],
    )
