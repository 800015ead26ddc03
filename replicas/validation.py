"""What a catalog entry must be before it is saved.

``catalog_entry_clean`` is the one set of rules, for ``llmgw ctl apply``, the
REST API and the admin alike: the entry's shape, checked with DRF's fields
(so that errors name the field, as the operator API does), and
``engine_problems``, what the engine adapters refuse (abbreviated or managed
flags, parallel sizes that do not match the replica's GPUs).
"""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from core.strict import StrictInput

from .choices import Engine, RoutingPolicy
from .engines import EngineArgsError, adapter_for, check_entry, check_env
from .engines.policy import refusal_message
from .autoscaling.policy import MAX_REPLICAS, PolicyFields
from .models import MODEL_NAME, CatalogEntry
from .weights import source_problems, source_unknown_keys

# What an operator writes; the other fields are the control plane's.
ENTRY_FIELDS = ["name", "engine", "weights", "nodes", "gpus_per_node", "replicas", "args", "env", "routing", "autoscale",
                "max_surge", "max_unavailable", "source", "spares", "timeouts"]


class CatalogEntryInvalid(ValueError):
    def __init__(self, errors: dict[str, Any]) -> None:
        super().__init__("invalid catalog entry")
        self.errors = errors  # field -> messages


def engine_problems(entry: dict[str, Any]) -> dict[str, list[str]]:
    """What the entry's engine adapter refuses, by field (empty when nothing)."""
    try:
        check_env(entry["engine"], entry.get("env", {}))
    except EngineArgsError as exc:
        return {"env": [str(exc)]}
    try:
        check_entry(engine=entry["engine"], name=entry["name"], args=entry.get("args", []), env={},
                    nodes=entry.get("nodes", 1), gpus_per_node=entry.get("gpus_per_node", 1))
    except EngineArgsError as exc:
        return {"args": [str(exc)]}
    return {}


def admin_only_problems(entry: dict[str, Any]) -> list[str]:
    """What in a (valid) entry only an admin may set, as messages naming it."""
    try:
        return [refusal_message(r) for r in adapter_for(entry["engine"]).admin_flags(list(entry.get("args", [])))]
    except EngineArgsError:
        return []  # already refused by engine_problems


class TimeoutFields(serializers.Serializer):
    """A model's gateway timeouts in seconds (docs/gateway.md#timeouts-and-retries); absent or null: the
    default setting; 0: none."""

    connect = serializers.FloatField(min_value=0, max_value=3600, required=False, allow_null=True)
    ttft = serializers.FloatField(min_value=0, max_value=86400, required=False, allow_null=True)
    idle = serializers.FloatField(min_value=0, max_value=86400, required=False, allow_null=True)
    total = serializers.FloatField(min_value=0, max_value=7 * 86400, required=False, allow_null=True)

    def run_validation(self, data=serializers.empty):
        # The timeouts given; none given ({} or all null): the settings' (None). After
        # validation, not in to_internal_value: a serializer's value must not be None there.
        value = super().run_validation(data)
        return {k: v for k, v in value.items() if v is not None} or None if isinstance(value, dict) else value


class CatalogEntryFields(StrictInput, serializers.ModelSerializer):
    """The shape of a catalog entry, field by field, then ``engine_problems``.
    A key it does not declare is refused by name (``core.strict``), at any
    level of a nested field: a typo must not fall back to a default."""

    # catalog.yaml calls the weights 'model'; the API calls them 'weights'.
    strict_aliases = {"model": "weights"}

    args = serializers.ListField(child=serializers.CharField(), required=False, default=list)
    env = serializers.DictField(child=serializers.CharField(allow_blank=True), required=False, default=dict)
    engine = serializers.ChoiceField(choices=Engine.choices)
    nodes = serializers.IntegerField(min_value=1, max_value=64, default=1)
    gpus_per_node = serializers.IntegerField(min_value=1, max_value=64, default=1)
    replicas = serializers.IntegerField(min_value=0, max_value=MAX_REPLICAS, default=1)
    routing = serializers.ChoiceField(choices=RoutingPolicy.choices, default=RoutingPolicy.CACHE_AWARE)
    # null (or absent): a fixed replica count; a mapping: the autoscaling policy.
    autoscale = PolicyFields(required=False, allow_null=True, default=None)
    # A rollout's pace (replicas.rollout_plan): replacements at once; replicas
    # down at once when there is no room to start a replacement first.
    max_surge = serializers.IntegerField(min_value=1, max_value=1000, default=1)
    max_unavailable = serializers.IntegerField(min_value=0, max_value=1000, default=1)
    # Where the weights come from (replicas.weights); {} leaves them unmanaged.
    source = serializers.JSONField(required=False, default=dict)
    spares = serializers.IntegerField(min_value=0, max_value=64, default=0)
    timeouts = TimeoutFields(required=False, allow_null=True, default=None)

    class Meta:
        model = CatalogEntry
        fields = ENTRY_FIELDS
        # Not unique here: applying an existing name updates it.
        extra_kwargs = {"name": {"validators": [MODEL_NAME]}}

    def validate_source(self, value):
        # A JSONField, so core.strict does not walk it: its keys depend on its
        # kind. An unknown one is refused the same way, nested under source.
        unknown = source_unknown_keys(value)
        if unknown:
            raise serializers.ValidationError({key: [message] for key, message in unknown.items()})
        problems = source_problems(value)
        if problems:
            raise serializers.ValidationError(problems)
        return value or {}

    def validate(self, data):
        if data.get("spares") and not data.get("source"):
            raise serializers.ValidationError({"spares": ["spares keep weights staged: give the model a source"]})
        problems = engine_problems(data)
        if problems:
            raise serializers.ValidationError(problems)
        return data


def catalog_entry_clean(entry: Any) -> dict[str, Any]:
    """The entry's values, with defaults; CatalogEntryInvalid names what is wrong."""
    fields = CatalogEntryFields(data=entry)
    if not fields.is_valid():
        raise CatalogEntryInvalid(dict(fields.errors))
    return dict(fields.validated_data)
