"""The NVML of a simulated node: pynvml's names over files in the node's directory.

``FakeNvml`` answers the calls ``agent.nvml`` makes, with pynvml's shapes and
errors, for the GPUs ``llmgw sim node-kit`` wrote in ``nvml.json``. A GPU's
utilisation follows the sim engines that hold it (each leader writes its
requests in flight to ``sim-load.json`` in its member directory); memory,
power and temperature follow the utilisation.

Faults are injected by appending a JSON line to ``gpu-faults.jsonl`` in the
node's directory (``inject_fault`` below, ``llmgw sim gpu-fault``):
``{"gpu": 0, "xid": 79}`` raises an Xid event and, for 79, makes the GPU
fall off the bus; ``{"gpu": 0, "ecc_uncorrected": 1}`` adds uncorrectable
ECC errors; ``{"gpu": 0, "lost": true}``; ``{"gpu": 0, "nvml_error": "..."}``
makes every read of that GPU fail; ``{"gpu": 0, "reset": true}`` is a GPU
reset (clears lost, errors and volatile ECC counts).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .nvml import (
    EVENT_XID_CRITICAL, NVML_ERROR_GPU_IS_LOST, NVML_ERROR_TIMEOUT, NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
)

GPUS_FILE = "nvml.json"
FAULTS_FILE = "gpu-faults.jsonl"
POWER_LIMIT_MW = 700_000
IDLE_POWER_MW = 75_000
FAULT_KEYS = ("gpu", "xid", "ecc_uncorrected", "ecc_corrected", "lost", "nvml_error", "reset", "temp_c", "at")


class NVMLError(Exception):
    """pynvml.NVMLError's shape: ``value`` is the NVML return code."""

    def __init__(self, value: int, message: str = "") -> None:
        self.value = value
        super().__init__(message or {NVML_ERROR_TIMEOUT: "Timeout", NVML_ERROR_GPU_IS_LOST: "GPU is lost"}.get(value, f"error {value}"))


@dataclass
class _Gpu:
    index: int
    uuid: str
    name: str
    memory_mib: int
    pci_bus_id: str
    lost: bool = False
    error: str = ""
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    temp_c: int | None = None


@dataclass
class _Rates:
    gpu: int
    memory: int


@dataclass
class _Memory:
    total: int
    used: int
    free: int


@dataclass
class _Event:
    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass
class _EventSet:
    devices: set = field(default_factory=set)


def write_gpus(sim_dir: Path, gpus: list[dict[str, Any]]) -> None:
    (sim_dir / GPUS_FILE).write_text(json.dumps({"gpus": gpus}, indent=1))


def inject_fault(sim_dir: Path, fault: dict[str, Any]) -> None:
    """Append one fault for the node's fake NVML to act on (read at its next call)."""
    unknown = set(fault) - set(FAULT_KEYS)
    if unknown:
        raise ValueError(f"unknown fault keys {sorted(unknown)}; known: {', '.join(FAULT_KEYS)}")
    if not isinstance(fault.get("gpu"), int) or isinstance(fault.get("gpu"), bool):
        raise ValueError("a fault names its GPU by index: {'gpu': 0, ...}")
    with open(sim_dir / FAULTS_FILE, "a") as f:
        f.write(json.dumps({**fault, "at": time.time()}) + "\n")


