"""``llmgw ctl onboard``: a machine reached over SSH becomes a node (a job).

An area of ``llmgw ctl`` (see ``cli/ctl/__init__.py``); it speaks the REST API
(``/api/v1/jobs/onboard/``) and follows the job as ``ctl provision`` does.
"""

from __future__ import annotations

from .common import CtlError, api_call
from .provisioning import _watch, onboard_body, onboard_flags


def register(ctl_sub) -> None:
    onboard = ctl_sub.add_parser("onboard", help="install the agent on a machine over SSH and wait for it (a job)")
    onboard.add_argument("node", nargs="?", help="the node id: hostname and certificate CN")
    # The seeds' spellings of the node id.
    onboard.add_argument("--node", "--server", dest="node_flag", metavar="NODE", help="the node id (seeds' spelling)")
    onboard.add_argument("--addr", required=True, help="the machine's address over SSH")
    onboard.add_argument("--ssh-port", type=int, default=22)
    onboard.add_argument("--host-key-fingerprint", default="",
                         help="SHA256:... of a machine llmgw did not create (else: the key pinned when it was made)")
    onboard.add_argument("--reinstall", action="store_true", help="onboard a node that already heartbeats")
    onboard.add_argument("--agent-server", default="", help="the agent API as the node reaches it")
    onboard_flags(onboard)
    onboard.add_argument("--wait", action="store_true", help="show the steps as they go; exit non-zero on failure")
    onboard.add_argument("--timeout", type=float, default=1800)
    onboard.set_defaults(func=_onboard)


def _onboard(args) -> int:
    node = args.node or args.node_flag
    if not node:
        raise CtlError("name the node: llmgw ctl onboard NODE --addr ADDRESS (or --node NODE)")
    if args.node and args.node_flag and args.node != args.node_flag:
        raise CtlError(f"two node ids given ({args.node} and {args.node_flag}): a node has one name")
    job = api_call("POST", "/api/v1/jobs/onboard/", json={"node": node, "addr": args.addr, **onboard_body(args)})
    print(f"job {job['id']}: onboard {job['node_name']} at {job['params']['addr']}")
    return _watch(job["id"], args.timeout) if args.wait else 0
