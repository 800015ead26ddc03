"""``llmgw ctl users``: people and their roles (viewer, operator, admin)."""

from __future__ import annotations

from pathlib import Path

from .common import CtlError, api_call, output_flag, print_listing

ROLES = ("viewer", "operator", "admin")


def register(ctl_sub) -> None:
    users = ctl_sub.add_parser("users", help="users and their roles (viewer, operator, admin)")
    users_sub = users.add_subparsers(dest="users_command", required=True)
    add = users_sub.add_parser("add", help="a new user with a role")
    add.add_argument("name")
    add.add_argument("--role", choices=ROLES, required=True)
    add.add_argument("--password-file", help="read the password from this file (default: one is generated and "
                                              "printed once)")
    add.set_defaults(func=_add)
    set_role = users_sub.add_parser("set-role", help="change a user's role")
    set_role.add_argument("name")
    set_role.add_argument("role", choices=ROLES)
    set_role.set_defaults(func=_set_role)
    superuser = users_sub.add_parser("set-superuser", help="make a user superuser, or no longer (superusers only)")
    superuser.add_argument("name")
    superuser.add_argument("--revoke", action="store_true", help="take superuser back")
    superuser.set_defaults(func=_set_superuser)
    listing = users_sub.add_parser("list", help="users and their roles")
    output_flag(listing)
    listing.set_defaults(func=_list)


def _add(args) -> int:
    body = {"username": args.name, "role": args.role}
    if args.password_file:
        try:
            body["password"] = Path(args.password_file).read_text().rstrip("\n")
        except OSError as exc:
            raise CtlError(f"cannot read the password file: {exc}") from None
        if not body["password"]:
            raise CtlError(f"{args.password_file} is empty")
    user = api_call("POST", "/api/v1/users/", json=body)
    print(f"created user {user['username']} with role {user['role']}")
    if "password" in user:
        print(f"  password: {user['password']}")
        print("it is shown this once: hand it over now; it can be changed in the admin or with --password-file.")
    return 0


def _set_role(args) -> int:
    user = api_call("POST", f"/api/v1/users/{args.name}/set-role/", json={"role": args.role})
    print(f"user {user['username']} is now {user['role']}")
    return 0


def _set_superuser(args) -> int:
    user = api_call("POST", f"/api/v1/users/{args.name}/set-superuser/", json={"superuser": not args.revoke})
    print(f"user {user['username']} is {'now' if user['is_superuser'] else 'no longer'} superuser")
    return 0


def _list(args) -> int:
    return print_listing(
        args, api_call("GET", "/api/v1/users/"),
        ["name", "role", "active", "staff", "superuser", "last login"],
        lambda u: [u["username"], u["role"] or "-", _yes(u["is_active"]), _yes(u["is_staff"]), _yes(u["is_superuser"]),
                   (u["last_login"] or "never")[:19].replace("T", " ")],
    )


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
