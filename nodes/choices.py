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


class EventKind(models.TextChoices):
    NODE_REGISTERED = "node.registered"
    NODE_STATUS = "node.status"
    NODE_INVENTORY = "node.inventory"
    GPU_CONFLICT = "gpu.conflict"
    GPU_MISSING = "gpu.missing"
    CONTROL_PLANE = "control_plane"
    MODEL = "model"
    REPLICA_STATUS = "replica.status"
    REPLICA_PENDING = "replica.pending"
    DRAIN = "drain"
    PROVISIONING = "provisioning"
    ACCOUNT = "account"  # users, roles, superuser grants, operator tokens


class EventSeverity(models.TextChoices):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
