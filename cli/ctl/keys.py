"""``llmgw ctl keys``: API keys for the gateway (/v1)."""

from __future__ import annotations

from .common import api_call, output_flag, print_listing


def register(ctl_sub) -> None:
    keys = ctl_sub.add_parser("keys", help="API keys for the gateway (/v1)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="a new key, printed once")
    create.add_argument("name")
    create.add_argument("--models", default="", help="comma-separated models it may use (default: all)")
    create.add_argument("-q", "--quiet", action="store_true", help="print the key alone (for scripts)")
    create.set_defaults(func=_create)
    revoke = keys_sub.add_parser("revoke", help="revoke a key (the gateways refuse it within a second)")
    revoke.add_argument("name")
    revoke.set_defaults(func=_revoke)
    listing = keys_sub.add_parser("list", help="keys, their models and usage")
    output_flag(listing)
    listing.set_defaults(func=_list)


def _create(args) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    key = api_call("POST", "/api/v1/keys/", json={"name": args.name, "models": models})
    if args.quiet:
        print(key["key"])
        return 0
    print(f"created API key {key['name']} for {', '.join(key['models']) or 'every model'}:")
    print(f"  {key['key']}")
    print("it is shown this once: keep it now. Clients send it as 'Authorization: Bearer <key>'.")
    return 0


def _revoke(args) -> int:
    key = api_call("POST", f"/api/v1/keys/{args.name}/revoke/")
    print(f"revoked API key {key['name']} ({key['prefix']}...)")
    return 0


def _list(args) -> int:
    return print_listing(
        args, api_call("GET", "/api/v1/keys/"),
        ["name", "prefix", "models", "state", "requests", "prompt tokens", "completion tokens", "last used"],
        lambda k: [k["name"], k["prefix"] + "...", ",".join(k["models"]) or "all",
                   "revoked" if k["revoked"] else "active", k["requests"], k["prompt_tokens"],
                   k["completion_tokens"], (k["last_used_at"] or "never")[:19].replace("T", " ")],
    )
