"""``llmgw agent ...`` and ``llmgw sim ...``: the node side of the command line.

    llmgw agent --config /etc/llmgw/agent.yaml [--check]
    llmgw-agent run|check-config [--config FILE]          (the agent's own distribution)
    llmgw-agent csr --node NODE --key FILE [--fresh]      (a key made here, a request on stdout)
    llmgw sim node-kit NODE --dir DIR [--gpus 8] [--fabric ib-a:mlx5_0,mlx5_1] [--addr 127.0.1.1] ...
    llmgw sim engine --rank R --nnodes N --rendezvous HOST:PORT ...   (= python -m agent.engines.sim)

``cli.main`` hands over argv with argv[0] = "agent" or "sim"; nothing
here imports Django.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
from pathlib import Path

from .config import CONFIG_EXIT_STATUS, ConfigError, load_config

DEFAULT_CONFIG = "/etc/llmgw/agent.yaml"


def main(argv: list[str]) -> int:
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "agent":
        return agent_main(rest)
    if command == "sim":
        return sim_main(rest)
    print("usage: llmgw agent --config FILE | llmgw sim {node-kit,engine} ...", file=sys.stderr)
    return 2


# --- llmgw-agent (the agent's own distribution) -----------------------------------------


def agent_command(argv: list[str] | None = None) -> int | None:
    """The ``llmgw-agent`` console script installed on nodes."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        return agent_main(argv)
    command, rest = argv[0], argv[1:]
    if command == "run":
        return agent_main(rest)
    if command == "check-config":
        return agent_main([*rest, "--check"])
    if command == "csr":
        return csr_main(rest)
    if command == "version":
        from . import __version__

        print(__version__)
        return 0
    print("usage: llmgw-agent {run,check-config,csr,version} ...", file=sys.stderr)
    return 2


def csr_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="llmgw-agent csr",
        description="make this node's key (P-256, 0600) if missing and print a certificate request for it")
    parser.add_argument("--node", required=True, help="the node id: the certificate's CN")
    parser.add_argument("--key", required=True, help="the private key's path (kept if it exists)")
    parser.add_argument("--fresh", action="store_true", help="make a new key even if one exists")
    args = parser.parse_args(argv)
    from .identity import IdentityError, csr_make, key_ensure

    try:
        key = key_ensure(Path(args.key), fresh=args.fresh)
        sys.stdout.write(csr_make(node_id=args.node, key=key).decode())
    except (IdentityError, OSError, ValueError) as exc:
        print(f"llmgw-agent csr: {exc}", file=sys.stderr)
        return 1
    return 0


# --- llmgw agent ----------------------------------------------------------------------


def agent_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llmgw agent", description="the llmgw node agent")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"agent.yaml (default {DEFAULT_CONFIG})")
    parser.add_argument("--check", action="store_true",
                        help="check the configuration, print what discovery finds, and exit")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    # httpx logs every request at INFO: a line per heartbeat drowns the journal.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(exc.report(), file=sys.stderr)
        return CONFIG_EXIT_STATUS
    if args.check:
        return _check(config)

    from .runner import Agent

    try:
        agent = Agent(config)
    except OSError as exc:
        print(f"llmgw agent: cannot prepare {config.supervisor.work_dir}: {exc}", file=sys.stderr)
        return 1

    def stop(signum, _frame) -> None:
        logging.getLogger("agent").info("%s: stopping the agent (engines keep running)", signal.Signals(signum).name)
        agent.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    agent.run()
    return 0


def _check(config) -> int:
    from .discovery import discover

    inventory = discover(config)
    report = {
        "node_id": config.node_id,
        "server": config.server,
        "fabrics": [dataclasses.asdict(f) for f in config.fabrics],
        "gpus": [dataclasses.asdict(g) for g in inventory.gpus],
        "hcas": [dataclasses.asdict(h) for h in inventory.hcas],
        "discovery_errors": inventory.errors,
    }
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 1 if inventory.errors else 0


# --- llmgw sim ----------------------------------------------------------------------------


