"""A GPU's state: quarantined by its readings, cleared by an operator.

The verdicts come from ``nodes.gpu_health`` (through ``nodes.telemetry``);
this module persists them under the lock order (the node, then its GPU
rows, then, through ``hooks.gpus_quarantined_handlers``, the members and
replicas that used a quarantined GPU, which fail over at once by the usual
path). Quarantine is a column of the GPU's row, so it survives agent and
control-plane restarts; placement reads GPUs only through
``Gpu.objects.in_service()``.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.utils import timezone

from core.choices import EventSeverity
from core.events import event_record
from core.exceptions import InvalidTransition, NotFound

from . import hooks, liveness, longpoll, telemetry
from .choices import GpuFault, NodeEventKind
from .gpu_health import Verdict, xid_text
from .models import Gpu, Node

logger = logging.getLogger(__name__)


class GpuNotQuarantined(InvalidTransition):
    """Clearing a GPU that is in service (the API answers 409)."""


def _bump_on_commit(node_name: str) -> None:
    # The heartbeat path caches each node's quarantines for its liveness version.
    telemetry.forget_node(node_name)
    transaction.on_commit(lambda: liveness.store().bump_many([node_name], channel=longpoll.CHANNEL))


def gpus_judged(*, node_name: str, quarantine: dict[int, Verdict], application_xids: dict[int, tuple[int, ...]],
                cleared_by_rule: list[int], readings: dict[int, dict[str, Any]]) -> None:
    """Persist what a telemetry block's verdicts changed. Idempotent: a GPU
    already quarantined is not quarantined again, one already cleared not cleared."""
    with transaction.atomic():
        node = Node.objects.select_for_update(no_key=True).filter(name=node_name).first()
        if node is None:
            return
        gpus = {g.index: g for g in Gpu.objects.select_for_update(no_key=True)
                .filter(node=node, missing_since=None, index__in=[*quarantine, *application_xids, *cleared_by_rule])
                .order_by("pk")}
        now = timezone.now()
        quarantined: dict[int, str] = {}
        for index, xids in application_xids.items():
            if index in gpus:
                what = ", ".join(xid_text(x) for x in xids)
                event_record(kind=NodeEventKind.GPU_XID, subject=f"node/{node_name}/gpu/{index}", node=node,
                             message=f"GPU {index} ({gpus[index].uuid}) reported {what}: an application's "
                                     "error, the GPU stays in service",
                             severity=EventSeverity.WARNING, data={"gpu": index, "xids": list(xids)})
        for index, verdict in quarantine.items():
            gpu = gpus.get(index)
            if gpu is None or gpu.quarantined_at is not None:
                continue
            gpu.quarantined_at, gpu.quarantine_kind, gpu.quarantine_reason = now, verdict.fault, verdict.reason
            if verdict.xid is not None:
                gpu.last_xid = verdict.xid
            gpu.save(update_fields=["quarantined_at", "quarantine_kind", "quarantine_reason", "last_xid"])
            event_record(
                kind=NodeEventKind.GPU_QUARANTINED, subject=f"node/{node_name}/gpu/{index}", node=node,
                message=f"GPU {index} ({gpu.uuid}) quarantined: {verdict.reason}; it takes no work until an "
                        f"operator clears it ('llmgw ctl gpus clear {node_name} {index}')",
                severity=EventSeverity.ERROR,
                data={"gpu": index, "uuid": gpu.uuid, "fault": verdict.fault, "xid": verdict.xid},
            )
            quarantined[gpu.pk] = f"GPU {index} ({gpu.uuid}) of node {node_name} quarantined: {verdict.reason}"
        for index in cleared_by_rule:
            gpu = gpus.get(index)
            if gpu is not None and gpu.quarantined_at is not None:
                _clear(gpu, node, who="the reset rule (LLMGW_GPU_AUTO_CLEAR): NVML shows it reset and healthy",
                       uncorrected=readings.get(index, {}).get("ecc_uncorrected"))
        if quarantined:
            for handler in hooks.gpus_quarantined_handlers:
                handler(node=node, reasons=quarantined)
        if quarantined or cleared_by_rule:
            _bump_on_commit(node_name)


def _clear(gpu: Gpu, node: Node, *, who: str, uncorrected: int | None) -> None:
    was = gpu.quarantine_reason
    gpu.quarantined_at, gpu.quarantine_kind, gpu.quarantine_reason = None, "", ""
    if uncorrected is not None:
        # The errors that quarantined it were judged; only new ones count.
        gpu.ecc_uncorrected_baseline = uncorrected
    gpu.save(update_fields=["quarantined_at", "quarantine_kind", "quarantine_reason", "ecc_uncorrected_baseline"])
    event_record(
        kind=NodeEventKind.GPU_CLEARED, subject=f"node/{node.name}/gpu/{gpu.index}", node=node,
        message=f"GPU {gpu.index} ({gpu.uuid}) back in service, cleared by {who} (it was quarantined: {was})",
        data={"gpu": gpu.index, "uuid": gpu.uuid, "by": who},
    )


def gpu_clear(*, node_name: str, index: int, actor: str = "") -> Gpu:
    """An operator puts a quarantined GPU back in service (an Event names who).
    Its current uncorrectable ECC count becomes the baseline, so only new
    errors quarantine it again; a GPU still lost or failing is quarantined
    again by its next readings."""
    try:
        latest = telemetry.store().latest(node_name).get(node_name, {})
    except Exception as exc:  # noqa: BLE001 - Redis away: the baseline stays as it was
        logger.warning("GPU clear without the latest readings node=%s: %s", node_name, exc)
        latest = {}
    reading = next((r for r in telemetry.readings_of(latest) if r["index"] == index), {})
    with transaction.atomic():
        node = Node.objects.select_for_update(no_key=True).filter(name=node_name).first()
        if node is None:
            raise NotFound(f"no node named {node_name!r}; 'llmgw ctl nodes' lists them")
        gpu = Gpu.objects.select_for_update(no_key=True).filter(node=node, index=index, missing_since=None).first()
        if gpu is None:
            raise NotFound(f"node {node_name} has no GPU {index}; 'llmgw ctl gpus --node {node_name}' lists them")
        if gpu.quarantined_at is None:
            raise GpuNotQuarantined(f"GPU {index} of node {node_name} is not quarantined; nothing to clear")
        _clear(gpu, node, who=actor or "an operator", uncorrected=reading.get("ecc_uncorrected"))
        _bump_on_commit(node_name)
        # A pending replica may fit now.
        for handler in hooks.gpus_cleared_handlers:
            handler(node=node)
    return gpu


FAULT_WORDS = {GpuFault.XID: "critical Xid", GpuFault.ECC: "uncorrectable ECC", GpuFault.LOST: "lost from the bus",
               GpuFault.NVML: "NVML failing"}
