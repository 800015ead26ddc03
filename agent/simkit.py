"""A simulated node in one command: fake nvidia-smi, fake sysfs, an agent.yaml.

The GPU uuids and HCA GUIDs are derived from the node id, so any number of
simulated nodes on one machine report distinct hardware (the control plane
refuses a GPU uuid reported by two nodes, as it should).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .durations import BadDuration, format_duration, parse_duration
from .nvml_fake import write_gpus
from .protocol import FABRIC_NAME_RE, HCA_NAME_RE, NODE_ID_RE

GPU_NAME = "NVIDIA H200"
GPU_MEMORY_MIB = 143771
HCA_RATE = "400 Gb/sec (4X NDR)"
_UUID_NAMESPACE = uuid.UUID("6f1c1d0e-8b4f-4a7e-9a59-3c7f0e2b6d11")


class KitError(ValueError):
    pass


@dataclass(frozen=True)
class KitFabric:
    name: str
    hcas: tuple[str, ...]


def parse_fabrics(specs: list[str]) -> list[KitFabric]:
    """``ib-a:mlx5_0,mlx5_1`` or just ``ib-a`` (then the next two unused mlx5_N)."""
    fabrics: list[KitFabric] = []
    taken: dict[str, str] = {}
    next_index = 0
    for spec in specs:
        name, sep, hca_text = spec.partition(":")
        if not FABRIC_NAME_RE.match(name):
            raise KitError(f"--fabric {spec!r}: {name!r} is not a fabric name (letters, digits, '_', '.', '-')")
        if sep:
            hcas = [h.strip() for h in hca_text.split(",") if h.strip()]
        else:
            while f"mlx5_{next_index}" in taken or f"mlx5_{next_index + 1}" in taken:
                next_index += 1
            hcas = [f"mlx5_{next_index}", f"mlx5_{next_index + 1}"]
        if not hcas:
            raise KitError(f"--fabric {spec!r}: name at least one HCA, e.g. {name}:mlx5_0,mlx5_1")
        for hca in hcas:
            if not HCA_NAME_RE.match(hca):
                raise KitError(f"--fabric {spec!r}: {hca!r} is not an HCA name like mlx5_0")
            if hca in taken:
                raise KitError(
                    f"--fabric {spec!r}: HCA {hca} is already in fabric {taken[hca]}; an adapter is on one fabric"
                )
            taken[hca] = name
        if any(f.name == name for f in fabrics):
            raise KitError(f"--fabric {name} given twice; list all its HCAs once: --fabric {name}:a,b")
        fabrics.append(KitFabric(name=name, hcas=tuple(hcas)))
        next_index = max([next_index] + [int(h[5:]) + 1 for h in hcas if h.startswith("mlx5_") and h[5:].isdigit()])
    return fabrics


def gpu_uuid(node_id: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node_id}/gpu{index}')}"


def hca_guid(node_id: str, hca: str) -> str:
    digest = hashlib.sha256(f"{node_id}/{hca}".encode()).hexdigest()[:16]
    return ":".join(digest[i:i + 4] for i in range(0, 16, 4))


def nvidia_smi_csv(node_id: str, gpus: int) -> str:
    return "".join(
        f"{i}, {gpu_uuid(node_id, i)}, {GPU_NAME}, {GPU_MEMORY_MIB}, 00000000:{0x18 + i:02X}:00.0\n"
        for i in range(gpus)
    )


def write_nvidia_smi(path: Path, node_id: str, gpus: int) -> None:
    script = (
        "#!/bin/sh\n"
        f"# A fake nvidia-smi for the simulated node {node_id}, written by 'llmgw sim node-kit'.\n"
        "# Whatever it is asked, it prints what discovery asks for:\n"
        "# --query-gpu=index,uuid,name,memory.total,pci.bus_id --format=csv,noheader,nounits\n"
        "cat <<'CSV'\n" + nvidia_smi_csv(node_id, gpus) + "CSV\n"
    )
    path.write_text(script)
    path.chmod(0o755)


def write_sysfs(ib_root: Path, node_id: str, fabrics: list[KitFabric]) -> None:
    """The files discovery reads under /sys/class/infiniband, for each HCA."""
    ib_root.mkdir(parents=True, exist_ok=True)
    for fabric in fabrics:
        for hca in fabric.hcas:
            guid = hca_guid(node_id, hca)
            port = ib_root / hca / "ports" / "1"
            (port / "gids").mkdir(parents=True, exist_ok=True)
            files = {
                ib_root / hca / "node_guid": guid,
                port / "state": "4: ACTIVE",
                port / "phys_state": "5: LinkUp",
                port / "link_layer": "InfiniBand",
                port / "rate": HCA_RATE,
                port / "lid": f"0x{int(guid[-4:], 16) % 0xBFFF + 1:x}",
                port / "gids" / "0": "fe80:0000:0000:0000:" + guid,
            }
            for path, value in files.items():
                path.write_text(value + "\n")


def agent_config(
    *,
    node_id: str,
    server: str,
    addr: str,
    certs: Path,
    nvidia_smi: Path,
    ib_root: Path,
    work_dir: Path,
    fabrics: list[KitFabric],
    heartbeat_interval: str,
    mgmt_interface: str,
    sim_dir: Path | None = None,
    telemetry_interval: str = "10s",
) -> dict[str, Any]:
    """The agent.yaml of a simulated node, as data."""
    return {
        "node_id": node_id,
        "server": server,
        "tls": {
            "ca": str(certs / "ca.pem"),
            "cert": str(certs / f"{node_id}.pem"),
            "key": str(certs / f"{node_id}-key.pem"),
        },
        "mgmt_addr": addr,
        "mgmt_interface": mgmt_interface,
        "heartbeat_interval": heartbeat_interval,
        "reconnect_base": "1s",
        "reconnect_max": "30s",
        "fabrics": [{"name": f.name, "hcas": list(f.hcas)} for f in fabrics],
        "discovery": {
            "nvidia_smi": str(nvidia_smi),
            "ib_root": str(ib_root),
            "prefer_nvml": False,
            "skip_gpus": False,
        },
        "supervisor": {
            "work_dir": str(work_dir),
            "log_lines": 512,
            "stop_timeout": "30s",
            "health_interval": "2s",
        },
        # The GPUs' readings come from the node's fake NVML (agent.nvml_fake),
        # faults injected with 'llmgw sim gpu-fault'.
        "telemetry": (
            {"source": "sim", "interval": telemetry_interval, "sim_dir": str(sim_dir)}
            if sim_dir else {"source": "off"}
        ),
    }


def agent_yaml(**kwargs: Any) -> str:
    """agent.yaml of a simulated node (see ``agent_config``), with a word on where it came from."""
    config = agent_config(**kwargs)
    island = "" if config["fabrics"] else "# No fabric: an island, single-node replicas only.\n"
    return (
        f"# The simulated node {config['node_id']}, written by 'llmgw sim node-kit'.\n"
        "# Its GPUs come from a fake nvidia-smi and its HCAs from a sysfs-shaped\n"
        "# directory; everything else is a real agent.\n"
        + island
        + yaml.safe_dump(config, sort_keys=False)
    )


def node_kit(
    *,
    node_id: str,
    directory: Path,
    gpus: int = 8,
    fabric_specs: list[str] | None = None,
    addr: str = "127.0.1.1",
    server: str = "https://127.0.0.1:7443",
    certs: Path | None = None,
    heartbeat_interval: str = "5s",
    mgmt_interface: str = "lo",
    telemetry_interval: str = "10s",
) -> dict[str, Path]:
    if not NODE_ID_RE.match(node_id):
        raise KitError(f"{node_id!r} is not a valid node id: lowercase letters, digits, '-' and '.'")
    if not 0 <= gpus <= 64:
        raise KitError(f"--gpus {gpus}: between 0 and 64")
    fabrics = parse_fabrics(fabric_specs or [])
    try:
        # "1" on a command line means a second, as a bare number in agent.yaml does.
        heartbeat_interval = format_duration(parse_duration(
            float(heartbeat_interval) if heartbeat_interval.replace(".", "", 1).isdigit() else heartbeat_interval))
    except BadDuration as exc:
        raise KitError(f"--heartbeat-interval: {exc}") from None
    directory = directory.resolve()
    certs = (certs or directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    paths = {
        "config": directory / "agent.yaml",
        "nvidia_smi": directory / "nvidia-smi",
        "ib_root": directory / "sys" / "class" / "infiniband",
        "work_dir": directory / "work",
        "certs": certs,
    }
    write_nvidia_smi(paths["nvidia_smi"], node_id, gpus)
    write_gpus(directory, [
        {"index": i, "uuid": gpu_uuid(node_id, i), "name": GPU_NAME, "memory_mib": GPU_MEMORY_MIB,
         "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0"}
        for i in range(gpus)
    ])
    write_sysfs(paths["ib_root"], node_id, fabrics)
    paths["work_dir"].mkdir(exist_ok=True)
    text = agent_yaml(
        node_id=node_id, server=server, addr=addr, certs=certs, nvidia_smi=paths["nvidia_smi"],
        ib_root=paths["ib_root"], work_dir=paths["work_dir"], fabrics=fabrics,
        heartbeat_interval=heartbeat_interval, mgmt_interface=mgmt_interface,
        sim_dir=directory, telemetry_interval=telemetry_interval,
    )
    tmp = paths["config"].with_suffix(".yaml.tmp")
    tmp.write_text(text)
    os.replace(tmp, paths["config"])
    return paths