class FakeNvml:
    NVMLError = NVMLError

    def __init__(self, sim_dir: Path | str, work_dir: Path | str | None = None) -> None:
        self.sim_dir = Path(sim_dir)
        self.work_dir = Path(work_dir) if work_dir else None
        self._gpus: list[_Gpu] = []
        self._offset = 0
        self._events: list[_Event] = []
        self._sets: list[_EventSet] = []
        self._cond = threading.Condition()
        self._load: dict[int, float] = {}
        self._load_at = 0.0
        self._file_lock = threading.Lock()

    # --- files -----------------------------------------------------------------------------

    def _faults(self) -> None:
        """Apply the fault lines appended since the last call."""
        path = self.sim_dir / FAULTS_FILE
        try:
            with self._file_lock, open(path) as f:
                f.seek(self._offset)
                lines = f.readlines()
                self._offset = f.tell()
        except FileNotFoundError:
            return
        for line in lines:
            try:
                fault = json.loads(line)
                gpu = self._gpus[int(fault["gpu"])]
            except (ValueError, KeyError, IndexError, TypeError):
                continue
            if fault.get("reset"):
                gpu.lost, gpu.error, gpu.ecc_corrected, gpu.ecc_uncorrected, gpu.temp_c = False, "", 0, 0, None
            gpu.ecc_uncorrected += int(fault.get("ecc_uncorrected") or 0)
            gpu.ecc_corrected += int(fault.get("ecc_corrected") or 0)
            if fault.get("temp_c") is not None:
                gpu.temp_c = int(fault["temp_c"])
            if fault.get("nvml_error"):
                gpu.error = str(fault["nvml_error"])
            if fault.get("lost"):
                gpu.lost = True
            if fault.get("xid") is not None:
                xid = int(fault["xid"])
                if xid == 79:
                    gpu.lost = True
                with self._cond:
                    if any(gpu.index in s.devices for s in self._sets):
                        self._events.append(_Event(device=gpu.index, eventType=EVENT_XID_CRITICAL, eventData=xid))
                        self._cond.notify_all()

    def _utilisation(self) -> dict[int, float]:
        """Per GPU index: 0 when no engine holds it; an engine that holds
        it idles at 5 %, plus 30 % per request in flight on its leader."""
        now = time.monotonic()
        if now - self._load_at < 1.0:
            return self._load
        load: dict[int, float] = {}
        if self.work_dir and self.work_dir.is_dir():
            for record in self.work_dir.glob("*/engine.json"):
                try:
                    data = json.loads(record.read_text())
                    if data.get("exited") or data.get("pid") is None:
                        continue
                    os.kill(int(data["pid"]), 0)
                    gpus = [int(g) for g in data["spec"]["gpus"]]
                except (OSError, ValueError, KeyError, TypeError):
                    continue
                in_flight = 0
                for load_file in (record.parent / "sim-load.json", record.parent / "work" / "sim-load.json"):
                    try:
                        in_flight = int(json.loads(load_file.read_text())["in_flight"])
                        break
                    except (OSError, ValueError, KeyError, TypeError):
                        pass
                for g in gpus:
                    load[g] = min(100.0, 5.0 + 30.0 * in_flight)
        self._load, self._load_at = load, now
        return load

    def _gpu(self, handle: Any) -> _Gpu:
        self._faults()
        gpu = self._gpus[handle]
        if gpu.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if gpu.error:
            raise NVMLError(999, gpu.error)
        return gpu

    # --- pynvml's names ----------------------------------------------------------------------

    def nvmlInit(self) -> None:
        try:
            data = json.loads((self.sim_dir / GPUS_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise NVMLError(9, f"Driver Not Loaded (no readable {self.sim_dir / GPUS_FILE}: {exc})") from None
        self._gpus = [_Gpu(**g) for g in data["gpus"]]
        # Faults written before this agent started still happened: a GPU lost
        # stays lost across an agent restart (its Xid events were delivered then).
        try:
            with open(self.sim_dir / FAULTS_FILE) as f:
                for line in f:
                    fault = json.loads(line)
                    if fault.get("xid") == 79 or fault.get("lost"):
                        self._gpus[int(fault["gpu"])].lost = True
                    if fault.get("reset"):
                        self._gpus[int(fault["gpu"])].lost = False
                self._offset = f.tell()
        except (OSError, ValueError, KeyError, IndexError):
            pass

    def nvmlShutdown(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def nvmlDeviceGetCount(self) -> int:
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self._gpus):
            raise NVMLError(2, "Invalid Argument")
        return index

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:
        return type("PciInfo", (), {"busId": self._gpu(handle).pci_bus_id})()

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> _Rates:
        self._gpu(handle)
        util = self._utilisation().get(handle, 0.0)
        return _Rates(gpu=int(util), memory=int(util * 0.6))

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> _Memory:
        gpu = self._gpu(handle)
        total = gpu.memory_mib << 20
        # An engine takes 90 % of its GPUs' memory at start (vLLM's gpu-memory-utilization).
        used = int(total * 0.9) if handle in self._utilisation() else 0
        return _Memory(total=total, used=used, free=total - used)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        gpu = self._gpu(handle)
        return gpu.temp_c if gpu.temp_c is not None else int(31 + 0.45 * self._utilisation().get(handle, 0.0))

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        self._gpu(handle)
        return int(IDLE_POWER_MW + (POWER_LIMIT_MW - IDLE_POWER_MW) * 0.9 * self._utilisation().get(handle, 0.0) / 100)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:
        self._gpu(handle)
        return POWER_LIMIT_MW

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter_type: int) -> int:
        gpu = self._gpu(handle)
        return gpu.ecc_uncorrected if error_type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED else gpu.ecc_corrected

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        gpu = self._gpu(handle)
        pending = 1 if gpu.ecc_uncorrected else 0
        return (0, gpu.ecc_uncorrected, pending, 0)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        return 1 if self._gpu(handle).ecc_uncorrected else 0

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: int) -> int:
        gpu = self._gpu(handle)
        return 0x40 if (gpu.temp_c or 0) >= 90 else 0

    def nvmlDeviceGetSupportedEventTypes(self, handle: int) -> int:
        return EVENT_XID_CRITICAL | 0x2

    def nvmlEventSetCreate(self) -> _EventSet:
        event_set = _EventSet()
        self._sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: int, event_types: int, event_set: _EventSet) -> None:
        event_set.devices.add(handle)

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeout_ms: int) -> _Event:
        deadline = time.monotonic() + timeout_ms / 1000.0
        while True:
            self._faults()
            with self._cond:
                for event in self._events:
                    if event.device in event_set.devices:
                        self._events.remove(event)
                        return event
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NVMLError(NVML_ERROR_TIMEOUT)
                self._cond.wait(min(remaining, 0.2))

    nvmlEventSetWait = nvmlEventSetWait_v2

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        if event_set in self._sets:
            self._sets.remove(event_set)
