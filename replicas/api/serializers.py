from rest_framework import serializers

from ..choices import ReplicaStatus
from ..envmask import env_masked
from ..models import CatalogEntry, Drain, Member, Replica
from ..validation import ENTRY_FIELDS, MAX_REPLICAS, CatalogEntryFields


class ModelWriteSerializer(CatalogEntryFields):
    """A catalog entry as an operator writes it: the rules of ``replicas.validation``."""


class MemberSerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    member = serializers.CharField(source="member_id", read_only=True)

    class Meta:
        model = Member
        fields = ["member", "node", "rank", "gpus", "ports", "state", "healthy", "pid", "exit_code",
                  "serves_http", "health_url", "argv", "env", "log_tail", "reported_at"]

    def to_representation(self, instance):
        data = super().to_representation(instance)
        data["env"] = env_masked(data.get("env"))  # secrets are write-only (replicas/envmask.py)
        return data


class ReplicaSerializer(serializers.ModelSerializer):
    model = serializers.SlugRelatedField(slug_field="name", read_only=True)
    # A single-node replica on a node with no fabric has none.
    fabric = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)
    members = MemberSerializer(many=True, read_only=True)

    class Meta:
        model = Replica
        fields = ["id", "model", "status", "status_changed_at", "status_reason", "pending_reason", "fabric",
                  "draining", "created_at", "ready_at", "members"]


class ModelSerializer(serializers.ModelSerializer):
    replica_counts = serializers.SerializerMethodField()
    pending_reasons = serializers.SerializerMethodField()

    weights_revision = serializers.SerializerMethodField(
        help_text="what the source resolved to when the catalog was applied (a commit, a manifest's revision); "
        "empty when the weights are not managed")
    weights_bytes = serializers.SerializerMethodField(help_text="the resolved manifest's total size")

    class Meta:
        model = CatalogEntry
        fields = [*ENTRY_FIELDS, "weights_revision", "weights_bytes",
                  "never_fits_reason", "removing", "replica_counts", "pending_reasons", "created_at", "updated_at"]

    def get_weights_revision(self, model) -> str:
        return (model.manifest or {}).get("revision", "")

    def get_weights_bytes(self, model) -> int:
        return int((model.manifest or {}).get("total_bytes", 0))

    def to_representation(self, instance):
        data = super().to_representation(instance)
        data["env"] = env_masked(data.get("env"))  # secrets are write-only (replicas/envmask.py)
        return data

    def get_replica_counts(self, model) -> dict[str, int]:
        counts = {s: 0 for s in ReplicaStatus.values if s != ReplicaStatus.STOPPED}
        for replica in model.replica_set.all():
            if replica.status in counts:
                counts[replica.status] += 1
        return counts

    def get_pending_reasons(self, model) -> list[str]:
        return sorted({r.pending_reason for r in model.replica_set.all() if r.status == "pending" and r.pending_reason})


class ScaleSerializer(serializers.Serializer):
    replicas = serializers.IntegerField(min_value=0, max_value=MAX_REPLICAS, error_messages={
        "min_value": "must be {min_value} or more", "max_value": "must be {max_value} or less",
        "invalid": "must be a whole number"})


class StageSerializer(serializers.Serializer):
    nodes = serializers.ListField(child=serializers.CharField(max_length=63), required=False, default=list,
                                  max_length=10000)
    fabric = serializers.CharField(max_length=64, required=False, default="", allow_blank=True)


class CatalogApplySerializer(serializers.Serializer):
    models = serializers.ListField(child=serializers.JSONField(), allow_empty=True)
    prune = serializers.BooleanField(default=False)


class DrainSerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", queryset=CatalogEntry.objects.none())
    # The replica being moved; none between steps and once the drain is over.
    current = serializers.PrimaryKeyRelatedField(read_only=True, allow_null=True)

    class Meta:
        model = Drain
        fields = ["id", "node", "status", "current", "moved", "remaining", "replicas", "log", "started_at", "finished_at"]
        read_only_fields = ["status", "current", "moved", "remaining", "replicas", "log", "started_at", "finished_at"]


class DrainCreateSerializer(serializers.Serializer):
    node = serializers.CharField()
