"""The ``llmgw`` command.

    llmgw up                  the whole control plane, in the foreground
    llmgw demo                the same with a simulated four-node cluster
    llmgw ctl ...             operate it (REST API; ``ctl cert`` works on the local PKI)
    llmgw agent --config F    the node agent (standalone: no Django)
    llmgw sim ...             simulated nodes and engines, for hardware-free clusters

Thin: parse, call a service or the REST API, print. ``up`` and ``demo`` are
imported once Django is set up, and the agent without Django (``cli/env.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

from agent.cli import main as agent_main

from .ctl import add_ctl_parser, run_ctl
from .datadir import UMASK
from .env import demo_data_dir, setup_django

DEMO_GRACE = "15"  # seconds without a heartbeat before a simulated node is lost


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("agent", "sim"):
        return agent_main(argv)

    parser = argparse.ArgumentParser(prog="llmgw", description="llmgw: control plane for GPU clusters serving LLMs")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run web, agent API, worker and beat in the foreground")
    up.add_argument("--data-dir", help="where everything lives (default $LLMGW_DATA_DIR or ./var)")
    up.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    up.add_argument("--web-port", type=int, default=8000)
    up.add_argument("--agent-port", type=int, default=7443)
    up.add_argument("--agent-workers", type=_positive, default=2, help="agent API (gunicorn) worker processes")
    up.add_argument("--web-workers", type=_positive, default=1, help="web (uvicorn) worker processes")
    up.add_argument("--workers", type=_positive, default=1, help="Celery worker processes")
    up.set_defaults(func=_cmd_up)

    demo = sub.add_parser("demo", help="llmgw with a simulated four-node cluster, in the foreground")
    demo.add_argument("--data-dir", default=None, help="default $LLMGW_DATA_DIR or ./var/demo")
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--web-port", type=int, default=8000)
    demo.add_argument("--agent-port", type=int, default=7443)
    demo_sub = demo.add_subparsers(dest="demo_command")
    kill = demo_sub.add_parser("kill", help="kill a simulated node: its agent and its engines")
    kill.add_argument("node")
    kill.add_argument("--data-dir", default=None)
    revive = demo_sub.add_parser("revive", help="start a killed simulated node again (it comes back empty)")
    revive.add_argument("node")
    revive.add_argument("--data-dir", default=None)
    gpu_fail = demo_sub.add_parser("gpu-fail", help="a GPU of a simulated node falls off the bus (Xid 79)")
    gpu_fail.add_argument("node")
    gpu_fail.add_argument("index", type=int)
    gpu_fail.add_argument("--xid", type=int, default=79, help="the Xid to raise (default 79)")
    gpu_fail.add_argument("--reset", action="store_true", help="reset the GPU instead (the repair)")
    gpu_fail.add_argument("--data-dir", default=None)
    demo.set_defaults(func=_cmd_demo)

    add_ctl_parser(sub)
    sub.add_parser("agent", help="run the node agent (llmgw agent --config agent.yaml)")
    sub.add_parser("sim", help="simulated nodes and engines (llmgw sim --help)")

    args = parser.parse_args(argv)
    try:
        if args.command == "ctl":
            return run_ctl(args.func, args)
        return args.func(args) or 0
    except KeyboardInterrupt:
        # Ctrl-C before the processes were up: they are stopped already.
        return 130


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of processes of 1 or more")
    return value


def _cmd_up(args) -> int:
    # Before anything is created: the database, its WAL, the broker's files,
    # every child's files, private from the start (cli/datadir.py).
    os.umask(UMASK)
    # The web process answers to Host headers naming where it listens (settings.ALLOWED_HOSTS).
    os.environ["LLMGW_WEB_HOST"] = args.host
    setup_django(args.data_dir)
    from .up import run_up

    return run_up(
        host=args.host, web_port=args.web_port, agent_port=args.agent_port, agent_workers=args.agent_workers,
        web_workers=args.web_workers, workers=args.workers,
    )


def _cmd_demo(args) -> int:
    # A short grace, so that the demo's failure story takes seconds (an
    # explicit LLMGW_NODE_GRACE wins); its children inherit it.
    os.environ.setdefault("LLMGW_NODE_GRACE", DEMO_GRACE)
    os.umask(UMASK)
    os.environ["LLMGW_WEB_HOST"] = args.host
    setup_django(args.data_dir or demo_data_dir())
    from . import demo

    if args.demo_command == "kill":
        return demo.kill_node(name=args.node, host=args.host, agent_port=args.agent_port)
    if args.demo_command == "revive":
        return demo.revive_node(name=args.node, host=args.host, agent_port=args.agent_port)
    if args.demo_command == "gpu-fail":
        return demo.gpu_fail(name=args.node, index=args.index, reset=args.reset, xid=args.xid, host=args.host,
                             agent_port=args.agent_port)
    return demo.run_demo(host=args.host, web_port=args.web_port, agent_port=args.agent_port)
