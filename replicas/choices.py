from django.db import models


class Engine(models.TextChoices):
    VLLM = "vllm"
    SGLANG = "sglang"
    SIM = "sim"


class RoutingPolicy(models.TextChoices):
    """How the gateway picks one of a model's ready replicas (gateway.scoring)."""

    LEAST_OUTSTANDING = "least-outstanding"
    CACHE_AWARE = "cache-aware"
    SESSION = "session"


class ReplicaStatus(models.TextChoices):
    PENDING = "pending"
    SCHEDULED = "scheduled"
    # Placed where the weights are missing: its nodes fetch them
    # (replicas.weights_cache) before its engines start.
    STAGING = "staging"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


REPLICA_TRANSITIONS: dict[str, set[str]] = {
    ReplicaStatus.PENDING: {ReplicaStatus.SCHEDULED, ReplicaStatus.STOPPED},
    ReplicaStatus.SCHEDULED: {ReplicaStatus.STAGING, ReplicaStatus.STARTING, ReplicaStatus.FAILED, ReplicaStatus.STOPPING},
    ReplicaStatus.STAGING: {ReplicaStatus.STARTING, ReplicaStatus.FAILED, ReplicaStatus.STOPPING},
    ReplicaStatus.STARTING: {ReplicaStatus.READY, ReplicaStatus.FAILED, ReplicaStatus.STOPPING},
    ReplicaStatus.READY: {ReplicaStatus.STOPPING, ReplicaStatus.FAILED},
    ReplicaStatus.STOPPING: {ReplicaStatus.STOPPED},
    # A failed replica's members are reaped (stopped, GPUs freed); then it is stopped.
    ReplicaStatus.FAILED: {ReplicaStatus.STOPPED},
    ReplicaStatus.STOPPED: set(),
}

# Holding GPUs and running (or about to run) on nodes.
PLACED = frozenset({ReplicaStatus.SCHEDULED, ReplicaStatus.STAGING, ReplicaStatus.STARTING, ReplicaStatus.READY})
# Counted toward a model's desired replica count.
WANTED = frozenset({ReplicaStatus.PENDING, *PLACED})
TERMINAL = frozenset({ReplicaStatus.STOPPED})


class MemberState(models.TextChoices):
    PENDING = "pending"  # in the node's desired state, not reported yet
    STARTING = "starting"
    RUNNING = "running"
    BACKOFF = "backoff"  # its engine failed at start; its agent restarts it after a growing delay
    EXITED = "exited"
    GONE = "gone"  # no longer on the node: its GPUs and ports are free


class DrainStatus(models.TextChoices):
    RUNNING = "running"
    BLOCKED = "blocked"  # every replica left fits nowhere else; they keep running
    DONE = "done"
    CANCELLED = "cancelled"  # ended by an operator (cancel, uncordon, a new drain) or by the node leaving draining


DRAIN_TRANSITIONS: dict[str, set[str]] = {
    # Blocked and back: a replica that fits nowhere, then fits again. A drain
    # is done once its node holds nothing, blocked or not. An ended drain
    # (done or cancelled) never resumes: draining the node again is a new drain.
    DrainStatus.RUNNING: {DrainStatus.BLOCKED, DrainStatus.DONE, DrainStatus.CANCELLED},
    DrainStatus.BLOCKED: {DrainStatus.RUNNING, DrainStatus.DONE, DrainStatus.CANCELLED},
    DrainStatus.DONE: set(),
    DrainStatus.CANCELLED: set(),
}
# Still moving replicas: at most one per node (a constraint on Drain).
DRAIN_ACTIVE = frozenset({DrainStatus.RUNNING, DrainStatus.BLOCKED})
DRAIN_ENDED = frozenset({DrainStatus.DONE, DrainStatus.CANCELLED})


class DrainOutcome(models.TextChoices):
    """Where each replica of a draining node stands (Drain.replicas)."""

    QUEUED = "queued"  # not tried yet: one replica moves at a time
    MOVING = "moving"  # its replacement is scheduled or starting
    WAITING = "waiting"  # its replacement fits nowhere yet; it keeps running here
    MOVED = "moved"  # its replacement is ready; it was stopped
    GONE = "gone"  # it left the node otherwise (failed, scaled down)
    RELEASED = "released"  # the drain ended before it moved; it keeps running here


class RolloutStatus(models.TextChoices):
    RUNNING = "running"
    PAUSED = "paused"  # by an operator: no new replacement starts; those under way finish
    FAILED = "failed"  # the new revision's replicas kept failing; the old ones serve
    DONE = "done"
    SUPERSEDED = "superseded"  # another change of the model started a new rollout


ROLLOUT_TRANSITIONS: dict[str, set[str]] = {
    RolloutStatus.RUNNING: {RolloutStatus.PAUSED, RolloutStatus.FAILED, RolloutStatus.DONE, RolloutStatus.SUPERSEDED},
    RolloutStatus.PAUSED: {RolloutStatus.RUNNING, RolloutStatus.DONE, RolloutStatus.SUPERSEDED},
    # Resuming a failed rollout tries again with a fresh failure budget.
    RolloutStatus.FAILED: {RolloutStatus.RUNNING, RolloutStatus.SUPERSEDED},
    RolloutStatus.DONE: set(),
    RolloutStatus.SUPERSEDED: set(),
}
# Not over: at most one per model (a constraint on Rollout).
ROLLOUT_OPEN = frozenset({RolloutStatus.RUNNING, RolloutStatus.PAUSED, RolloutStatus.FAILED})


class ReplicaEventKind(models.TextChoices):
    """The kinds of Event replicas records (registered with core in ReplicasConfig.ready)."""

    MODEL = "model"
    REPLICA_STATUS = "replica.status"
    REPLICA_PENDING = "replica.pending"
    # Weights: resolved at apply, staging progress, staged by hand, evicted (replicas.weights*).
    WEIGHTS = "weights"
    DRAIN = "drain"
    AUTOSCALE = "autoscale"
    ROLLOUT = "rollout"
