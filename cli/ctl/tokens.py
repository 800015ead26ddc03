"""``llmgw ctl tokens``: operator tokens, each acting as its user with that
user's role until it expires."""

from __future__ import annotations

from .common import api_call, output_flag, print_listing


def register(ctl_sub) -> None:
    tokens = ctl_sub.add_parser("tokens", help="operator tokens (for scripts and 'llmgw ctl'): your own, "
                                               "or anyone's for admins")
    tokens_sub = tokens.add_subparsers(dest="tokens_command", required=True)
    create = tokens_sub.add_parser("create", help="a new token of yours, with your role, printed once")
    create.add_argument("name", nargs="?", default="")
    create.add_argument("--days", type=float, default=90.0, help="how long it lives (default 90, at most 366; "
                                                                  "never longer than the token making it)")
    create.add_argument("-q", "--quiet", action="store_true", help="print the token alone (for scripts)")
    create.set_defaults(func=_create)
    revoke = tokens_sub.add_parser("revoke", help="revoke a token by its prefix (yours; admins: anyone's)")
    revoke.add_argument("prefix")
    revoke.set_defaults(func=_revoke)
    listing = tokens_sub.add_parser("list", help="your tokens (--all: everyone's, for admins)")
    listing.add_argument("--all", action="store_true")
    output_flag(listing)
    listing.set_defaults(func=_list)


def _create(args) -> int:
    token = api_call("POST", "/api/v1/tokens/", json={"name": args.name, "days": args.days})
    if args.quiet:
        print(token["token"])
        return 0
    print(f"created operator token {token['prefix']} for {token['user']}, expiring {_when(token['expires_at'])}:")
    print(f"  {token['token']}")
    print("it is shown this once: keep it now. 'llmgw ctl' reads it from LLMGW_TOKEN.")
    return 0


def _revoke(args) -> int:
    token = api_call("DELETE", f"/api/v1/tokens/{args.prefix}/")
    print(f"revoked operator token {token['prefix']} of {token['user']}")
    return 0


def _list(args) -> int:
    return print_listing(
        args, api_call("GET", "/api/v1/tokens/", params={"all": "1"} if args.all else None),
        ["prefix", "user", "name", "created", "expires", "last used"],
        lambda t: [t["prefix"], t["user"], t["name"] or "-", _when(t["created_at"]), _when(t["expires_at"]),
                   _when(t["last_used_at"], "never")],
    )


def _when(value: str | None, none: str = "never") -> str:
    return value[:16].replace("T", " ") if value else none
