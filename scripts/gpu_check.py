#!/usr/bin/env python
"""Run the agent's GPU discovery and telemetry against this machine's GPUs.

    .venv/bin/python scripts/gpu_check.py [--nvidia-smi PATH] [--listen SECONDS]

For the day a machine with a GPU is at hand: it reads GPUs the way the agent
does (NVML through nvidia-ml-py, else nvidia-smi), takes one telemetry
block, optionally listens for Xid events for a few seconds, and prints what
it read, saying which GPUs the control plane would quarantine. On a
machine without a GPU (or without the driver) it says so and exits 0: there
is nothing to check, which is not a failure. It exits 1 only when something
that is there answers wrongly (a GPU NVML cannot read, discovery errors).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.config import AgentConfig, DiscoveryConfig, SupervisorConfig, TelemetryConfig, TlsConfig  # noqa: E402
from agent.discovery import DiscoveryError, discover_gpus, gpus_from_nvml  # noqa: E402
from agent.nvml import TelemetryReader, load_pynvml  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvidia-smi", default="", help="where nvidia-smi is (default: on PATH)")
    p.add_argument("--listen", type=float, default=0.0, help="listen for Xid events this many seconds")
    args = p.parse_args()

    pynvml, why = load_pynvml()
    smi = args.nvidia_smi or shutil.which("nvidia-smi")
    if pynvml is None and not smi:
        print(f"no GPU to check on this machine: {why}, and no nvidia-smi on PATH. Nothing to do (passed).")
        return 0
    if pynvml is not None:
        try:
            gpus = gpus_from_nvml()
            source = "NVML"
        except DiscoveryError as exc:
            if not smi:
                print(f"no GPU to check on this machine: NVML says {exc}, and no nvidia-smi on PATH (passed).")
                return 0
            print(f"NVML: {exc}; trying nvidia-smi")
            gpus, errors = discover_gpus(DiscoveryConfig(nvidia_smi=args.nvidia_smi))
            source = "nvidia-smi"
    else:
        print(f"NVML: {why}; discovery through nvidia-smi")
        gpus, errors = discover_gpus(DiscoveryConfig(nvidia_smi=args.nvidia_smi))
        source = "nvidia-smi"
        if errors and not gpus:
            print(f"no GPU to check on this machine: {'; '.join(errors)} (passed)")
            return 0
    if not gpus:
        print(f"no GPU found through {source}: nothing to check (passed)")
        return 0
    print(f"discovery ({source}): {len(gpus)} GPU(s)")
    for g in gpus:
        print(f"  {g.index}: {g.name}  {g.uuid}  {g.memory_mib} MiB  {g.pci_bus_id}")

    config = AgentConfig(
        node_id="gpu-check", server="https://127.0.0.1:7443", tls=TlsConfig(Path(), Path(), Path()),
        mgmt_addr="127.0.0.1", discovery=DiscoveryConfig(nvidia_smi=args.nvidia_smi),
        supervisor=SupervisorConfig(work_dir=Path("/nonexistent")), telemetry=TelemetryConfig(source="auto"),
    )
    reader = TelemetryReader(config)
    try:
        if args.listen > 0:
            print(f"listening for Xid events for {args.listen:g}s ...")
            time.sleep(args.listen)
        block = reader.read()
    finally:
        reader.close()
    print(f"telemetry ({block.source}){': ' + block.note if block.note else ''}")
    failing = 0
    for r in block.gpus:
        fields = {k: v for k, v in vars(r).items()
                  if k not in ("index", "uuid") and v is not None and v != [] and v != "" and v is not False}
        print(f"  {r.index}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))
        if r.lost or r.error:
            failing += 1
            print(f"     -> the control plane would quarantine GPU {r.index}: "
                  f"{'lost from the bus' if r.lost else r.error}")
        if any(x not in (13, 31, 43, 45, 68, 109) for x in r.xids):
            failing += 1
            print(f"     -> the control plane would quarantine GPU {r.index}: Xid {r.xids}")
    if block.source == "nvml" and not block.gpus:
        print("NVML answered but listed no GPU")
        return 1
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
