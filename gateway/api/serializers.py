from rest_framework import serializers

from core.strict import StrictInput

from ..models import ApiKey


class ApiKeySerializer(serializers.ModelSerializer):
    models = serializers.ListField(source="allowed_models", child=serializers.CharField(), read_only=True,
                                   help_text="models this key may use; empty: every model")
    revoked = serializers.BooleanField(read_only=True)

    class Meta:
        model = ApiKey
        fields = ["name", "prefix", "models", "created_at", "revoked", "revoked_at", "requests", "prompt_tokens",
                  "completion_tokens", "last_used_at"]
        read_only_fields = fields


class ApiKeyCreateSerializer(StrictInput, serializers.Serializer):
    name = serializers.CharField(max_length=64)
    models = serializers.ListField(child=serializers.CharField(max_length=128), required=False, default=list)


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="the key itself: shown this once, never again")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]
        read_only_fields = fields
