from django.core.validators import MinValueValidator, RegexValidator
from django.db import models

from nodes.models import Fabric, Gpu, Node

from .choices import DrainStatus, Engine, MemberState, ReplicaStatus, RolloutStatus, RoutingPolicy

MODEL_NAME = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$",
    "a model name is 1-128 letters, digits, '.', '_', ':' or '-', starting with a letter or digit "
    "(no '/': it is part of the API's URLs; put the weights' path in 'model')",
)


class CatalogEntry(models.Model):
    """A model in the catalog: what to serve, in which shape, how many times.
    (The operator API and the CLI call it a model.)"""

    name = models.CharField(max_length=128, unique=True, validators=[MODEL_NAME])
    engine = models.CharField(max_length=16, choices=Engine.choices)
    weights = models.CharField(max_length=1024, help_text="model path or id given to the engine")
    nodes = models.PositiveSmallIntegerField(default=1, validators=[MinValueValidator(1)])
    gpus_per_node = models.PositiveSmallIntegerField(default=1, validators=[MinValueValidator(1)])
    replicas = models.PositiveIntegerField(default=1)
    args = models.JSONField(default=list, blank=True)
    env = models.JSONField(default=dict, blank=True)
    # How the gateway spreads requests over the ready replicas (docs/gateway.md#routing-policies).
    routing = models.CharField(max_length=32, choices=RoutingPolicy.choices, default=RoutingPolicy.CACHE_AWARE)
    # Why the shape can never fit the cluster as it is (empty when it can).
    never_fits_reason = models.TextField(blank=True)
    # Pruned from the catalog: its replicas stop, then the entry goes.
    removing = models.BooleanField(default=False)
    # The autoscaling policy (replicas.autoscaling.policy), clean with its
    # defaults; null: the replica count is fixed (set by hand).
    autoscale = models.JSONField(null=True, blank=True, default=None)
    # When the autoscaler last changed ``replicas`` (its cooldown runs from here).
    autoscaled_at = models.DateTimeField(null=True, blank=True)
    # How a change of the launch (replicas.revisions) reaches running replicas
    # (replicas.rollout): replacements at once, and replicas down at once when
    # there is no room for a replacement first (0: wait for room).
    max_surge = models.PositiveSmallIntegerField(default=1, validators=[MinValueValidator(1)])
    max_unavailable = models.PositiveSmallIntegerField(default=1)
    # The number of the current ModelRevision (0: none recorded yet).
    revision = models.PositiveIntegerField(default=0)
    # Where the weights come from (replicas.weights: hf, http, path, none; {}:
    # not managed, every node is taken to hold them) and what that resolved to
    # when the catalog was applied: files, sizes, sha256 (replicas.weights).
    source = models.JSONField(default=dict, blank=True)
    manifest = models.JSONField(default=dict, blank=True)
    # Nodes per fabric that keep the weights staged beyond those serving them.
    spares = models.PositiveSmallIntegerField(default=0)
    # The gateway's timeouts for this model (gateway/timeouts.py): connect, ttft, idle, total in
    # seconds; null or absent: the settings' defaults.
    timeouts = models.JSONField(null=True, blank=True, default=None)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "catalog entry"
        verbose_name_plural = "catalog entries"
        # Admins only (accounts.roles): entries whose engines run code that
        # ships with the weights (replicas.engines.policy.ADMIN_FLAGS).
        permissions = [("trust_engine_code", "Can let engines run code shipped with model weights")]
        constraints = [
            models.CheckConstraint(condition=models.Q(engine__in=Engine.values), name="%(app_label)s_%(class)s_engine_valid"),
            models.CheckConstraint(condition=models.Q(routing__in=RoutingPolicy.values),
                                   name="%(app_label)s_%(class)s_routing_valid"),
            models.CheckConstraint(condition=models.Q(nodes__gte=1), name="%(app_label)s_%(class)s_nodes_positive"),
            models.CheckConstraint(condition=models.Q(gpus_per_node__gte=1), name="%(app_label)s_%(class)s_gpus_positive"),
        ]

    def __str__(self) -> str:
        return self.name


class ModelRevision(models.Model):
    """What a catalog entry launched as, once: the launch-relevant fields
    (replicas.revisions.LAUNCH_FIELDS), their digest and a number that only
    grows per model. Each replica records the revision it was made from."""

    model = models.ForeignKey(CatalogEntry, on_delete=models.CASCADE, related_name="revisions")
    number = models.PositiveIntegerField()
    digest = models.CharField(max_length=64)
    spec = models.JSONField(default=dict)
    # What its weights source resolved to when it was recorded (the entry's
    # manifest then: files, sizes, sha256; {}: not managed). Its replicas
    # fetch and run these weights, whatever the entry says later.
    manifest = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["model", "number"], name="%(app_label)s_%(class)s_unique_number"),
        ]

    def __str__(self) -> str:
        return f"{self.model.name} revision {self.number}"


