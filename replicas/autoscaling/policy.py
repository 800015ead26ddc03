"""A model's autoscaling policy: what an operator writes under ``autoscale:``
in a catalog entry, its rules and its defaults.

One clear default signal: requests in flight and held at every gateway,
per ready replica (``metric: requests``, ``target: 4``). The engines' own
waiting queue (``engine_queue``, target 5 per replica, llm-d's saturation
mark) and KV-cache use (``kv_usage``, 0.8) are the alternatives.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rest_framework import serializers

# The most replicas a model may want (what every entry point accepts;
# replicas.validation takes it from here).
MAX_REPLICAS = 10000

METRICS = {
    # metric: (default target, what one unit of the target is)
    "requests": (4.0, "requests in flight or held at the gateways per ready replica"),
    "engine_queue": (5.0, "requests waiting in the engines' queues per ready replica"),
    "kv_usage": (0.8, "mean KV-cache use of the ready replicas (0-1)"),
}
DEFAULT_METRIC = "requests"


@dataclass(frozen=True)
class Policy:
    min: int = 1
    max: int = 4
    metric: str = DEFAULT_METRIC
    target: float = METRICS[DEFAULT_METRIC][0]
    # Seconds a signal must hold before scaling up, and before scaling down.
    up_after: float = 6.0
    down_after: float = 60.0
    # Seconds after any change before the next (waking a model at zero excepted).
    cooldown: float = 20.0
    # The most replicas one decision adds or removes.
    max_step: int = 4
    # Seconds without a request before a model with min 0 goes to zero.
    zero_after: float = 300.0
    # Requests a gateway process holds for a model at zero, and for how long.
    hold_max: int = 100
    hold_wait: float = 60.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PolicyFields(serializers.Serializer):
    """The policy's shape, field by field. Unknown keys are refused by name."""

    min = serializers.IntegerField(min_value=0, max_value=MAX_REPLICAS, default=Policy.min)
    max = serializers.IntegerField(min_value=1, max_value=MAX_REPLICAS, default=Policy.max)
    metric = serializers.ChoiceField(choices=sorted(METRICS), default=DEFAULT_METRIC)
    target = serializers.FloatField(min_value=0.01, max_value=100000, required=False)
    up_after = serializers.FloatField(min_value=0, max_value=3600, default=Policy.up_after)
    down_after = serializers.FloatField(min_value=0, max_value=86400, default=Policy.down_after)
    cooldown = serializers.FloatField(min_value=0, max_value=86400, default=Policy.cooldown)
    max_step = serializers.IntegerField(min_value=1, max_value=MAX_REPLICAS, default=Policy.max_step)
    zero_after = serializers.FloatField(min_value=10, max_value=7 * 86400, default=Policy.zero_after)
    hold_max = serializers.IntegerField(min_value=1, max_value=10000, default=Policy.hold_max)
    hold_wait = serializers.FloatField(min_value=1, max_value=600, default=Policy.hold_wait)

    def to_internal_value(self, data):
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError(
                    f"unknown key(s) {', '.join(unknown)}; a policy has {', '.join(self.fields)}")
        return super().to_internal_value(data)

    def validate(self, data):
        if data["min"] > data["max"]:
            raise serializers.ValidationError(f"min ({data['min']}) is above max ({data['max']}): "
                                              "give min <= max")
        if data["metric"] == "kv_usage" and data.get("target", 0) > 1:
            raise serializers.ValidationError("target: kv_usage is a fraction; give a target between 0.01 and 1")
        data.setdefault("target", METRICS[data["metric"]][0])
        return data


def policy_clean(value: Any) -> dict[str, Any]:
    """The policy with its defaults filled in; ValidationError names what is wrong."""
    fields = PolicyFields(data=value)
    fields.is_valid(raise_exception=True)
    return dict(fields.validated_data)


def policy_of(stored: dict[str, Any] | None) -> Policy | None:
    """The Policy of a stored (clean) value; None for a model without one."""
    if not stored:
        return None
    known = {k: v for k, v in stored.items() if k in Policy.__dataclass_fields__}
    return Policy(**known)


def policy_describe(policy: Policy) -> str:
    """One line for an operator."""
    unit = METRICS[policy.metric][1]
    zero = f", to zero after {policy.zero_after:.0f}s idle" if policy.min == 0 else ""
    return (f"{policy.min}-{policy.max} replicas, target {policy.target:g} {unit}; up after {policy.up_after:g}s, "
            f"down after {policy.down_after:g}s, cooldown {policy.cooldown:g}s, at most {policy.max_step} per step{zero}")
