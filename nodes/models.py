from django.db import models

from .choices import NodeStatus


class Fabric(models.Model):
    """A named InfiniBand fabric. Membership is stated by each node's agent."""

    name = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Node(models.Model):
    # The node id: also its hostname, VM name and certificate CN.
    name = models.CharField(max_length=63, unique=True)
    status = models.CharField(max_length=16, choices=NodeStatus.choices, default=NodeStatus.REGISTERED)
    status_changed_at = models.DateTimeField()
    status_reason = models.CharField(max_length=255, blank=True)
    fabrics = models.ManyToManyField(Fabric, related_name="nodes", blank=True)
    mgmt_addr = models.CharField(max_length=255, blank=True)
    mgmt_interface = models.CharField(max_length=64, blank=True)
    agent_version = models.CharField(max_length=64, blank=True)
    discovery_errors = models.JSONField(default=list, blank=True)
    engines = models.JSONField(default=list, blank=True, help_text="engine states of the last heartbeat")
    inventory_hash = models.CharField(max_length=64, blank=True)
    # Liveness lives in the liveness store (Redis in production); this copy is
    # written on inventory changes and by the sweep, for display and as the
    # fallback when the store has forgotten a node.
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # Bumped whenever what this node should run changes.
    desired_version = models.PositiveBigIntegerField(default=0)
    registered_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(status__in=NodeStatus.values),
                name="%(app_label)s_%(class)s_status_valid",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class GpuQuerySet(models.QuerySet):
    def in_service(self) -> "GpuQuerySet":
        """The GPUs work may be placed on: reported by their node and not
        quarantined. Every placement reads GPUs through this one filter."""
        return self.filter(missing_since=None, quarantined_at=None)


class Gpu(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveIntegerField()
    uuid = models.CharField(max_length=64, unique=True)
    name = models.CharField(max_length=128)
    memory_mib = models.PositiveIntegerField()
    pci_bus_id = models.CharField(max_length=32)
    # Set when the node's agent stopped reporting this GPU. The row stays: the
    # node keeps its claim on the uuid, and a replica holding it is failed
    # rather than the node's heartbeats refused. Cleared when it is reported again.
    missing_since = models.DateTimeField(null=True, blank=True)
    # Health (nodes.gpu_health): set when a critical Xid, an uncorrectable
    # ECC error, a fall from the bus or NVML failing took the GPU out of
    # service; cleared only by an operator (or the opt-in reset rule). The
    # readings themselves are telemetry, in Redis or in the bounded rows
    # below (nodes.telemetry).
    quarantined_at = models.DateTimeField(null=True, blank=True)
    quarantine_kind = models.CharField(max_length=16, blank=True)  # GpuFault
    quarantine_reason = models.CharField(max_length=255, blank=True)
    last_xid = models.PositiveIntegerField(null=True, blank=True)
    # Uncorrectable ECC errors already judged (those before a clear): only more quarantine again.
    ecc_uncorrected_baseline = models.BigIntegerField(default=0)

    objects = GpuQuerySet.as_manager()

    class Meta:
        ordering = ["node", "index"]
        verbose_name = "GPU"
        verbose_name_plural = "GPUs"
        constraints = [
            # Among the GPUs that are there: a missing one keeps its last index.
            models.UniqueConstraint(
                fields=["node", "index"], condition=models.Q(missing_since=None),
                name="%(app_label)s_%(class)s_unique_index",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.node.name}:gpu{self.index}"


class GpuReadings(models.Model):
    """A node's latest telemetry block, one row per node: the embedded
    default's copy of what Redis keeps in production (``nodes.telemetry_rows``).
    Keyed by the node's name, which is what a heartbeat carries."""

    node = models.OneToOneField(Node, to_field="name", primary_key=True, on_delete=models.CASCADE,
                                related_name="+")
    block = models.TextField()  # the block as JSON, as Redis holds it

    class Meta:
        verbose_name = "GPU readings"
        verbose_name_plural = "GPU readings"


class GpuSample(models.Model):
    """One history sample of a node's GPUs. The hour is a ring of slots per
    node: a new sample overwrites the one an hour older, so the rows stay
    bounded without a sweep."""

    node = models.ForeignKey(Node, to_field="name", on_delete=models.CASCADE, related_name="+")
    slot = models.PositiveIntegerField()
    at = models.FloatField()  # seconds since the epoch, as in the sample
    sample = models.TextField()  # [at, [[index, util, mem_used_mib, temp_c, power_w, health code], ...]] as JSON

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["node", "slot"], name="%(app_label)s_%(class)s_unique_slot"),
        ]


class GpuConflict(models.Model):
    """A node that reports a GPU another node already holds. The holder keeps
    it; the claim is recorded here (and as an Event) and shown on both nodes."""

    claimant = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpu_claims")
    gpu = models.ForeignKey(Gpu, on_delete=models.CASCADE, related_name="conflicts")
    since = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["claimant", "gpu"]
        constraints = [
            models.UniqueConstraint(fields=["claimant", "gpu"], name="%(app_label)s_%(class)s_unique_claim"),
        ]

    def __str__(self) -> str:
        return f"{self.claimant.name} claims {self.gpu.uuid}"


class Hca(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="hcas")
    name = models.CharField(max_length=64)
    fabric = models.ForeignKey(Fabric, on_delete=models.PROTECT, null=True, blank=True, related_name="hcas")
    port = models.PositiveSmallIntegerField(default=1)
    state = models.CharField(max_length=32, blank=True)
    phys_state = models.CharField(max_length=32, blank=True)
    link_layer = models.CharField(max_length=32, blank=True)
    rate = models.CharField(max_length=64, blank=True)
    guid = models.CharField(max_length=64, blank=True)
    gid = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["node", "name"]
        verbose_name = "HCA"
        verbose_name_plural = "HCAs"
        constraints = [
            models.UniqueConstraint(fields=["node", "name"], name="%(app_label)s_%(class)s_unique_name"),
        ]

    def __str__(self) -> str:
        return f"{self.node.name}:{self.name}"


class ControlPlaneClock(models.Model):
    """A single row: when the control plane could last hear its nodes.

    The lost-node sweep gives every node a fresh grace period from
    ``heard_since`` so that an outage of the control plane itself is never
    blamed on the nodes.
    """

    heard_since = models.DateTimeField(null=True, blank=True)
    last_sweep_at = models.DateTimeField(null=True, blank=True)
    deaf_since = models.DateTimeField(null=True, blank=True)
    # Written every second by each agent API process (embedded default only;
    # production keeps it in Redis).
    listener_alive_at = models.DateTimeField(null=True, blank=True)
    # Set while most nodes are silent at once and failovers are held.
    holding_since = models.DateTimeField(null=True, blank=True)
