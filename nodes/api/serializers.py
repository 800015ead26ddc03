from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from ..models import Fabric, Gpu, Hca, Node
from ..selectors import age_seconds, node_gpu_conflicts


class GpuSerializer(serializers.ModelSerializer):
    class Meta:
        model = Gpu
        fields = ["index", "uuid", "name", "memory_mib", "pci_bus_id", "missing_since",
                  "quarantined_at", "quarantine_kind", "quarantine_reason", "last_xid"]


class GpuHealthSerializer(serializers.Serializer):
    """One GPU: its state (health, quarantine) and its latest readings (None: not read)."""

    node = serializers.CharField()
    index = serializers.IntegerField()
    uuid = serializers.CharField()
    name = serializers.CharField()
    health = serializers.ChoiceField(choices=["healthy", "degraded", "quarantined", "unknown"],
                                     help_text="unknown: no readings (telemetry off, or none within 2 minutes)")
    reason = serializers.CharField(allow_blank=True)
    quarantined_at = serializers.DateTimeField(allow_null=True)
    last_xid = serializers.IntegerField(allow_null=True)
    util = serializers.IntegerField(allow_null=True, help_text="percent")
    mem_used_mib = serializers.IntegerField(allow_null=True)
    mem_total_mib = serializers.IntegerField(allow_null=True)
    temp_c = serializers.IntegerField(allow_null=True)
    power_w = serializers.FloatField(allow_null=True)
    power_limit_w = serializers.FloatField(allow_null=True)
    ecc_corrected = serializers.IntegerField(allow_null=True)
    ecc_uncorrected = serializers.IntegerField(allow_null=True)
    read_at = serializers.FloatField(allow_null=True, help_text="when the readings arrived (Unix time)")


class HcaSerializer(serializers.ModelSerializer):
    fabric = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Hca
        fields = ["name", "fabric", "port", "state", "phys_state", "link_layer", "rate", "guid", "gid"]


class GpuConflictSerializer(serializers.Serializer):
    gpu = serializers.CharField(help_text="the GPU's uuid")
    holder = serializers.CharField(help_text="the node that holds it (and keeps it)")
    claimant = serializers.CharField(help_text="the node that also reports it")
    since = serializers.DateTimeField()


class NodeSerializer(serializers.ModelSerializer):
    fabrics = serializers.SlugRelatedField(slug_field="name", many=True, read_only=True)
    gpus = GpuSerializer(many=True, read_only=True)
    hcas = HcaSerializer(many=True, read_only=True)
    last_heartbeat_at = serializers.SerializerMethodField()
    heartbeat_age_seconds = serializers.SerializerMethodField()
    replicas = serializers.SerializerMethodField()
    gpu_conflicts = serializers.SerializerMethodField(
        help_text="GPUs this node reports that another node holds, and GPUs of this node another node reports"
    )

    class Meta:
        model = Node
        fields = [
            "name", "status", "status_changed_at", "status_reason", "fabrics", "gpus", "hcas",
            "mgmt_addr", "mgmt_interface", "agent_version", "discovery_errors", "engines",
            "last_heartbeat_at", "heartbeat_age_seconds", "replicas", "registered_at", "gpu_conflicts",
        ]
        read_only_fields = fields

    def _seen(self, node):
        return self.context.get("last_seen", {}).get(node.name, node.last_heartbeat_at)

    def get_last_heartbeat_at(self, node) -> str | None:
        seen = self._seen(node)
        return seen.isoformat() if seen else None

    def get_heartbeat_age_seconds(self, node) -> float | None:
        return age_seconds(self._seen(node))

    def get_replicas(self, node) -> int:
        return self.context.get("replica_counts", {}).get(node.name, 0)

    @extend_schema_field(GpuConflictSerializer(many=True))
    def get_gpu_conflicts(self, node) -> list:
        conflicts = self.context.get("gpu_conflicts")
        if conflicts is None:
            conflicts = node_gpu_conflicts()
        return GpuConflictSerializer(conflicts.get(node.name, []), many=True).data


class FabricSerializer(serializers.ModelSerializer):
    nodes = serializers.SlugRelatedField(slug_field="name", many=True, read_only=True)

    class Meta:
        model = Fabric
        fields = ["name", "nodes", "created_at"]
