"""Everything a heartbeat can write, in comparable form: a refused heartbeat
must leave it as it was."""

from __future__ import annotations

from core.models import Event
from nodes import liveness
from nodes.models import Fabric, Gpu, GpuConflict, Hca, Node
from replicas.models import GpuAllocation, Member, Replica


def db_state() -> dict:
    return {
        "nodes": list(
            Node.objects.order_by("name").values_list(
                "name", "status", "inventory_hash", "mgmt_addr", "mgmt_interface", "agent_version",
                "discovery_errors", "engines", "desired_version", "last_heartbeat_at",
            )
        ),
        "gpus": list(Gpu.objects.order_by("uuid").values_list("node__name", "index", "uuid", "memory_mib", "missing_since")),
        "hcas": list(Hca.objects.order_by("node__name", "name").values()),
        "fabrics": list(Fabric.objects.order_by("name").values_list("name", flat=True)),
        "conflicts": list(GpuConflict.objects.order_by("pk").values_list("claimant__name", "gpu__uuid")),
        "members": list(Member.objects.order_by("pk").values("state", "pid", "exit_code", "healthy", "log_tail", "reported_at")),
        "replicas": list(Replica.objects.order_by("pk").values_list("status", "status_reason")),
        "allocations": GpuAllocation.objects.count(),
        "events": Event.objects.count(),
        "seen": liveness.store().seen_all(),
    }
