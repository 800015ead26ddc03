"""``llmgw ctl rollout status|pause|resume|undo MODEL``: a change of a
model's launch reaching its running replicas (docs/rollouts.md)."""

from __future__ import annotations

import time
from urllib.parse import quote

from .common import CtlError, api_call, output_flag, print_json

OPEN = ("running", "paused")


def register(ctl_sub) -> None:
    rollout = ctl_sub.add_parser("rollout", help="a model's rollout: status, pause, resume, undo")
    sub = rollout.add_subparsers(dest="rollout_command", required=True)
    status = sub.add_parser("status", help="the model's revision, its progress and what it waits for")
    status.add_argument("model")
    status.add_argument("--watch", "-w", action="store_true", help="follow it until it is done or fails")
    status.add_argument("--timeout", type=float, default=600)
    output_flag(status)
    status.set_defaults(func=_status)
    for verb, text in (("pause", "hold it: no new replacement starts; those under way finish"),
                       ("resume", "carry on a paused rollout, or try a failed one again"),
                       ("undo", "back to the previous revision, rolled out like any change")):
        parser = sub.add_parser(verb, help=text)
        parser.add_argument("model")
        parser.set_defaults(func=_steer, verb=verb)


def _path(model: str, tail: str = "") -> str:
    return f"/api/v1/models/{quote(model, safe='')}/rollout/{tail}"


def _describe(data: dict) -> list[str]:
    lines = [f"{data['model']}: revision {data['revision']}, {data['ready_current']} of {data['wanted']} wanted "
             f"ready on it ({data['ready']} ready in all); max_surge {data['max_surge']}, "
             f"max_unavailable {data['max_unavailable']}"]
    rollout = data.get("rollout")
    if rollout is None:
        lines.append("no rollout yet: its replicas run the revision they were made with")
        return lines
    head = f"rollout revision {rollout['from_revision']} -> {rollout['to_revision']}: {rollout['status']}"
    if rollout["status_reason"] and (rollout["status"] not in OPEN or rollout["status"] == "paused"):
        head += f" ({rollout['status_reason']})"
    lines.append(head)
    lines.append(f"  {rollout['updated']} of {rollout['wanted']} updated; "
                 f"{rollout['failures']} of {data['max_failures']} failure(s) allowed")
    if rollout["waiting_for"] and rollout["status"] != "done":
        lines.append(f"  waiting for: {rollout['waiting_for']}")
    return lines


def _status(args) -> int:
    data = api_call("GET", _path(args.model))
    if args.output == "json":
        print_json(data)
        return 0
    for line in _describe(data):
        print(line)
    if not args.watch:
        return 0
    deadline = time.monotonic() + args.timeout
    seen = len((data.get("rollout") or {}).get("log", []))
    while time.monotonic() < deadline:
        rollout = data.get("rollout")
        if rollout is None or rollout["status"] not in OPEN:
            return 0 if rollout is None or rollout["status"] == "done" else 1
        time.sleep(1)
        data = api_call("GET", _path(args.model))
        log = (data.get("rollout") or {}).get("log", [])
        for line in log[seen:]:
            print(f"  {line}")
        seen = len(log)
    raise CtlError(f"the rollout of {args.model} did not finish in {args.timeout:.0f}s")


def _steer(args) -> int:
    data = api_call("POST", _path(args.model, f"{args.verb}/"))
    for line in _describe(data):
        print(line)
    return 0