class Replica(models.Model):
    model = models.ForeignKey(CatalogEntry, on_delete=models.CASCADE, related_name="replica_set")
    # The revision of the model it launches as (None: made before revisions
    # were recorded, or by a test; it then launches as the entry is now).
    # RESTRICT: a revision a replica runs stays, unless the model (and so the replica) goes.
    revision = models.ForeignKey(ModelRevision, on_delete=models.RESTRICT, null=True, blank=True,
                                 related_name="replicas")
    status = models.CharField(max_length=16, choices=ReplicaStatus.choices, default=ReplicaStatus.PENDING)
    status_changed_at = models.DateTimeField()
    status_reason = models.TextField(blank=True)
    pending_reason = models.TextField(blank=True)
    fabric = models.ForeignKey(Fabric, on_delete=models.PROTECT, null=True, blank=True, related_name="replicas")
    # Set by a drain: the model gets a replacement, and this one stops once it is ready.
    draining = models.BooleanField(default=False)
    # Set with draining by a rollout: its replacement runs the new revision.
    rolling = models.BooleanField(default=False)
    # Why it failed, kept once it has stopped (its status_reason moves on).
    failed_reason = models.TextField(blank=True)
    # A stopping replica keeps running until the gateways have no request in
    # flight on it (bounded by LLMGW_STOP_GRACE); then its members are stopped.
    quiesced = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    # While staging: {"bytes", "total", "rate", "eta", "nodes": {node: bytes}}
    # (replicas.weights_cache), what the agents last reported.
    staging = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["model__name", "id"]
        constraints = [
            models.CheckConstraint(condition=models.Q(status__in=ReplicaStatus.values), name="%(app_label)s_%(class)s_status_valid"),
        ]
        indexes = [models.Index(fields=["status"], name="replicas_replica_status_idx")]

    def __str__(self) -> str:
        return f"{self.model.name}#{self.pk}"


class Member(models.Model):
    """One node's part of a replica; rank 0 is the leader."""

    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="members")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="members")
    rank = models.PositiveSmallIntegerField()
    gpus = models.JSONField(default=list)
    ports = models.JSONField(default=dict)
    argv = models.JSONField(default=list)
    env = models.JSONField(default=dict)
    serves_http = models.BooleanField(default=False)
    health_url = models.CharField(max_length=255, blank=True)
    state = models.CharField(max_length=16, choices=MemberState.choices, default=MemberState.PENDING)
    pid = models.IntegerField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    healthy = models.BooleanField(default=False)
    log_tail = models.JSONField(default=list, blank=True)
    # Times its agent restarted an engine that failed at start (crash-loop backoff).
    restarts = models.PositiveIntegerField(default=0)
    reported_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["replica", "rank"]
        constraints = [
            models.UniqueConstraint(fields=["replica", "rank"], name="%(app_label)s_%(class)s_unique_rank"),
            models.UniqueConstraint(fields=["replica", "node"], name="%(app_label)s_%(class)s_one_per_node"),
        ]

    def __str__(self) -> str:
        return f"{self.replica}/rank{self.rank}@{self.node.name}"

    @property
    def member_id(self) -> str:
        return f"m{self.pk}"


class GpuAllocation(models.Model):
    """A GPU given to a member. The unique GPU makes double allocation
    impossible, whatever two schedulers race to do."""

    gpu = models.OneToOneField(Gpu, on_delete=models.PROTECT, related_name="allocation")
    member = models.ForeignKey(Member, on_delete=models.CASCADE, related_name="gpu_allocations")
    # The GPU's node, for queries by node. No database constraint of its own:
    # the GPU's (and the member's) already keep the node from going while the
    # row exists, and each constraint is a check per row at every placement's
    # commit (bench/scheduler.py).
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="gpu_allocations", db_constraint=False)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["gpu"], name="%(app_label)s_%(class)s_unique_gpu")]


class PortAllocation(models.Model):
    # The member's node (the unique port is per node); no database constraint
    # of its own, as GpuAllocation.node: the member's keeps the node.
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="port_allocations", db_constraint=False)
    port = models.PositiveIntegerField()
    member = models.ForeignKey(Member, on_delete=models.CASCADE, related_name="port_allocations")
    purpose = models.CharField(max_length=32)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "port"], name="%(app_label)s_%(class)s_unique_port")]


