from django.core.validators import MinValueValidator, RegexValidator
from django.db import models

from nodes.models import Fabric, Gpu, Node

from .choices import DrainStatus, Engine, MemberState, ReplicaStatus, RoutingPolicy

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
    routing = models.CharField(max_length=32, choices=RoutingPolicy.choices, default=RoutingPolicy.LEAST_OUTSTANDING)
    # Why the shape can never fit the cluster as it is (empty when it can).
    never_fits_reason = models.TextField(blank=True)
    # Pruned from the catalog: its replicas stop, then the entry goes.
    removing = models.BooleanField(default=False)
    # The autoscaling policy (replicas.autoscaling.policy), clean with its
    # defaults; null: the replica count is fixed (set by hand).
    autoscale = models.JSONField(null=True, blank=True, default=None)
    # When the autoscaler last changed ``replicas`` (its cooldown runs from here).
    autoscaled_at = models.DateTimeField(null=True, blank=True)
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


class Replica(models.Model):
    model = models.ForeignKey(CatalogEntry, on_delete=models.CASCADE, related_name="replica_set")
    status = models.CharField(max_length=16, choices=ReplicaStatus.choices, default=ReplicaStatus.PENDING)
    status_changed_at = models.DateTimeField()
    status_reason = models.TextField(blank=True)
    pending_reason = models.TextField(blank=True)
    fabric = models.ForeignKey(Fabric, on_delete=models.PROTECT, null=True, blank=True, related_name="replicas")
    # Set by a drain: the model gets a replacement, and this one stops once it is ready.
    draining = models.BooleanField(default=False)
    # A stopping replica keeps running until the gateways have no request in
    # flight on it (bounded by LLMGW_STOP_GRACE); then its members are stopped.
    quiesced = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    ready_at = models.DateTimeField(null=True, blank=True)

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
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="gpu_allocations")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["gpu"], name="%(app_label)s_%(class)s_unique_gpu")]


class PortAllocation(models.Model):
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="port_allocations")
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
