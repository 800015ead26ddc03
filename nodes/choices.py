from django.db import models


class NodeStatus(models.TextChoices):
    REGISTERED = "registered"
    READY = "ready"
    CORDONED = "cordoned"
    DRAINING = "draining"
    DRAINED = "drained"
    LOST = "lost"


# Allowed transitions, as data (MAAS node_status.py). Every status change goes
# through nodes.services.node_transition, which checks this table.
NODE_TRANSITIONS: dict[str, set[str]] = {
    NodeStatus.REGISTERED: {NodeStatus.READY, NodeStatus.CORDONED, NodeStatus.LOST},
    NodeStatus.READY: {NodeStatus.CORDONED, NodeStatus.DRAINING, NodeStatus.LOST},
    NodeStatus.CORDONED: {NodeStatus.READY, NodeStatus.DRAINING, NodeStatus.LOST},
    # A drain cancelled leaves the node cordoned; uncordoning ends it and
    # puts the node back in service.
    NodeStatus.DRAINING: {NodeStatus.DRAINED, NodeStatus.READY, NodeStatus.CORDONED, NodeStatus.LOST},
    # Uncordoning a drained node puts it back in service.
    NodeStatus.DRAINED: {NodeStatus.READY, NodeStatus.LOST},
    # A lost node that heartbeats again comes back empty: its replicas are gone.
    NodeStatus.LOST: {NodeStatus.READY},
}

# Heard from within the grace period, as far as the control plane knows.
LIVE = frozenset({NodeStatus.REGISTERED, NodeStatus.READY, NodeStatus.CORDONED, NodeStatus.DRAINING, NodeStatus.DRAINED})
# Candidates for new work.
SCHEDULABLE = frozenset({NodeStatus.READY})


class NodeEventKind(models.TextChoices):
    """The kinds of Event nodes records (registered with core in NodesConfig.ready)."""

    NODE_REGISTERED = "node.registered"
    NODE_STATUS = "node.status"
    NODE_INVENTORY = "node.inventory"
    GPU_CONFLICT = "gpu.conflict"
    GPU_MISSING = "gpu.missing"
    GPU_QUARANTINED = "gpu.quarantined"
    GPU_CLEARED = "gpu.cleared"
    GPU_XID = "gpu.xid"  # an application Xid: recorded, quarantines nothing


class GpuHealth(models.TextChoices):
    HEALTHY = "healthy"
    DEGRADED = "degraded"  # usable and used, shown: corrected-error storms, thermal throttling, heat
    QUARANTINED = "quarantined"  # never placed on until cleared


class GpuFault(models.TextChoices):
    """Why a GPU was quarantined."""

    XID = "xid"
    ECC = "ecc"
    LOST = "lost"
    NVML = "nvml"
