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
    scale = ctl_sub.add_parser("scale", help="set a model's replica count")
    scale.add_argument("model")
    scale.add_argument("replicas", type=int)
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
    if not isinstance(document, dict) or not isinstance(document.get("models", []), list):
        raise CtlError(f"{args.file}: expected a mapping with a 'models' list")
    result = api_call("POST", "/api/v1/catalog/apply/", json={"models": document.get("models", []), "prune": args.prune})
    for verb in ("created", "updated", "unchanged", "removed"):
        for name in result.get(verb, []):
            print(f"{name} {verb}")
    return 0


def _scale(args) -> int:
    model = api_call("POST", f"/api/v1/models/{args.model}/scale/", json={"replicas": args.replicas})
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
    return [m["name"], m["engine"], f"{m['nodes']}x{m['gpus_per_node']}", m["replicas"],
            counts.get("ready", 0), counts.get("staging", 0), counts.get("pending", 0), staged, notes]


def _models(args) -> int:
    weights = {w["model"]: w for w in api_call("GET", "/api/v1/weights/")["models"]}
    return print_listing(args, api_call("GET", "/api/v1/models/"),
                         ["model", "engine", "shape", "want", "ready", "staging", "pending", "weights on", "notes"],
                         lambda m: _model_row(m, weights))


def _stage(args) -> int:
    body = {"nodes": args.nodes or [], "fabric": args.fabric or ""}
    result = api_call("POST", f"/api/v1/models/{args.model}/stage/", json=body)
    print(f"{result['model']}: weights staging on {', '.join(result['nodes'])}")
    return 0


def _replica_row(r: dict) -> list[object]:
    where = " ".join(f"{m['node']}[{','.join(map(str, m['gpus']))}]" for m in r["members"]) or "-"
    note = r["pending_reason"] if r["status"] == "pending" else r["status_reason"]
    return [r["id"], r["model"], r["status"] + (" (draining)" if r["draining"] else ""), r["fabric"] or "-", where, note]


def _replicas(args) -> int:
    params = {}
    if args.model:
        params["model"] = args.model
    if args.all:
        params["all"] = "1"
    return print_listing(args, api_call("GET", "/api/v1/replicas/", params=params),
                         ["replica", "model", "state", "fabric", "members", "why"], _replica_row)
