"""``llmgw ctl apply``, ``scale``, ``models``, ``replicas``: the catalog and
the replicas serving it."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from .common import CtlError, api_call, output_flag, print_listing


def register(ctl_sub) -> None:
    apply = ctl_sub.add_parser("apply", help="apply a catalog.yaml: create and update models (--prune removes others)")
    apply.add_argument("-f", "--file", required=True, help="catalog.yaml ('-' for standard input)")
    apply.add_argument("--prune", action="store_true", help="remove models the file does not list")
    apply.set_defaults(func=_apply)
    scale = ctl_sub.add_parser("scale", help="set a model's replica count, or an autoscaled model's bounds")
    scale.add_argument("model")
    scale.add_argument("replicas", type=int, nargs="?", help="the count (a model without an autoscale policy)")
    scale.add_argument("--min", type=int, help="an autoscaled model's fewest replicas")
    scale.add_argument("--max", type=int, help="an autoscaled model's most replicas")
    scale.set_defaults(func=_scale)
    models = ctl_sub.add_parser("models", help="the catalog, with replica counts, where each model's weights are "
                                "staged, and why any cannot be placed")
    output_flag(models)
    models.set_defaults(func=_models)
    models_sub = models.add_subparsers(dest="models_command", required=False)
    stage = models_sub.add_parser("stage", help="fetch a model's weights onto nodes ahead of need "
                                  "(--node N, more than once, or --fabric F: every ready node of it)")
    stage.add_argument("model")
    where = stage.add_mutually_exclusive_group(required=True)
    where.add_argument("--node", action="append", dest="nodes", metavar="NODE")
    where.add_argument("--fabric")
    stage.set_defaults(func=_stage)
    replicas = ctl_sub.add_parser("replicas", help="replicas and their members (node, rank, GPUs, ports, state)")
    replicas.add_argument("--model")
    replicas.add_argument("--all", action="store_true", help="include stopped replicas")
    output_flag(replicas)
    replicas.set_defaults(func=_replicas)


def _apply(args) -> int:
    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    try:
        document = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise CtlError(f"{args.file} is not valid YAML: {exc}") from exc
    if not isinstance(document, dict):
        raise CtlError(f"{args.file}: expected a mapping with a 'models' list")
    if "prune" in document:
        raise CtlError(f"{args.file}: prune: not a key of a catalog file; pass --prune")
    # The file's keys as written: the API refuses one it does not know, by name.
    result = api_call("POST", "/api/v1/catalog/apply/", json={"models": [], **document, "prune": args.prune})
    for verb in ("created", "updated", "unchanged", "removed"):
        for name in result.get(verb, []):
            print(f"{name} {verb}")
    for started in result.get("rollouts", []):
        name = started["model"]
        line = f"{name}: rollout revision {started['from_revision']} -> {started['to_revision']} started"
        if started["status"] == "paused":
            line += (f" paused (the rollout it supersedes was paused; 'llmgw ctl rollout resume {name}' "
                     "carries it on)")
        print(line)
    return 0


def _scale(args) -> int:
    bounds = {k: v for k, v in (("min", args.min), ("max", args.max)) if v is not None}
    if args.replicas is None and not bounds:
        raise CtlError("give a count ('llmgw ctl scale MODEL N') or an autoscaled model's bounds (--min/--max)")
    if args.replicas is not None and bounds:
        raise CtlError("give a count or --min/--max, not both: a count fixes a model, bounds limit its autoscaler")
    body = bounds if bounds else {"replicas": args.replicas}
    model = api_call("POST", f"/api/v1/models/{args.model}/scale/", json=body)
    policy = model.get("autoscale")
    if policy:
        print(f"{model['name']} autoscales between {policy['min']} and {policy['max']} replicas (now {model['replicas']})")
    else:
        print(f"{model['name']} scaled to {model['replicas']}")
    return 0


def _model_row(m: dict, weights: dict[str, dict]) -> list[object]:
    counts = m["replica_counts"]
    notes = m["never_fits_reason"] or "; ".join(m["pending_reasons"])
    w = weights.get(m["name"])
    if w is None:
        staged = "-"  # unmanaged: every node is taken to hold them
    else:
        staged = ",".join(w["staged_on"]) or "none"
        if w["fetching_on"]:
            staged += f" (fetching: {','.join(w['fetching_on'])})"
    want = m["replicas"] if not m.get("autoscale") else f"{m['replicas']} ({m['autoscale']['min']}-{m['autoscale']['max']})"
    return [m["name"], m["engine"], f"{m['nodes']}x{m['gpus_per_node']}", m.get("revision", "-"), want,
            counts.get("ready", 0), m.get("ready_current", "-"), counts.get("staging", 0), counts.get("pending", 0),
            staged, notes]


def _models(args) -> int:
    weights = {w["model"]: w for w in api_call("GET", "/api/v1/weights/")["models"]}
    return print_listing(args, api_call("GET", "/api/v1/models/"),
                         ["model", "engine", "shape", "rev", "want", "ready", "on-rev", "staging", "pending",
                          "weights on", "notes"],
                         lambda m: _model_row(m, weights))


def _stage(args) -> int:
    body = {"nodes": args.nodes or [], "fabric": args.fabric or ""}
    result = api_call("POST", f"/api/v1/models/{args.model}/stage/", json=body)
    print(f"{result['model']}: weights staging on {', '.join(result['nodes'])}")
    return 0


def _replica_row(r: dict) -> list[object]:
    where = " ".join(f"{m['node']}[{','.join(map(str, m['gpus']))}]" for m in r["members"]) or "-"
    note = r["pending_reason"] if r["status"] == "pending" else r["status_reason"]
    backing_off = [m for m in r["members"] if m.get("state") == "backoff"]
    if backing_off:
        m = backing_off[0]
        last = next((line for line in reversed(m.get("log_tail") or []) if line.strip()), "")
        note = (f"rank {m['rank']} on {m['node']}: engine exited with status {m['exit_code']} at start, "
                f"restarted {m['restarts']} time(s), backing off" + (f": {last}" if last else ""))
    elif r["status"] == "stopped" and r.get("failed_reason"):
        note = f"failed: {r['failed_reason']}"
    state = r["status"] + (" (replacing)" if r.get("rolling") else " (draining)" if r["draining"] else "")
    revision = r.get("revision")
    return [r["id"], r["model"], "-" if revision is None else revision, state, r["fabric"] or "-", where, note]


def _replicas(args) -> int:
    params = {}
    if args.model:
        params["model"] = args.model
    if args.all:
        params["all"] = "1"
    return print_listing(args, api_call("GET", "/api/v1/replicas/", params=params),
                         ["replica", "model", "rev", "state", "fabric", "members", "why"], _replica_row)
