"""``llmgw ctl cert``: the certificate authority, on the local PKI directory.

It runs on the host holding the authority, with Django set up in-process
(the certificates are recorded in the database), so the pki app is imported
inside each command, once ``_pki`` has set Django up (see ``cli/env.py``).
"""

from __future__ import annotations

import getpass
from pathlib import Path

from ..env import ensure_migrated, setup_django
from .common import CtlError, output_flag, print_listing


def register(ctl_sub) -> None:
    cert = ctl_sub.add_parser("cert", help="the certificate authority (local PKI directory)")
    cert.add_argument("--data-dir", help="the data directory (default $LLMGW_DATA_DIR or ./var)")
    cert_sub = cert.add_subparsers(dest="cert_command", required=True)
    init = cert_sub.add_parser("init-ca", help="create the authority (refuses to replace one)")
    init.add_argument("--cn", default="llmgw CA")
    init.set_defaults(func=_init_ca)
    client = cert_sub.add_parser("issue-client", help="a node's certificate: CN = node id")
    client.add_argument("node")
    client.add_argument("--out", required=True, help="directory for NODE.pem, NODE-key.pem and ca.pem")
    client.add_argument("--days", type=int)
    client.set_defaults(func=_issue_client)
    sign = cert_sub.add_parser(
        "sign", help="sign a node's certificate request (its key stays on the node): CN must be NODE")
    sign.add_argument("node")
    sign.add_argument("--csr", required=True, help="the request, PEM ('-': stdin), e.g. from 'llmgw-agent csr'")
    sign.add_argument("--out", help="directory for NODE.pem and ca.pem (default: the certificate on stdout)")
    sign.add_argument("--days", type=int, help="lifetime (default $LLMGW_NODE_CERT_DAYS, 30)")
    sign.set_defaults(func=_sign)
    server = cert_sub.add_parser("issue-server", help="a server certificate with subject alternative names")
    server.add_argument("--host", action="append", default=[], help="DNS name (repeatable)")
    server.add_argument("--ip", action="append", default=[], help="IP address (repeatable)")
    server.add_argument("--out", help="directory for server.pem, server-key.pem and ca.pem")
    server.add_argument("--install", action="store_true", help="make it the agent API's certificate")
    server.add_argument("--days", type=int)
    server.set_defaults(func=_issue_server)
    listing = cert_sub.add_parser("list", help="every certificate issued")
    output_flag(listing)
    listing.set_defaults(func=_list)
    revoke = cert_sub.add_parser("revoke", help="revoke a node's certificates, or one by serial")
    revoke.add_argument("target", metavar="NODE|SERIAL")
    revoke.add_argument("--reason", default="")
    revoke.set_defaults(func=_revoke)


def _pki(args):
    """Set Django up on the data directory, migrated; the pki services."""
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


def _init_ca(args) -> int:
    services = _pki(args)
    try:
        row = services.ca_init(common_name=args.cn)
    except services.PkiError as exc:
        raise CtlError(str(exc)) from exc
    print(f"created authority {row.common_name!r} serial {row.serial} in {services.pki_dir()}")
    return 0


def _issue_client(args) -> int:
    services = _pki(args)
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


def _sign(args) -> int:
    services = _pki(args)
    import sys

    from pki.signing import cert_sign_node

    try:
        csr = sys.stdin.read() if args.csr == "-" else Path(args.csr).read_text()
    except OSError as exc:
        raise CtlError(f"cannot read the request {args.csr}: {exc.strerror}") from exc
    try:
        signed = cert_sign_node(node_id=args.node, csr_pem=csr, days=args.days)
    except services.PkiError as exc:
        raise CtlError(str(exc)) from exc
    what = "signed" if signed.new else "already signed (this key's live certificate)"
    note = f"{what} {args.node} serial {signed.row.serial}, valid until {signed.row.not_after:%Y-%m-%d %H:%M} UTC"
    if not args.out:
        sys.stdout.write(signed.cert_pem.decode())
        print(note, file=sys.stderr)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.node}.pem").write_bytes(signed.cert_pem)
    (out / "ca.pem").write_bytes(signed.ca_pem)
    print(note)
    print(f"  cert {out / (args.node + '.pem')}\n  ca   {out / 'ca.pem'}")
    return 0


def _issue_server(args) -> int:
    services = _pki(args)
    if not args.out and not args.install:
        raise CtlError("say where it goes: --out DIR, or --install to make it the agent API's certificate")
    try:
        issued = services.cert_issue_server(hosts=args.host, ips=args.ip, days=args.days, install=args.install)
    except services.PkiError as exc:
        raise CtlError(str(exc)) from exc
    if args.out:
        paths = services.bundle_write(issued=issued, out_dir=Path(args.out), name="server")
        print(f"wrote {paths['cert']}, {paths['key']} and {paths['ca']}")
    if args.install:
        print(f"installed as the agent API's certificate in {services.pki_dir()}; restart the agent API")
    print(f"serial {issued.row.serial}, names {', '.join(issued.row.subject_alt_names)}")
    return 0


def _list(args) -> int:
    _pki(args)
    from pki.api.serializers import CertificateSerializer
    from pki.selectors import cert_list

    return print_listing(
        args, CertificateSerializer(cert_list(), many=True).data,
        ["cn", "kind", "serial", "expires", "revoked"],
        lambda r: [r["common_name"], r["kind"], r["serial"], r["not_after"][:10], (r["revoked_at"] or "")[:19]],
    )


def _revoke(args) -> int:
    services = _pki(args)
    try:
        rows = services.cert_revoke(target=args.target, reason=args.reason, actor=f"{getpass.getuser()} (llmgw ctl)")
    except services.PkiError as exc:
        raise CtlError(str(exc)) from exc
    for row in rows:
        print(f"revoked {row.kind} certificate {row.serial} ({row.common_name})")
    return 0
