from rest_framework import serializers

from ..choices import Engine, ReplicaStatus
from ..models import MODEL_NAME, Drain, Member, Model, Replica


class ModelWriteSerializer(serializers.ModelSerializer):
    """A catalog entry as an operator writes it."""

    args = serializers.ListField(child=serializers.CharField(), required=False, default=list)
    env = serializers.DictField(child=serializers.CharField(allow_blank=True), required=False, default=dict)
    engine = serializers.ChoiceField(choices=Engine.choices)
    nodes = serializers.IntegerField(min_value=1, max_value=64, default=1)
    gpus_per_node = serializers.IntegerField(min_value=1, max_value=64, default=1)
    replicas = serializers.IntegerField(min_value=0, max_value=10000, default=1)

    class Meta:
        model = Model
        fields = ["name", "engine", "weights", "nodes", "gpus_per_node", "replicas", "args", "env"]
        # Not unique here: applying an existing name updates it.
        extra_kwargs = {"name": {"validators": [MODEL_NAME]}}

    def validate(self, data):
        from ..engines import EngineArgsError, check_env, check_entry

        try:
            check_env(data["engine"], data.get("env", {}))
        except EngineArgsError as exc:
            raise serializers.ValidationError({"env": [str(exc)]}) from exc
        try:
            check_entry(engine=data["engine"], name=data["name"], args=data.get("args", []), env={},
                        nodes=data.get("nodes", 1), gpus_per_node=data.get("gpus_per_node", 1))
        except EngineArgsError as exc:
            raise serializers.ValidationError({"args": [str(exc)]}) from exc
        return data


class MemberSerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    member = serializers.CharField(source="member_id", read_only=True)

    class Meta:
        model = Member
        fields = ["member", "node", "rank", "gpus", "ports", "state", "healthy", "pid", "exit_code",
                  "serves_http", "health_url", "argv", "env", "log_tail", "reported_at"]


class ReplicaSerializer(serializers.ModelSerializer):
    model = serializers.SlugRelatedField(slug_field="name", read_only=True)
    fabric = serializers.SlugRelatedField(slug_field="name", read_only=True)
    members = MemberSerializer(many=True, read_only=True)

    class Meta:
        model = Replica
        fields = ["id", "model", "status", "status_changed_at", "status_reason", "pending_reason", "fabric",
                  "draining", "created_at", "ready_at", "members"]


class ModelSerializer(serializers.ModelSerializer):
    replica_counts = serializers.SerializerMethodField()
    pending_reasons = serializers.SerializerMethodField()

    class Meta:
        model = Model
        fields = ["name", "engine", "weights", "nodes", "gpus_per_node", "replicas", "args", "env",
                  "never_fits_reason", "removing", "replica_counts", "pending_reasons", "created_at", "updated_at"]

    def get_replica_counts(self, model) -> dict[str, int]:
        counts = {s: 0 for s in ReplicaStatus.values if s != ReplicaStatus.STOPPED}
        for replica in model.replica_set.all():
            if replica.status in counts:
                counts[replica.status] += 1
        return counts

    def get_pending_reasons(self, model) -> list[str]:
        return sorted({r.pending_reason for r in model.replica_set.all() if r.status == "pending" and r.pending_reason})


class ScaleSerializer(serializers.Serializer):
    replicas = serializers.IntegerField(min_value=0, max_value=10000)


class CatalogApplySerializer(serializers.Serializer):
    models = serializers.ListField(child=serializers.JSONField(), allow_empty=True)
    prune = serializers.BooleanField(default=False)


class DrainSerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", queryset=Model.objects.none())
    current = serializers.PrimaryKeyRelatedField(read_only=True)

    class Meta:
        model = Drain
        fields = ["id", "node", "status", "current", "moved", "remaining", "log", "started_at", "finished_at"]
        read_only_fields = ["status", "current", "moved", "remaining", "log", "started_at", "finished_at"]


class DrainCreateSerializer(serializers.Serializer):
    node = serializers.CharField()
