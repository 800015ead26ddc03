"""``llmgw ctl``: the operator's command line.

``ctl cert`` works on the local PKI directory (it runs on the host holding the
authority). Everything else talks to the operator REST API at ``LLMGW_URL``
with ``LLMGW_TOKEN``; both default to what a local ``llmgw up`` wrote.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import quote

import httpx


class CtlError(Exception):
    pass


def add_ctl_parser(sub) -> None:
    ctl = sub.add_parser("ctl", help="operate a running control plane")
    ctl_sub = ctl.add_subparsers(dest="ctl_command", required=True)

    cert = ctl_sub.add_parser("cert", help="the certificate authority (local PKI directory)")
    cert.add_argument("--data-dir", help="the data directory (default $LLMGW_DATA_DIR or ./var)")
    cert_sub = cert.add_subparsers(dest="cert_command", required=True)
    init = cert_sub.add_parser("init-ca", help="create the authority (refuses to replace one)")
    init.add_argument("--cn", default="llmgw CA")
    init.set_defaults(func=_cert_init_ca)
    client = cert_sub.add_parser("issue-client", help="a node's certificate: CN = node id")
    client.add_argument("node")
    client.add_argument("--out", required=True, help="directory for NODE.pem, NODE-key.pem and ca.pem")
    client.add_argument("--days", type=int)
    client.set_defaults(func=_cert_issue_client)
    server = cert_sub.add_parser("issue-server", help="a server certificate with subject alternative names")
    server.add_argument("--host", action="append", default=[], help="DNS name (repeatable)")
    server.add_argument("--ip", action="append", default=[], help="IP address (repeatable)")
    server.add_argument("--out", help="directory for server.pem, server-key.pem and ca.pem")
    server.add_argument("--install", action="store_true", help="make it the agent API's certificate")
    server.add_argument("--days", type=int)
    server.set_defaults(func=_cert_issue_server)
    listing = cert_sub.add_parser("list", help="every certificate issued")
    _output_flag(listing)
    listing.set_defaults(func=_cert_list)
    revoke = cert_sub.add_parser("revoke", help="revoke a node's certificates, or one by serial")
    revoke.add_argument("target", metavar="NODE|SERIAL")
    revoke.add_argument("--reason", default="")
    revoke.set_defaults(func=_cert_revoke)

    nodes = ctl_sub.add_parser("nodes", help="list nodes")
    _output_flag(nodes)
    nodes.set_defaults(func=_nodes)
    for verb in ("cordon", "uncordon"):
        cmd = ctl_sub.add_parser(verb, help=f"{verb} a node")
        cmd.add_argument("node")
        cmd.set_defaults(func=_node_action, verb=verb)
    events = ctl_sub.add_parser("events", help="recent events, newest first")
    events.add_argument("--node")
    events.add_argument("--limit", type=int, default=50)
    _output_flag(events)
    events.set_defaults(func=_events)
    apply = ctl_sub.add_parser("apply", help="apply a catalog.yaml: create and update models (--prune removes others)")
    apply.add_argument("-f", "--file", required=True, help="catalog.yaml ('-' for standard input)")
    apply.add_argument("--prune", action="store_true", help="remove models the file does not list")
    apply.set_defaults(func=_apply)
    scale = ctl_sub.add_parser("scale", help="set a model's replica count")
    scale.add_argument("model")
    scale.add_argument("replicas", type=int)
    scale.set_defaults(func=_scale)
    models = ctl_sub.add_parser("models", help="the catalog, with replica counts and why any cannot be placed")
    _output_flag(models)
    models.set_defaults(func=_models)
    replicas = ctl_sub.add_parser("replicas", help="replicas and their members (node, rank, GPUs, ports, state)")
    replicas.add_argument("--model")
    replicas.add_argument("--all", action="store_true", help="include stopped replicas")
    _output_flag(replicas)
    replicas.set_defaults(func=_replicas)
    drain = ctl_sub.add_parser("drain", help="move every replica off a node, one at a time")
    drain.add_argument("node")
    drain.add_argument("--wait", action="store_true", help="wait until the node is drained (or the drain is blocked)")
    drain.add_argument("--timeout", type=float, default=600)
    drain.set_defaults(func=_drain)
    fabrics = ctl_sub.add_parser("fabrics", help="list fabrics and their nodes")
    _output_flag(fabrics)
    fabrics.set_defaults(func=_fabrics)
    keys = ctl_sub.add_parser("keys", help="API keys for the gateway (/v1)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    key_create = keys_sub.add_parser("create", help="a new key, printed once")
    key_create.add_argument("name")
    key_create.add_argument("--models", default="", help="comma-separated models it may use (default: all)")
    key_create.add_argument("-q", "--quiet", action="store_true", help="print the key alone (for scripts)")
    key_create.set_defaults(func=_keys_create)
    key_revoke = keys_sub.add_parser("revoke", help="revoke a key (the gateways refuse it within a second)")
    key_revoke.add_argument("name")
    key_revoke.set_defaults(func=_keys_revoke)
    key_list = keys_sub.add_parser("list", help="keys, their models and usage")
    _output_flag(key_list)
    key_list.set_defaults(func=_keys_list)
    # Provisioning's commands live in their own module.
    from .ctl_provisioning import register

    register(ctl_sub)


def _output_flag(parser) -> None:
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table")


def run_ctl(func, args) -> int:
    try:
        return func(args) or 0
    except CtlError as exc:
        print(f"llmgw: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # 'llmgw ctl ... | head': the reader has gone, which is not an error.
        sys.stderr.close()
        return 0


# --- tables -------------------------------------------------------------------


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


# --- cert (local) -------------------------------------------------------------


def _local(args):
    from .cli import ensure_migrated, setup_django

    setup_django(getattr(args, "data_dir", None))
    from django.conf import settings
    from django.db import OperationalError

    try:
        ensure_migrated()
    except OperationalError as exc:
        db = settings.DATABASES["default"]
        where = db["NAME"] if db["ENGINE"].endswith("sqlite3") else f"{db.get('HOST') or 'localhost'}:{db.get('PORT') or ''}/{db['NAME']}"
        raise CtlError(
            f"cannot reach the database at {where} ({str(exc).strip().splitlines()[-1]}); "
            "'ctl cert' records certificates there: check DATABASE_URL"
        ) from exc
    from pki import services

    return services


def _cert_init_ca(args) -> int:
    services = _local(args)
    try:
        row = services.ca_init(common_name=args.cn)
    except services.PkiError as exc:
        raise CtlError(str(exc)) from exc
    print(f"created authority {row.common_name!r} serial {row.serial} in {services.pki_dir()}")
    return 0


def _cert_issue_client(args) -> int:
    services = _local(args)
    from pki.names import InvalidNodeId

    try:
        issued = services.cert_issue_client(node_id=args.node, days=args.days)
    except (services.PkiError, InvalidNodeId) as exc:
        raise CtlError(str(exc)) from exc
    paths = services.bundle_write(issued=issued, out_dir=Path(args.out))
    print(f"issued {issued.row.common_name} serial {issued.row.serial}, valid until {issued.row.not_after:%Y-%m-%d}")
    for label, path in paths.items():
        print(f"  {label:4} {path}")
    return 0


def _cert_issue_server(args) -> int:
    services = _local(args)
    if not args.out and not args.install:
        raise CtlError("say where it goes: --out DIR, or --install to make it the agent API's certificate")
    try:
        issued = services.cert_issue_server(hosts=args.host, ips=args.ip, days=args.days, install=args.install)
    except services.PkiError as exc:
        raise CtlError(str(exc)) from exc
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        services._write_public(out / "server.pem", issued.cert_pem)
        services._write_private(out / "server-key.pem", issued.key_pem)
        services._write_public(out / "ca.pem", issued.ca_pem)
        print(f"wrote {out / 'server.pem'}, {out / 'server-key.pem'} and {out / 'ca.pem'}")
    if args.install:
        print(f"installed as the agent API's certificate in {services.pki_dir()}; restart the agent API")
    print(f"serial {issued.row.serial}, names {', '.join(issued.row.subject_alt_names)}")
    return 0


def _cert_list(args) -> int:
    _local(args)
    from pki.api.serializers import CertificateSerializer
    from pki.selectors import cert_list

    rows = CertificateSerializer(cert_list(), many=True).data
    if args.output == "json":
        from .cli import print_json

        print_json(rows)
        return 0
    print_table(
        ["cn", "kind", "serial", "expires", "revoked"],
        [[r["common_name"], r["kind"], r["serial"], r["not_after"][:10], (r["revoked_at"] or "")[:19]] for r in rows],
    )
    return 0


def _cert_revoke(args) -> int:
    services = _local(args)
    try:
        rows = services.cert_revoke(target=args.target, reason=args.reason)
    except services.PkiError as exc:
        raise CtlError(str(exc)) from exc
    for row in rows:
        print(f"revoked {row.kind} certificate {row.serial} ({row.common_name})")
    return 0


# --- REST ---------------------------------------------------------------------


DEFAULT_URL = "http://127.0.0.1:8000"


def _base_url() -> str:
    return os.environ.get("LLMGW_URL", DEFAULT_URL).rstrip("/")


def _data_dir() -> Path:
    # The same default as settings.DATA_DIR, wherever ctl is run from.
    default = Path(__file__).resolve().parent.parent / "var"
    return Path(os.environ.get("LLMGW_DATA_DIR") or default)


def _api() -> httpx.Client:
    token = os.environ.get("LLMGW_TOKEN", "")
    if not token:
        token_file = _data_dir() / "ctl-token"
        if token_file.exists():
            token = token_file.read_text().strip()
    if not token:
        raise CtlError(
            "no API token: set LLMGW_TOKEN, or LLMGW_DATA_DIR to the data directory of 'llmgw up' "
            f"(it writes ctl-token there; looked in {_data_dir()})"
        )
    return httpx.Client(base_url=_base_url(), headers={"Authorization": f"Token {token}"}, timeout=30)


def api_call(method: str, path: str, **kwargs):
    try:
        with _api() as client:
            response = client.request(method, path, **kwargs)
    except httpx.TransportError as exc:
        raise CtlError(
            f"cannot reach the control plane at {_base_url()}: {exc or type(exc).__name__}. "
            "Is it running ('llmgw up')? Set LLMGW_URL if it is elsewhere"
        ) from exc
    try:
        data = response.json()
    except ValueError:
        data = None
    if response.status_code >= 400:
        detail = data.get("detail") if isinstance(data, dict) else None
        detail = detail or (data if data is not None else response.text.strip()[:500]) or response.reason_phrase
        hint = ""
        if response.status_code in (401, 403):
            hint = " (check LLMGW_TOKEN: it must be an API token of a staff user)"
        raise CtlError(f"{response.status_code}: {detail}{hint}")
    if data is None:
        raise CtlError(
            f"{_base_url()}{path} did not answer with JSON (status {response.status_code}); "
            "is LLMGW_URL the llmgw web address?"
        )
    return data


def _nodes(args) -> int:
    nodes = api_call("GET", "/api/v1/nodes/")
    if args.output == "json":
        from .cli import print_json

        print_json(nodes)
        return 0
    print_table(
        ["node", "state", "fabrics", "gpus", "heartbeat", "replicas", "notes"],
        [
            [
                n["name"],
                n["status"],
                ",".join(n["fabrics"]) or "-",
                len(n["gpus"]),
                _age(n["heartbeat_age_seconds"]),
                n["replicas"],
                "; ".join(n["discovery_errors"]),
            ]
            for n in nodes
        ],
    )
    return 0


def _node_action(args) -> int:
    node = api_call("POST", f"/api/v1/nodes/{quote(args.node, safe='')}/{args.verb}/")
    print(f"{node['name']} is {node['status']}")
    return 0


def _events(args) -> int:
    params = {"limit": args.limit}
    if args.node:
        params["node"] = args.node
    events = api_call("GET", "/api/v1/events/", params=params)
    if args.output == "json":
        from .cli import print_json

        print_json(events)
        return 0
    print_table(
        ["time", "severity", "subject", "message"],
        [[e["created_at"][:19].replace("T", " "), e["severity"], e["subject"], e["message"]] for e in events],
    )
    return 0


def _fabrics(args) -> int:
    fabrics = api_call("GET", "/api/v1/fabrics/")
    if args.output == "json":
        from .cli import print_json

        print_json(fabrics)
        return 0
    print_table(["fabric", "nodes"], [[f["name"], ", ".join(f["nodes"])] for f in fabrics])
    return 0


def _apply(args) -> int:
    import yaml

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


def _models(args) -> int:
    models = api_call("GET", "/api/v1/models/")
    if args.output == "json":
        from .cli import print_json

        print_json(models)
        return 0
    rows = []
    for m in models:
        counts = m["replica_counts"]
        notes = m["never_fits_reason"] or "; ".join(m["pending_reasons"])
        rows.append([m["name"], m["engine"], f"{m['nodes']}x{m['gpus_per_node']}", m["replicas"],
                     counts.get("ready", 0), counts.get("pending", 0), notes])
    print_table(["model", "engine", "shape", "want", "ready", "pending", "notes"], rows)
    return 0


def _replicas(args) -> int:
    params = {}
    if args.model:
        params["model"] = args.model
    if args.all:
        params["all"] = "1"
    replicas = api_call("GET", "/api/v1/replicas/", params=params)
    if args.output == "json":
        from .cli import print_json

        print_json(replicas)
        return 0
    rows = []
    for r in replicas:
        where = " ".join(f"{m['node']}[{','.join(map(str, m['gpus']))}]" for m in r["members"]) or "-"
        note = r["pending_reason"] if r["status"] == "pending" else r["status_reason"]
        rows.append([r["id"], r["model"], r["status"] + (" (draining)" if r["draining"] else ""),
                     r["fabric"] or "-", where, note])
    print_table(["replica", "model", "state", "fabric", "members", "why"], rows)
    return 0


def _drain(args) -> int:
    import time

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


def _keys_create(args) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    key = api_call("POST", "/api/v1/keys/", json={"name": args.name, "models": models})
    if args.quiet:
        print(key["key"])
        return 0
    print(f"created API key {key['name']} for {', '.join(key['models']) or 'every model'}:")
    print(f"  {key['key']}")
    print("it is shown this once: keep it now. Clients send it as 'Authorization: Bearer <key>'.")
    return 0


def _keys_revoke(args) -> int:
    key = api_call("POST", f"/api/v1/keys/{args.name}/revoke/")
    print(f"revoked API key {key['name']} ({key['prefix']}...)")
    return 0


def _keys_list(args) -> int:
    keys = api_call("GET", "/api/v1/keys/")
    if args.output == "json":
        from .cli import print_json

        print_json(keys)
        return 0
    print_table(
        ["name", "prefix", "models", "state", "requests", "prompt tokens", "completion tokens", "last used"],
        [[k["name"], k["prefix"] + "...", ",".join(k["models"]) or "all", "revoked" if k["revoked"] else "active",
          k["requests"], k["prompt_tokens"], k["completion_tokens"], (k["last_used_at"] or "never")[:19].replace("T", " ")]
         for k in keys],
    )
    return 0

