"""What this machine has: GPUs (nvidia-smi or NVML) and InfiniBand HCAs (sysfs).

A discovery that fails is never "no GPUs": a missing nvidia-smi looks exactly
like a node without GPUs unless we say otherwise, so every failure becomes a
line in the heartbeat's ``discovery_errors`` and the control plane shows it.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .config import AgentConfig, DiscoveryConfig
from .protocol import GpuInfo, HcaInfo

logger = logging.getLogger(__name__)

NVIDIA_SMI_QUERY = ["--query-gpu=index,uuid,name,memory.total,pci.bus_id", "--format=csv,noheader,nounits"]
NVIDIA_SMI_TIMEOUT = 30.0  # a GPU that fell off the bus can make nvidia-smi very slow


class DiscoveryError(Exception):
    pass


@dataclass
class Inventory:
    gpus: list[GpuInfo] = field(default_factory=list)
    hcas: list[HcaInfo] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def discover(config: AgentConfig) -> Inventory:
    gpus, gpu_errors = discover_gpus(config.discovery)
    hcas, hca_errors = discover_hcas(config.discovery.ib_root, config.fabric_of)
    return Inventory(gpus=gpus, hcas=hcas, errors=gpu_errors + hca_errors)


# --- GPUs ---------------------------------------------------------------------


def discover_gpus(discovery: DiscoveryConfig) -> tuple[list[GpuInfo], list[str]]:
    if discovery.skip_gpus:
        return [], []
    errors: list[str] = []
    if discovery.prefer_nvml:
        try:
            return gpus_from_nvml(), []
        except DiscoveryError as exc:
            errors.append(f"NVML: {exc}; fell back to nvidia-smi")
    try:
        gpus, line_errors = gpus_from_nvidia_smi(discovery.nvidia_smi)
    except DiscoveryError as exc:
        return [], errors + [f"nvidia-smi: {exc}"]
    return gpus, errors + [f"nvidia-smi: {e}" for e in line_errors]


def find_nvidia_smi(configured: str) -> str:
    if configured:
        return configured
    found = shutil.which("nvidia-smi")
    if found is None:
        raise DiscoveryError(
            "not found on PATH, so this node's GPUs are unknown (not absent). Install the NVIDIA driver, "
            "set discovery.nvidia_smi to where it lives, or discovery.skip_gpus: true for a node without GPUs"
        )
    return found


def gpus_from_nvidia_smi(configured: str, *, timeout: float = NVIDIA_SMI_TIMEOUT) -> tuple[list[GpuInfo], list[str]]:
    path = find_nvidia_smi(configured)
    try:
        done = subprocess.run(
            [path, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError as exc:
        raise DiscoveryError(f"{path} does not exist ({exc.strerror})") from exc
    except PermissionError as exc:
        raise DiscoveryError(f"{path} cannot be run ({exc.strerror})") from exc
    except subprocess.TimeoutExpired as exc:
        raise DiscoveryError(
            f"{path} did not answer within {timeout:g}s; check the driver (dmesg for Xid errors)"
        ) from exc
    except OSError as exc:
        raise DiscoveryError(f"{path} cannot be run: {exc}") from exc
    if done.returncode != 0:
        detail = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise DiscoveryError(f"{path} exited with status {done.returncode}: {detail}")
    return parse_nvidia_smi_csv(done.stdout)


def parse_nvidia_smi_csv(text: str) -> tuple[list[GpuInfo], list[str]]:
    """``0, GPU-3b6d..., NVIDIA H200, 143771, 00000000:18:00.0`` per line.

    A line that does not parse (a GPU that needs a reset prints ``[N/A]`` or
    an error in place of its values) costs that GPU, not the whole node.
    """
    gpus, errors = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) > 5:  # a name with a comma in it
            parts = [parts[0], parts[1], ",".join(parts[2:-2]), parts[-2], parts[-1]]
        if len(parts) != 5:
            errors.append(f"line {number} is not index, uuid, name, memory.total, pci.bus_id: {line.strip()!r}")
            continue
        index, uuid, name, memory, bus = parts
        try:
            gpus.append(GpuInfo(index=int(index), uuid=uuid, name=name, memory_mib=int(float(memory)), pci_bus_id=bus))
        except ValueError:
            errors.append(f"line {number} does not parse: {line.strip()!r}")
    return gpus, errors


def gpus_from_nvml() -> list[GpuInfo]:
    try:
        import pynvml  # nvidia-ml-py; optional, so imported only here
    except ImportError as exc:
        raise DiscoveryError(
            "prefer_nvml is set but nvidia-ml-py is not installed (pip install nvidia-ml-py)"
        ) from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise DiscoveryError(f"cannot initialise: {exc}") from exc
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total // (1024 * 1024)),
                    pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                )
            )
        return gpus
    except pynvml.NVMLError as exc:
        raise DiscoveryError(str(exc)) from exc
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


# --- InfiniBand -----------------------------------------------------------------


def discover_hcas(ib_root: Path, fabric_of: Callable[[str], str | None]) -> tuple[list[HcaInfo], list[str]]:
    if not ib_root.is_dir():
        # No InfiniBand on this machine: an island, not an error. A node whose
        # fabrics name HCAs was already refused by the configuration check.
        return [], []
    hcas, errors = [], []
    for hca_dir in sorted(p for p in ib_root.iterdir() if p.is_dir()):
        try:
            hcas.append(read_hca(hca_dir, fabric_of(hca_dir.name)))
        except DiscoveryError as exc:
            errors.append(f"HCA {hca_dir.name}: {exc}")
    return hcas, errors


def read_hca(hca_dir: Path, fabric: str | None) -> HcaInfo:
    ports_dir = hca_dir / "ports"
    ports = []
    if ports_dir.is_dir():
        ports = sorted((p for p in ports_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    if not ports:
        raise DiscoveryError(f"no ports under {ports_dir}")
    # One row per HCA: the first active port describes it best.
    states = {p: _after_colon(_read(p / "state")) for p in ports}
    port = next((p for p in ports if states[p] == "ACTIVE"), ports[0])
    return HcaInfo(
        name=hca_dir.name,
        fabric=fabric,
        port=int(port.name),
        state=states[port],
        phys_state=_after_colon(_read(port / "phys_state")),
        link_layer=_read(port / "link_layer"),
        rate=_read(port / "rate"),
        guid=_read(hca_dir / "node_guid"),
        gid=_read(port / "gids" / "0"),
    )


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise DiscoveryError(f"cannot read {path}: {exc.strerror}") from exc


def _after_colon(value: str) -> str:
    """``4: ACTIVE`` -> ``ACTIVE``; ``5: LinkUp`` -> ``LinkUp``."""
    return value.partition(":")[2].strip() if ":" in value else value
