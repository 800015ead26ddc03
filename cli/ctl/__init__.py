"""``llmgw ctl``: the operator's command line, one module per area.

``ctl cert`` works on the local PKI directory (it runs on the host holding
the authority). Everything else talks to the operator REST API at
``LLMGW_URL`` with ``LLMGW_TOKEN``; both default to what a local
``llmgw up`` wrote (``cli/env.py``).

An area is a module with ``register(ctl_sub)``, which adds its subcommands
to ``ctl_sub`` (argparse subparsers) and points each at its handler with
``set_defaults(func=...)``. A handler takes the parsed arguments, calls the
API (``common.api_call``) and prints (``common.print_listing`` for tables and
``-o json``); it raises ``common.CtlError`` for what a person must fix. A new
area is a new module here and one entry in ``AREAS``.
"""

from __future__ import annotations

import sys

from . import catalog, certs, drain, events, gpus, keys, nodes, onboard, provisioning, rollout, tokens, users
from .common import CtlError

AREAS = (certs, nodes, gpus, events, catalog, drain, rollout, keys, provisioning, onboard, users, tokens)


def add_ctl_parser(sub) -> None:
    ctl = sub.add_parser("ctl", help="operate a running control plane")
    ctl_sub = ctl.add_subparsers(dest="ctl_command", required=True)
    for area in AREAS:
        area.register(ctl_sub)


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
