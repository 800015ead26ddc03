"""``llmgw ctl keys``: API keys for the gateway (/v1)."""

from __future__ import annotations

from .common import CtlError, api_call, output_flag, print_listing


def register(ctl_sub) -> None:
    keys = ctl_sub.add_parser("keys", help="API keys for the gateway (/v1)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="a new key, printed once")
    create.add_argument("name")
    create.add_argument("--models", default="", help="comma-separated models it may use (default: all)")
    create.add_argument("-q", "--quiet", action="store_true", help="print the key alone (for scripts)")
    _settings_flags(create, none="no limit, whatever the deployment's default; not given: that default")
    create.set_defaults(func=_create)
    update = keys_sub.add_parser("update", help="change a key's limits, expiry or priority (only the flags given)")
    update.add_argument("name")
    _settings_flags(update, none="removes it")
    update.set_defaults(func=_update)
    usage = keys_sub.add_parser("usage", help="usage per key, model and hour, as the engines reported it")
    usage.add_argument("name", nargs="?", help="one key only")
    usage.add_argument("--model", help="one model only")
    usage.add_argument("--hours", type=int, default=24, help="the last N hours (default 24)")
    usage.add_argument("--by-hour", action="store_true", help="one line per hour (default: totals per key and model)")
    output_flag(usage)
    usage.set_defaults(func=_usage)
    revoke = keys_sub.add_parser("revoke", help="revoke a key (the gateways refuse it within a second)")
    revoke.add_argument("name")
    revoke.set_defaults(func=_revoke)
    listing = keys_sub.add_parser("list", help="keys, their models and usage")
    output_flag(listing)
    listing.set_defaults(func=_list)


_LIMITS = (("rpm", "requests per minute"), ("tpm", "tokens per minute (prompt + completion)"),
           ("max_concurrent", "requests in flight at once"), ("daily_tokens", "token budget per UTC day"),
           ("monthly_tokens", "token budget per UTC month"))


def _settings_flags(parser, none: str) -> None:
    for field, what in _LIMITS:
        parser.add_argument("--" + field.replace("_", "-"), metavar="N|none", help=f"{what}; 'none': {none}")
    parser.add_argument("--expires", metavar="TIME|none",
                        help="when the key stops working (ISO 8601, e.g. 2027-01-31T00:00:00Z); 'none': never")
    parser.add_argument("--priority", choices=("interactive", "standard", "batch"),
                        help="class in the gateway's queue when a model is at capacity")


def _settings(args) -> dict:
    body = {}
    for field, _ in _LIMITS:
        value = getattr(args, field)
        if value is not None:
            if value.lower() == "none":
                body[field] = None
            else:
                try:
                    body[field] = int(value)
                except ValueError:
                    raise CtlError(f"--{field.replace('_', '-')} takes a whole number or 'none' (got {value!r})")
    if args.expires is not None:
        body["expires_at"] = None if args.expires.lower() == "none" else args.expires
    if args.priority is not None:
        body["priority"] = args.priority
    return body


def _limits(key: dict) -> str:
    parts = [f"{field}={key[field]}" for field, _ in _LIMITS if key.get(field)]
    if key.get("expires_at"):
        parts.append(f"expires {key['expires_at']}")
    return ", ".join(parts) or "none"


def _describe(key: dict) -> str:
    return f"{_limits(key)}, priority {key.get('priority', 'standard')}"


def _create(args) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    key = api_call("POST", "/api/v1/keys/", json={"name": args.name, "models": models, **_settings(args)})
    if args.quiet:
        print(key["key"])
        return 0
    print(f"created API key {key['name']} for {', '.join(key['models']) or 'every model'}:")
    print(f"  {key['key']}")
    print(f"  limits: {_describe(key)}")
    print("it is shown this once: keep it now. Clients send it as 'Authorization: Bearer <key>'.")
    return 0


def _update(args) -> int:
    body = _settings(args)
    if not body:
        raise CtlError("nothing to change: give at least one of --rpm, --tpm, --max-concurrent, --daily-tokens, "
                         "--monthly-tokens, --expires, --priority")
    key = api_call("PATCH", f"/api/v1/keys/{args.name}/", json=body)
    print(f"updated API key {key['name']}: {_describe(key)}")
    return 0


def _usage(args) -> int:
    params = {"hours": args.hours}
    if args.name:
        params["key"] = args.name
    if args.model:
        params["model"] = args.model
    rows = api_call("GET", "/api/v1/keys/usage/", params=params)
    if not args.by_hour:
        totals: dict[tuple[str, str], dict] = {}
        for row in rows:
            total = totals.setdefault((row["key"], row["model"]), {
                "key": row["key"], "model": row["model"], "requests": 0, "prompt_tokens": 0, "completion_tokens": 0})
            for field in ("requests", "prompt_tokens", "completion_tokens"):
                total[field] += row[field]
        rows = list(totals.values())
    columns = (["hour"] if args.by_hour else []) + ["key", "model", "requests", "prompt tokens", "completion tokens"]
    return print_listing(
        args, rows, columns,
        lambda r: ([r["hour"][:13].replace("T", " ") + ":00"] if args.by_hour else [])
        + [r["key"], r["model"], r["requests"], r["prompt_tokens"], r["completion_tokens"]],
    )


def _revoke(args) -> int:
    key = api_call("POST", f"/api/v1/keys/{args.name}/revoke/")
    print(f"revoked API key {key['name']} ({key['prefix']}...)")
    return 0


def _list(args) -> int:
    return print_listing(
        args, api_call("GET", "/api/v1/keys/"),
        ["name", "prefix", "models", "state", "limits", "priority", "requests", "prompt tokens",
         "completion tokens", "last used"],
        lambda k: [k["name"], k["prefix"] + "...", ",".join(k["models"]) or "all",
                   "revoked" if k["revoked"] else "active", _limits(k), k["priority"], k["requests"],
                   k["prompt_tokens"], k["completion_tokens"], (k["last_used_at"] or "never")[:19].replace("T", " ")],
    )
