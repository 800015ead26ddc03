from rest_framework import serializers

from core.strict import StrictInput

from ..choices import Priority
from ..models import ApiKey


class ApiKeySerializer(serializers.ModelSerializer):
    models = serializers.ListField(source="allowed_models", child=serializers.CharField(), read_only=True,
                                   help_text="models this key may use; empty: every model")
    revoked = serializers.BooleanField(read_only=True)

    class Meta:
        model = ApiKey
        fields = ["name", "prefix", "models", "created_at", "revoked", "revoked_at", "requests", "prompt_tokens",
                  "completion_tokens", "last_used_at", "rpm", "tpm", "max_concurrent", "daily_tokens",
                  "monthly_tokens", "expires_at", "priority"]
        read_only_fields = fields


class ApiKeySettingsSerializer(StrictInput, serializers.Serializer):
    """A key's limits (null: none), expiry (null: never) and priority class."""

    rpm = serializers.IntegerField(min_value=1, required=False, allow_null=True, help_text="requests per minute")
    tpm = serializers.IntegerField(min_value=1, required=False, allow_null=True,
                                   help_text="tokens per minute (prompt + completion, as the engines report)")
    max_concurrent = serializers.IntegerField(min_value=1, required=False, allow_null=True,
                                              help_text="requests in flight at once")
    daily_tokens = serializers.IntegerField(min_value=1, required=False, allow_null=True,
                                            help_text="token budget per UTC day")
    monthly_tokens = serializers.IntegerField(min_value=1, required=False, allow_null=True,
                                              help_text="token budget per UTC month")
    expires_at = serializers.DateTimeField(required=False, allow_null=True,
                                           help_text="when the key stops working (ISO 8601 with a timezone)")
    priority = serializers.ChoiceField(choices=Priority.choices, required=False,
                                       help_text="class in the gateway's queue when the model is at capacity")


class ApiKeyCreateSerializer(ApiKeySettingsSerializer):
    """A new key: a limit, expiry or priority not sent takes the deployment's default (LLMGW_KEYS_DEFAULT_*,
    written on the key); null is no limit or no expiry whatever the default."""

    name = serializers.CharField(max_length=64)
    models = serializers.ListField(child=serializers.CharField(max_length=128), required=False, default=list)


class KeyUsageSerializer(serializers.Serializer):
    key = serializers.CharField(source="key__name")
    model = serializers.CharField()
    hour = serializers.DateTimeField()
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="the key itself: shown this once, never again")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]
        read_only_fields = fields