class Drain(models.Model):
    """A node being emptied, one replica at a time; a row so a person can
    watch it and a restarted worker can carry it on."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="drains")
    status = models.CharField(max_length=16, choices=DrainStatus.choices, default=DrainStatus.RUNNING)
    status_changed_at = models.DateTimeField(auto_now_add=True)
    current = models.ForeignKey(Replica, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    moved = models.PositiveIntegerField(default=0)
    remaining = models.PositiveIntegerField(default=0)
    log = models.JSONField(default=list, blank=True)
    # Per replica of the node: {"<replica id>": {"model", "outcome", "reason"}}
    # (outcomes in choices.DrainOutcome), so a person sees each one's state.
    replicas = models.JSONField(default=dict, blank=True)
    started_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["node"], condition=models.Q(status__in=["running", "blocked"]),
                name="%(app_label)s_%(class)s_one_active_per_node",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.pk} of {self.node.name}"


class Rollout(models.Model):
    """A model's replicas moving from one revision to another, ``max_surge``
    at a time, each replacement ready before its original stops; a row so a
    person can watch it, pause, resume or undo it."""

    model = models.ForeignKey(CatalogEntry, on_delete=models.CASCADE, related_name="rollouts")
    from_revision = models.PositiveIntegerField()
    to_revision = models.PositiveIntegerField()
    status = models.CharField(max_length=16, choices=RolloutStatus.choices, default=RolloutStatus.RUNNING)
    status_changed_at = models.DateTimeField(auto_now_add=True)
    status_reason = models.TextField(blank=True)
    # What it waits for now, in words (rewritten at every step).
    waiting_for = models.TextField(blank=True)
    failures = models.PositiveIntegerField(default=0)
    # Replicas of the new revision that failed before ever being ready count
    # from here (reset when a failed rollout is resumed).
    counting_since = models.DateTimeField(auto_now_add=True)
    updated = models.PositiveIntegerField(default=0)
    wanted = models.PositiveIntegerField(default=0)
    log = models.JSONField(default=list, blank=True)
    # New weights staged before the first replacement (replicas.rollout_weights):
    # the key, the nodes and each one's progress as its agent reports it.
    staging = models.JSONField(default=dict, blank=True)
    actor = models.CharField(max_length=150, blank=True)
    started_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=models.Q(status__in=RolloutStatus.values),
                                   name="%(app_label)s_%(class)s_status_valid"),
            models.UniqueConstraint(
                fields=["model"], condition=models.Q(status__in=["running", "paused", "failed"]),
                name="%(app_label)s_%(class)s_one_open_per_model",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.model.name} revision {self.from_revision} -> {self.to_revision}"


class CachedWeights(models.Model):
    """What a node's agent reported holding in its weights cache: one model at
    one revision, complete (verified) or bytes so far. Written when a report
    changes, not per heartbeat (replicas.weights_cache)."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="cached_weights")
    model = models.CharField(max_length=128)
    revision = models.CharField(max_length=128)
    bytes = models.BigIntegerField(default=0)
    total = models.BigIntegerField(default=0)
    complete = models.BooleanField(default=False)
    # While it is fetched: bytes per second, and why it cannot be ('' when nothing stops it).
    rate = models.FloatField(default=0.0)
    error = models.TextField(blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["node", "model", "revision"]
        constraints = [
            models.UniqueConstraint(fields=["node", "model", "revision"], name="%(app_label)s_%(class)s_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.model}@{self.revision[:12]} on {self.node_id}"


class NodeCache(models.Model):
    """A node's weights cache as its agent last reported it (free space, budget)."""

    node = models.OneToOneField(Node, on_delete=models.CASCADE, related_name="weights_cache")
    free_bytes = models.BigIntegerField(default=0)
    budget_bytes = models.BigIntegerField(default=0)
    used_bytes = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)


class StagedWeights(models.Model):
    """A node asked to hold a model's weights with no replica of it there: a
    spare of its fabric (``CatalogEntry.spares``) or staged by hand (``ctl
    models stage``). Its agent keeps them fetched; they are not evicted while
    this row stands."""

    class Why(models.TextChoices):
        SPARE = "spare"
        MANUAL = "manual"
        ROLLOUT = "rollout"  # a rollout's new weights, before its replacements (replicas.rollout_weights)

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="staged_weights")
    model = models.ForeignKey(CatalogEntry, on_delete=models.CASCADE, related_name="staged_on")
    why = models.CharField(max_length=16, choices=Why.choices)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model", "node"]
        constraints = [
            models.UniqueConstraint(fields=["node", "model"], name="%(app_label)s_%(class)s_unique"),
        ]