def sim_main(argv: list[str]) -> int:
    if argv and argv[0] == "engine":
        from .engines.sim import main as engine_main

        return engine_main(argv[1:])
    parser = argparse.ArgumentParser(prog="llmgw sim", description="simulated nodes and engines")
    sub = parser.add_subparsers(dest="command", required=True)
    kit = sub.add_parser("node-kit", help="write a fake nvidia-smi, a fake sysfs and an agent.yaml for a node")
    kit.add_argument("node", help="node id (also its certificate's common name)")
    kit.add_argument("--dir", required=True, help="where to write the kit")
    kit.add_argument("--gpus", type=int, default=8)
    kit.add_argument("--fabric", action="append", default=[], metavar="NAME[:HCA,HCA]",
                     help="a fabric and its HCAs (repeatable); omit for an island")
    kit.add_argument("--addr", default="127.0.1.1", help="mgmt_addr: where engines on this node are reached")
    kit.add_argument("--server", default="https://127.0.0.1:7443", help="the agent API")
    kit.add_argument("--certs", help="directory holding ca.pem, NODE.pem, NODE-key.pem (default --dir)")
    kit.add_argument("--heartbeat-interval", default="5s")
    kit.add_argument("--mgmt-interface", default="lo")
    kit.add_argument("--telemetry-interval", default="10s", help="how often its fake NVML is read")
    fault = sub.add_parser("gpu-fault", help="inject a fault into a simulated node's fake NVML (docs/gpus.md)")
    fault.add_argument("--dir", required=True, help="the node's kit directory (node-kit --dir)")
    fault.add_argument("--gpu", type=int, required=True, help="the GPU's index")
    what = fault.add_mutually_exclusive_group(required=True)
    what.add_argument("--xid", type=int, help="raise this Xid through the event API (79 also loses the GPU)")
    what.add_argument("--ecc-uncorrected", type=int, help="add this many uncorrectable ECC errors")
    what.add_argument("--ecc-corrected", type=int, help="add this many corrected ECC errors")
    what.add_argument("--lost", action="store_true", help="the GPU falls off the bus")
    what.add_argument("--nvml-error", help="every NVML read of this GPU fails with this message")
    what.add_argument("--temp", type=int, help="hold the GPU at this temperature (°C; 90 and above throttles)")
    what.add_argument("--reset", action="store_true", help="a GPU reset: back on the bus, errors and ECC counts gone")
    sub.add_parser("engine", help="the simulated engine (llmgw sim engine --help)")
    args = parser.parse_args(argv)
    if args.command == "gpu-fault":
        return _gpu_fault(args)
    return _node_kit(args)


def gpu_fault_of(args) -> dict:
    fault = {"gpu": args.gpu}
    for key, value in (("xid", args.xid), ("ecc_uncorrected", args.ecc_uncorrected),
                       ("ecc_corrected", args.ecc_corrected), ("nvml_error", args.nvml_error),
                       ("temp_c", args.temp)):
        if value is not None:
            fault[key] = value
    if args.lost:
        fault["lost"] = True
    if args.reset:
        fault["reset"] = True
    return fault


def _gpu_fault(args) -> int:
    from .nvml_fake import GPUS_FILE, inject_fault

    directory = Path(args.dir)
    try:
        gpus = json.loads((directory / GPUS_FILE).read_text())["gpus"]
    except (OSError, ValueError, KeyError) as exc:
        print(f"llmgw sim gpu-fault: {directory} is not a simulated node's kit ({GPUS_FILE}: {exc}); "
              "give the directory 'llmgw sim node-kit --dir' wrote", file=sys.stderr)
        return 2
    if not 0 <= args.gpu < len(gpus):
        print(f"llmgw sim gpu-fault: --gpu {args.gpu}: this node has GPUs 0-{len(gpus) - 1}", file=sys.stderr)
        return 2
    fault = gpu_fault_of(args)
    inject_fault(directory, fault)
    print(f"GPU {args.gpu} of the simulated node in {directory}: {', '.join(f'{k}={v}' for k, v in fault.items() if k != 'gpu')}")
    return 0


def _node_kit(args) -> int:
    from .simkit import KitError, node_kit

    try:
        paths = node_kit(
            node_id=args.node, directory=Path(args.dir), gpus=args.gpus, fabric_specs=args.fabric,
            addr=args.addr, server=args.server, certs=Path(args.certs) if args.certs else None,
            heartbeat_interval=args.heartbeat_interval, mgmt_interface=args.mgmt_interface,
            telemetry_interval=args.telemetry_interval,
        )
    except KitError as exc:
        print(f"llmgw sim node-kit: {exc}", file=sys.stderr)
        return 2
    print(f"simulated node {args.node}: {args.gpus} GPUs, fabrics: {', '.join(args.fabric) or 'none (island)'}")
    for label, path in paths.items():
        print(f"  {label:10} {path}")
    cert = paths["certs"] / f"{args.node}.pem"
    if not cert.exists():
        print(f"next: llmgw ctl cert issue-client {args.node} --out {paths['certs']}")
    print(f"then: llmgw agent --config {paths['config']}")
    return 0
