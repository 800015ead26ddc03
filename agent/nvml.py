"""GPU telemetry on the node: NVML through pynvml (nvidia-ml-py), or nvidia-smi.

``TelemetryReader`` reads every GPU at the telemetry interval (utilisation,
memory, temperature, power, ECC counts, pending page retirement or row
remapping, thermal throttling) and listens on NVML's event API for critical
Xid errors between reads. Whatever it cannot read is None, never a zero it
made up; a GPU whose reads fail says so in its reading (``error``, or
``lost`` for NVML_ERROR_GPU_IS_LOST) and the control plane takes it out of
service: a health check that swallows errors fails open, this one fails
closed.

The reader calls NVML through one object with pynvml's names (``nv``): the
real module, or a simulated node's fake (``agent.nvml_fake``), which is how
the whole path runs without a GPU. Where NVML is not available it says so
once and reads what ``nvidia-smi --query-gpu`` gives instead (no Xid events
there).
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections import defaultdict
from typing import Any

from .config import AgentConfig
from .discovery import DiscoveryError, find_nvidia_smi
from .protocol import GpuReading, Telemetry

logger = logging.getLogger(__name__)

# pynvml's values (nvml.h), named here so that this module reads without it installed.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_GPU_IS_LOST = 15
NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_FEATURE_ENABLED = 1
EVENT_XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
THROTTLE_THERMAL = 0x20 | 0x40  # SW and HW thermal slowdown (clocks throttle reasons)
EVENT_WAIT_MS = 1000

SMI_FIELDS = (
    "index", "uuid", "utilization.gpu", "utilization.memory", "memory.used", "memory.total", "temperature.gpu",
    "power.draw", "power.limit", "ecc.errors.corrected.volatile.total", "ecc.errors.uncorrected.volatile.total",
)
SMI_TIMEOUT = 20.0


def load_pynvml() -> tuple[Any, str]:
    """(pynvml, '') or (None, why not)."""
    try:
        import pynvml  # nvidia-ml-py: optional on a node, imported only here
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    return pynvml, ""


def _code(exc: Exception) -> int | None:
    return getattr(exc, "value", None)


class TelemetryReader:
    """One per agent. ``read()`` gives the next block; ``sent(block)`` drops
    the Xids the control plane has taken (they wait until then: a heartbeat
    that failed must not lose one)."""

    def __init__(self, config: AgentConfig, *, nv: Any = None, on_xid=None) -> None:
        self.config = config
        self.on_xid = on_xid or (lambda: None)
        self.source = config.telemetry.source
        self.note = ""
        self.nv = nv
        self._error_cls: type = Exception
        self._handles: list[Any] = []
        self._init_error = ""
        self._pending: dict[int, list[int]] = defaultdict(list)
        self._last_xid: dict[int, int] = {}
        self._event_error = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._open()

    # --- opening ---------------------------------------------------------------------------

    def _open(self) -> None:
        wanted = self.source
        if wanted == "off":
            return
        if wanted == "sim" and self.nv is None:
            from .nvml_fake import FakeNvml

            self.nv = FakeNvml(self.config.telemetry.sim_dir, self.config.supervisor.work_dir)
        if wanted in ("auto", "nvml") and self.nv is None:
            self.nv, why = load_pynvml()
            if self.nv is None:
                self._fall_back(why)
                return
        if wanted == "nvidia-smi":
            return
        self._error_cls = getattr(self.nv, "NVMLError", Exception)
        try:
            self.nv.nvmlInit()
            count = self.nv.nvmlDeviceGetCount()
            self._handles = [self.nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except self._error_cls as exc:
            if wanted == "sim":
                raise
            self._fall_back(f"NVML does not initialise ({exc})")
            return
        self.source = "sim" if wanted == "sim" else "nvml"
        self._start_events()

    def _fall_back(self, why: str) -> None:
        self.note = f"NVML unavailable: {why}; telemetry from nvidia-smi (no Xid events)"
        logger.warning("telemetry: %s", self.note)
        self.source = "nvidia-smi"
        self.nv = None

    def _start_events(self) -> None:
        nv = self.nv
        try:
            event_set = nv.nvmlEventSetCreate()
        except self._error_cls as exc:
            self._event_error = f"NVML event set unavailable ({exc}): Xid errors cannot be heard"
            logger.error("telemetry: %s", self._event_error)
            return
        registered = 0
        for index, handle in enumerate(self._handles):
            try:
                if nv.nvmlDeviceGetSupportedEventTypes(handle) & EVENT_XID_CRITICAL:
                    nv.nvmlDeviceRegisterEvents(handle, EVENT_XID_CRITICAL, event_set)
                    registered += 1
            except self._error_cls as exc:
                logger.warning("telemetry: GPU %d: cannot register for Xid events: %s", index, exc)
        if registered:
            threading.Thread(target=self._listen, args=(event_set,), name="nvml-events", daemon=True).start()

    def _listen(self, event_set: Any) -> None:
        nv = self.nv
        while not self._stop.is_set():
            try:
                data = nv.nvmlEventSetWait_v2(event_set, EVENT_WAIT_MS)
            except self._error_cls as exc:
                if _code(exc) == NVML_ERROR_TIMEOUT:
                    continue
                # NVIDIA's device plugin marks every GPU unhealthy here: the
                # event channel is how an Xid is heard, and it is deaf.
                with self._lock:
                    self._event_error = f"NVML event wait failed: {exc}"
                logger.error("telemetry: %s", self._event_error)
                self.on_xid()
                self._stop.wait(5.0)
                continue
            if not data.eventType & EVENT_XID_CRITICAL:
                continue
            try:
                index = nv.nvmlDeviceGetIndex(data.device)
            except self._error_cls:
                index = -1
            xid = int(data.eventData)
            logger.warning("telemetry: GPU %s Xid %d", index if index >= 0 else "?", xid)
            with self._lock:
                if index < 0:  # an Xid we cannot place: every GPU might be the one
                    for i in range(len(self._handles)):
                        self._pending[i].append(xid)
                else:
                    self._pending[index].append(xid)
            self.on_xid()

    def close(self) -> None:
        self._stop.set()
        if self.nv is not None and self._handles:
            try:
                self.nv.nvmlShutdown()
            except self._error_cls:
                pass

    # --- reading ---------------------------------------------------------------------------

    def read(self) -> Telemetry | None:
        if self.source == "off" or self.config.discovery.skip_gpus:
            return None
        if self.nv is None:
            return self._read_smi()
        with self._lock:
            pending = {i: list(x) for i, x in self._pending.items()}
            event_error = self._event_error
        gpus = []
        for index, handle in enumerate(self._handles):
            reading = self._read_one(index, handle)
            reading.xids = pending.get(index, [])
            if reading.xids:
                self._last_xid[index] = reading.xids[-1]
            reading.last_xid = self._last_xid.get(index)
            if event_error and not reading.error:
                reading.error = event_error
            gpus.append(reading)
        return Telemetry(source=self.source, gpus=gpus, note=self.note)

    def sent(self, block: Telemetry | None) -> None:
        if block is None:
            return
        with self._lock:
            for reading in block.gpus:
                taken = len(reading.xids)
                if taken:
                    del self._pending[reading.index][:taken]

    def _read_one(self, index: int, handle: Any) -> GpuReading:
        nv = self.nv
        reading = GpuReading(index=index)

        def get(call, *args):
            try:
                return call(handle, *args)
            except self._error_cls as exc:
                code = _code(exc)
                if code == NVML_ERROR_NOT_SUPPORTED:
                    return None
                if code == NVML_ERROR_GPU_IS_LOST:
                    reading.lost = True
                elif not reading.error:
                    reading.error = f"{call.__name__}: {exc}"[:200]
                return None

        uuid = get(nv.nvmlDeviceGetUUID)
        reading.uuid = uuid.decode() if isinstance(uuid, bytes) else (uuid or "")
        if reading.lost:
            return reading  # fallen off the bus: every other call says the same
        rates = get(nv.nvmlDeviceGetUtilizationRates)
        if rates is not None:
            reading.util, reading.mem_util = int(rates.gpu), int(rates.memory)
        memory = get(nv.nvmlDeviceGetMemoryInfo)
        if memory is not None:
            reading.mem_used_mib, reading.mem_total_mib = int(memory.used >> 20), int(memory.total >> 20)
        temp = get(nv.nvmlDeviceGetTemperature, NVML_TEMPERATURE_GPU)
        reading.temp_c = None if temp is None else int(temp)
        power = get(nv.nvmlDeviceGetPowerUsage)
        reading.power_w = None if power is None else round(power / 1000.0, 1)
        limit = get(nv.nvmlDeviceGetEnforcedPowerLimit)
        reading.power_limit_w = None if limit is None else round(limit / 1000.0, 1)
        corrected = get(nv.nvmlDeviceGetTotalEccErrors, NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_VOLATILE_ECC)
        reading.ecc_corrected = None if corrected is None else int(corrected)
        uncorrected = get(nv.nvmlDeviceGetTotalEccErrors, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)
        reading.ecc_uncorrected = None if uncorrected is None else int(uncorrected)
        # Ampere and later remap rows; older GPUs retire pages. Either waits for a reset.
        remapped = get(nv.nvmlDeviceGetRemappedRows)
        if remapped is not None:
            reading.pending_retirement = bool(remapped[2])
        elif not reading.error:
            retired = get(nv.nvmlDeviceGetRetiredPagesPendingStatus)
            reading.pending_retirement = None if retired is None else retired == NVML_FEATURE_ENABLED
        reasons = get(nv.nvmlDeviceGetCurrentClocksThrottleReasons)
        reading.thermal_throttle = None if reasons is None else bool(reasons & THROTTLE_THERMAL)
        return reading

    def _read_smi(self) -> Telemetry:
        try:
            path = find_nvidia_smi(self.config.discovery.nvidia_smi)
            done = subprocess.run(
                [path, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=SMI_TIMEOUT, stdin=subprocess.DEVNULL,
            )
        except (DiscoveryError, OSError, subprocess.TimeoutExpired) as exc:
            return Telemetry(source="nvidia-smi", note=f"{self.note}; nvidia-smi failed: {exc}"[:500])
        if done.returncode != 0:
            return Telemetry(source="nvidia-smi", note=f"{self.note}; nvidia-smi exited {done.returncode}"[:500])
        gpus, problems = parse_smi_telemetry(done.stdout)
        note = "; ".join([self.note, *problems[:3]])
        return Telemetry(source="nvidia-smi", gpus=gpus, note=note[:500])


def _smi_value(text: str, kind: type) -> Any:
    """nvidia-smi prints ``[N/A]`` or ``[Not Supported]`` for what it cannot read: None, not 0."""
    text = text.strip()
    if not text or text.startswith("[") or text in ("N/A", "Unknown Error"):
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if kind is int else round(value, 1)


def parse_smi_telemetry(text: str) -> tuple[list[GpuReading], list[str]]:
    """One line per GPU in SMI_FIELDS order. A line that does not parse is
    a problem of the block, not a verdict on a GPU (an nvidia-smi that prints
    something else, as a simulated node's does, must not quarantine anything).
    A GPU whose line says it needs a reset or fell off the bus is reported so."""
    gpus, problems = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(SMI_FIELDS) or not parts[0].isdigit():
            problems.append(f"nvidia-smi telemetry line {number} does not parse: {line.strip()[:120]!r}")
            continue
        reading = GpuReading(index=int(parts[0]), uuid=parts[1][:64])
        lowered = line.lower()
        if "gpu is lost" in lowered or "fallen off the bus" in lowered:
            reading.lost = True
        elif "requires reset" in lowered or "unknown error" in lowered:
            reading.error = f"nvidia-smi: {line.strip()[:150]}"
        reading.util, reading.mem_util = _smi_value(parts[2], int), _smi_value(parts[3], int)
        reading.mem_used_mib, reading.mem_total_mib = _smi_value(parts[4], int), _smi_value(parts[5], int)
        reading.temp_c = _smi_value(parts[6], int)
        reading.power_w, reading.power_limit_w = _smi_value(parts[7], float), _smi_value(parts[8], float)
        reading.ecc_corrected, reading.ecc_uncorrected = _smi_value(parts[9], int), _smi_value(parts[10], int)
        gpus.append(reading)
    return gpus, problems
