from rest_framework import serializers

from core.strict import StrictInput

from ..choices import ReplicaStatus
from ..envmask import env_masked
from ..models import CatalogEntry, Drain, Member, Replica, Rollout
from ..validation import ENTRY_FIELDS, MAX_REPLICAS, CatalogEntryFields


class ModelWriteSerializer(CatalogEntryFields):
    """A catalog entry as an operator writes it: the rules of ``replicas.validation``."""


class MemberSerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    member = serializers.CharField(source="member_id", read_only=True)

    class Meta:
        model = Member
        fields = ["member", "node", "rank", "gpus", "ports", "state", "healthy", "pid", "exit_code", "restarts",
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
    # The revision of its model it launched as (replicas.revisions); null for a replica made before revisions.
    revision = serializers.IntegerField(source="revision.number", read_only=True, allow_null=True, default=None)

    class Meta:
        model = Replica
        fields = ["id", "model", "revision", "status", "status_changed_at", "status_reason", "pending_reason",
                  "failed_reason", "fabric", "draining", "rolling", "created_at", "ready_at", "members"]


class ModelSerializer(serializers.ModelSerializer):
    replica_counts = serializers.SerializerMethodField()
    pending_reasons = serializers.SerializerMethodField()
    ready_current = serializers.SerializerMethodField()

    weights_revision = serializers.SerializerMethodField(
        help_text="what the source resolved to when the catalog was applied (a commit, a manifest's revision); "
        "empty when the weights are not managed")
    weights_bytes = serializers.SerializerMethodField(help_text="the resolved manifest's total size")

    class Meta:
        model = CatalogEntry
        fields = [*ENTRY_FIELDS, "revision", "ready_current", "weights_revision", "weights_bytes",
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

    def get_ready_current(self, model) -> int:
        """Ready replicas running the model's current revision."""
        digest = next((rev.digest for rev in model.revisions.all() if rev.number == model.revision), None)
        return sum(1 for r in model.replica_set.all()
                   if r.status == ReplicaStatus.READY and (r.revision is None or r.revision.digest == digest))

    def get_pending_reasons(self, model) -> list[str]:
        return sorted({r.pending_reason for r in model.replica_set.all() if r.status == "pending" and r.pending_reason})


_COUNT_ERRORS = {"min_value": "must be {min_value} or more", "max_value": "must be {max_value} or less",
                 "invalid": "must be a whole number"}


class RolloutSerializer(serializers.ModelSerializer):
    model = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Rollout
        fields = ["id", "model", "from_revision", "to_revision", "status", "status_reason", "waiting_for",
                  "updated", "wanted", "failures", "staging", "actor", "log", "started_at", "status_changed_at", "finished_at"]


class RolloutStatusSerializer(serializers.Serializer):
    """A model's revision and its latest rollout (none if it never had one)."""

    model = serializers.CharField()
    revision = serializers.IntegerField()
    wanted = serializers.IntegerField()
    ready = serializers.IntegerField(help_text="ready replicas, whatever their revision")
    ready_current = serializers.IntegerField(help_text="ready replicas on the current revision")
    max_surge = serializers.IntegerField()
    max_unavailable = serializers.IntegerField()
    max_failures = serializers.IntegerField(help_text="LLMGW_ROLLOUT_MAX_FAILURES")
    rollout = RolloutSerializer(allow_null=True)


class ScaleSerializer(StrictInput, serializers.Serializer):
    """A fixed model: ``replicas``. An autoscaled one: ``min`` and/or ``max``
    (its bounds); a count for an autoscaled model is refused (409) saying why."""

    replicas = serializers.IntegerField(min_value=0, max_value=MAX_REPLICAS, required=False,
                                        error_messages=_COUNT_ERRORS)
    min = serializers.IntegerField(min_value=0, max_value=MAX_REPLICAS, required=False, error_messages=_COUNT_ERRORS)
    max = serializers.IntegerField(min_value=1, max_value=MAX_REPLICAS, required=False, error_messages=_COUNT_ERRORS)

    def validate(self, data):
        bounds = "min" in data or "max" in data
        if "replicas" in data and bounds:
            raise serializers.ValidationError("give either replicas (a fixed model) or min/max (an autoscaled "
                                              "model's bounds), not both")
        if "replicas" not in data and not bounds:
            raise serializers.ValidationError("give replicas (a fixed model) or min/max (an autoscaled model)")
        return data


class StageSerializer(StrictInput, serializers.Serializer):
    nodes = serializers.ListField(child=serializers.CharField(max_length=63), required=False, default=list,
                                  max_length=10000)
    fabric = serializers.CharField(max_length=64, required=False, default="", allow_blank=True)


class CatalogApplySerializer(StrictInput, serializers.Serializer):
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


class DrainCreateSerializer(StrictInput, serializers.Serializer):
    node = serializers.CharField()
