"""A GPU's health from its readings: a pure decision.

``gpu_verdict`` takes one reading (a telemetry block's entry, as a dict), the
GPU's uncorrectable-ECC baseline, the corrected count of its previous reading
and a ``Policy``, and says healthy, degraded or quarantined, with the reason.
It reads nothing and writes nothing: ``nodes.telemetry`` gathers the inputs
and ``nodes.gpus`` persists a quarantine, under the usual locks, with an Event.

What quarantines (the GPU is never placed on again until an operator clears
it): a critical Xid (every Xid but the application ones NVIDIA's device
plugin skips: 13, 31, 43, 45, 68, 109), a GPU fallen off the bus, NVML
failing for it (fail closed: a GPU we cannot read is not a healthy GPU), and
an uncorrectable ECC error. What degrades (still used, shown): a
corrected-error storm, thermal throttling, a temperature over the policy's
limit, retired pages or remapped rows waiting for a reset.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .choices import GpuFault, GpuHealth

# Xids caused by the application, not the GPU (NVIDIA's k8s device plugin skips the same).
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

# What an Xid means, for the Event an operator reads (NVIDIA's Xid catalog, shortened).
XID_MEANINGS = {
    8: "GPU stopped processing",
    13: "graphics engine exception (application)",
    31: "GPU memory page fault (application)",
    32: "invalid or corrupted push buffer stream",
    38: "driver firmware error",
    43: "GPU stopped processing (application)",
    45: "preemptive cleanup, due to previous errors (application)",
    48: "double-bit ECC error",
    56: "display engine error",
    57: "error programming video memory interface",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    68: "video processor exception (application)",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout (application)",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}

HEALTH_CODES = {GpuHealth.HEALTHY: 0, GpuHealth.DEGRADED: 1, GpuHealth.QUARANTINED: 2}


def xid_meaning(xid: int) -> str:
    return XID_MEANINGS.get(xid, "see NVIDIA's Xid catalog")


def xid_text(xid: int) -> str:
    return f"Xid {xid} ({xid_meaning(xid)})"


@dataclass(frozen=True)
class Policy:
    temp_degraded_c: int = 87
    ecc_corrected_storm: int = 100  # corrected errors between two readings
    # Clear a quarantine by itself once NVML shows the GPU reset and healthy (opt-in).
    auto_clear: bool = False


@dataclass(frozen=True)
class Verdict:
    health: str
    reason: str = ""
    fault: str = ""  # GpuFault, when quarantined
    xid: int | None = None  # the critical Xid that quarantined
    application_xids: tuple[int, ...] = ()  # seen, recorded, quarantining nothing


HEALTHY = Verdict(GpuHealth.HEALTHY)


def gpu_verdict(reading: Mapping[str, Any], *, baseline: int = 0, previous_corrected: int | None = None,
                policy: Policy = Policy()) -> Verdict:
    xids = reading.get("xids") or ()
    app = tuple(x for x in xids if x in APPLICATION_XIDS)
    critical = [x for x in xids if x not in APPLICATION_XIDS]
    if critical:
        xid = critical[0]
        return Verdict(GpuHealth.QUARANTINED, xid_text(xid), GpuFault.XID, xid, app)
    if reading.get("lost"):
        return Verdict(GpuHealth.QUARANTINED, "fell off the bus (NVML: GPU is lost)", GpuFault.LOST,
                       application_xids=app)
    if reading.get("error"):
        return Verdict(GpuHealth.QUARANTINED, f"NVML fails for this GPU: {reading['error']}"[:255], GpuFault.NVML,
                       application_xids=app)
    uncorrected = reading.get("ecc_uncorrected")
    if uncorrected is not None and uncorrected > baseline:
        return Verdict(GpuHealth.QUARANTINED, f"{uncorrected - baseline} uncorrectable ECC error(s)",
                       GpuFault.ECC, application_xids=app)
    degraded = []
    corrected = reading.get("ecc_corrected")
    if corrected is not None and previous_corrected is not None \
            and corrected - previous_corrected >= policy.ecc_corrected_storm:
        degraded.append(f"corrected ECC errors: {corrected - previous_corrected} since the last reading")
    if reading.get("thermal_throttle"):
        degraded.append("thermal throttling")
    temp = reading.get("temp_c")
    if temp is not None and temp >= policy.temp_degraded_c:
        degraded.append(f"{temp} °C")
    if reading.get("pending_retirement"):
        degraded.append("retired pages or remapped rows pending a reset")
    if degraded:
        return Verdict(GpuHealth.DEGRADED, "; ".join(degraded), application_xids=app)
    return Verdict(GpuHealth.HEALTHY, application_xids=app) if app else HEALTHY


def reset_shown(*, fault: str, xid: int | None, reading: Mapping[str, Any], policy: Policy) -> bool:
    """Whether a quarantine may end by itself: the operator turned the rule on
    and NVML shows the GPU reset and healthy. Only faults a reset is seen to
    end qualify: a GPU that fell off the bus (Xid 79) or that NVML could not
    read answers again; the volatile uncorrectable ECC count went back to 0.
    Other critical Xids leave no trace a reset clears: an operator decides."""
    if not policy.auto_clear:
        return False
    if gpu_verdict(reading, baseline=0, policy=policy).health == GpuHealth.QUARANTINED:
        return False
    if reading.get("pending_retirement"):
        return False
    if fault in (GpuFault.LOST, GpuFault.NVML) or (fault == GpuFault.XID and xid == 79):
        return True
    return fault == GpuFault.ECC and reading.get("ecc_uncorrected") == 0
