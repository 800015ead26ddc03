"""What a heartbeat must be before anything about it is stored.

``heartbeat_clean`` is the one set of rules: the shape of ``agent.protocol``'s
heartbeat, checked with DRF's fields (the 400 answer names the field, as the
operator API does), and ``inventory_problems``, the rules across fields (an
HCA in two fabrics, a GPU reported twice).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from rest_framework import serializers

from agent.protocol import ENGINE_STATES, FABRIC_NAME_RE, HCA_NAME_RE, PROTOCOL_VERSION, mgmt_addr_problem


INT16_MAX = 2**15 - 1
INT32_MAX = 2**31 - 1


class HeartbeatInvalid(ValueError):
    def __init__(self, errors: dict[str, Any]) -> None:
        super().__init__("invalid heartbeat")
        self.errors = errors


def inventory_problems(data: dict[str, Any]) -> list[str]:
    """What contradicts itself in a heartbeat's inventory (its fields already checked)."""
    errors = []
    fabric_of: dict[str, str] = {}
    for fabric in data["fabrics"]:
        for hca in fabric["hcas"]:
            if hca in fabric_of and fabric_of[hca] != fabric["name"]:
                errors.append(
                    f"HCA {hca} is listed under two fabrics ({fabric_of[hca]} and {fabric['name']}); "
                    "an adapter belongs to one fabric. Fix 'fabrics' in the agent's configuration"
                )
            fabric_of[hca] = fabric["name"]
    names = [f["name"] for f in data["fabrics"]]
    if len(names) != len(set(names)):
        errors.append("a fabric is listed twice in 'fabrics'; list each fabric once with all its HCAs")
    seen_hcas = set()
    for hca in data["hcas"]:
        if hca["name"] in seen_hcas:
            errors.append(f"HCA {hca['name']} is reported twice")
        seen_hcas.add(hca["name"])
        stated = fabric_of.get(hca["name"])
        if hca["fabric"] and stated and hca["fabric"] != stated:
            errors.append(
                f"HCA {hca['name']} is reported in fabric {hca['fabric']} but configured under {stated}"
            )
        if hca["fabric"] and hca["fabric"] not in names:
            errors.append(f"HCA {hca['name']} names fabric {hca['fabric']}, which is not in 'fabrics'")
    indices = [g["index"] for g in data["gpus"]]
    uuids = [g["uuid"] for g in data["gpus"]]
    if len(indices) != len(set(indices)):
        dupes = sorted({i for i in indices if indices.count(i) > 1})
        errors.append(f"GPU index reported more than once: {dupes}")
    if len(uuids) != len(set(uuids)):
        dupes = sorted({u for u in uuids if uuids.count(u) > 1})
        errors.append(f"GPU uuid reported more than once: {dupes}")
    return errors


def mgmt_addr_check(addr: str) -> str:
    """Why a node may not have this management address ('' when it may), as
    this deployment's settings say (agent.protocol.mgmt_addr_problem). Blank
    is allowed: a node without one serves nothing."""
    if addr == "":
        return ""
    return mgmt_addr_problem(addr, hostnames=settings.LLMGW_NODE_HOSTNAMES,
                             loopback=settings.LLMGW_ALLOW_LOOPBACK_NODES)


def heartbeat_clean(payload: dict[str, Any]) -> dict[str, Any]:
    """The heartbeat's values, with defaults; HeartbeatInvalid names what is wrong."""
    schema = _Heartbeat(data=payload)
    if not schema.is_valid():
        raise HeartbeatInvalid(schema.errors)
    return schema.validated_data


# --- the shape, field by field ---------------------------------------------------------


class _Gpu(serializers.Serializer):
    index = serializers.IntegerField(min_value=0, max_value=1023)
    uuid = serializers.CharField(max_length=64)
    name = serializers.CharField(max_length=128)
    # Stored in a PositiveIntegerField: refuse what the database would, as a 400.
    memory_mib = serializers.IntegerField(min_value=0, max_value=INT32_MAX)
    pci_bus_id = serializers.CharField(max_length=32)


class _Hca(serializers.Serializer):
    name = serializers.RegexField(HCA_NAME_RE.pattern)
    fabric = serializers.CharField(max_length=64, allow_null=True, required=False, default=None)
    port = serializers.IntegerField(min_value=1, max_value=255, default=1)
    state = serializers.CharField(max_length=32, allow_blank=True, default="")
    phys_state = serializers.CharField(max_length=32, allow_blank=True, default="")
    link_layer = serializers.CharField(max_length=32, allow_blank=True, default="")
    rate = serializers.CharField(max_length=64, allow_blank=True, default="")
    guid = serializers.CharField(max_length=64, allow_blank=True, default="")
    gid = serializers.CharField(max_length=64, allow_blank=True, default="")


class _FabricMembership(serializers.Serializer):
    name = serializers.RegexField(FABRIC_NAME_RE.pattern)
    hcas = serializers.ListField(child=serializers.CharField(max_length=64), allow_empty=True)


class _EngineState(serializers.Serializer):
    member = serializers.CharField(max_length=64)
    replica = serializers.CharField(max_length=64)
    # The bounds of the columns they are stored in (replicas.Member): refuse
    # what the database would, as a 400 naming the field.
    rank = serializers.IntegerField(min_value=0, max_value=INT16_MAX)
    state = serializers.ChoiceField(choices=ENGINE_STATES)
    pid = serializers.IntegerField(allow_null=True, required=False, default=None, min_value=0, max_value=INT32_MAX)
    exit_code = serializers.IntegerField(
        allow_null=True, required=False, default=None, min_value=-INT32_MAX - 1, max_value=INT32_MAX
    )
    healthy = serializers.BooleanField(default=False)
    log_tail = serializers.ListField(child=serializers.CharField(allow_blank=True), default=list, max_length=2000)


class _Heartbeat(serializers.Serializer):
    protocol = serializers.IntegerField(default=PROTOCOL_VERSION)
    agent_version = serializers.CharField(max_length=64)
    mgmt_addr = serializers.CharField(max_length=255, allow_blank=True)
    mgmt_interface = serializers.CharField(max_length=64, allow_blank=True)
    fabrics = _FabricMembership(many=True, default=list)
    gpus = _Gpu(many=True, default=list)
    hcas = _Hca(many=True, default=list)
    discovery_errors = serializers.ListField(child=serializers.CharField(), default=list, max_length=100)
    engines = _EngineState(many=True, default=list)
    desired_version = serializers.IntegerField(min_value=0, default=0)

    def validate_mgmt_addr(self, value: str) -> str:
        problem = mgmt_addr_check(value)
        if problem:
            raise serializers.ValidationError(problem)
        return value

    def validate(self, data):
        errors = inventory_problems(data)
        if errors:
            raise serializers.ValidationError({"inventory": errors})
        return data
