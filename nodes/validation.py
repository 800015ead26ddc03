"""What a heartbeat must be before anything about it is stored.

``heartbeat_clean`` is the one set of rules. The heartbeat's shape (its
fields, their types, which are required, their defaults) is defined once, by
``agent.protocol.Heartbeat`` and the dataclasses it nests; the DRF
serializers that check it are built from those dataclasses (so the 400
answer names the field, as the operator API does). What the control plane
adds is here: ``LIMITS``, the bounds of what it stores (column sizes, the
protocol's name patterns), and ``inventory_problems``, the rules across
fields (an HCA in two fabrics, a GPU reported twice).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from django.conf import settings
from rest_framework import serializers

from agent.protocol import (
    ENGINE_STATES,
    FABRIC_NAME_RE,
    HCA_NAME_RE,
    TELEMETRY_SOURCES,
    EngineState,
    FabricMembership,
    GpuInfo,
    GpuReading,
    HcaInfo,
    Heartbeat,
    Telemetry,
    mgmt_addr_problem,
)


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
    schema = HeartbeatSerializer(data=payload)
    if not schema.is_valid():
        raise HeartbeatInvalid(schema.errors)
    return schema.validated_data


# --- the shape, from agent.protocol; the bounds, ours ---------------------------------

# "Dataclass.field" -> what the DRF field adds to the protocol's type: the
# bounds of the columns a value is stored in (refuse what the database would,
# as a 400 naming the field), the protocol's patterns and choices. For a
# list, "child" holds what its items add; a string may be blank only where it
# says so or its default is "".
LIMITS: dict[str, dict[str, Any]] = {
    "GpuInfo.index": {"min_value": 0, "max_value": 1023},
    "GpuInfo.uuid": {"max_length": 64},
    "GpuInfo.name": {"max_length": 128},
    "GpuInfo.memory_mib": {"min_value": 0, "max_value": INT32_MAX},  # a PositiveIntegerField
    "GpuInfo.pci_bus_id": {"max_length": 32},
    "HcaInfo.name": {"regex": HCA_NAME_RE.pattern},
    "HcaInfo.fabric": {"max_length": 64},
    "HcaInfo.port": {"min_value": 1, "max_value": 255},
    "HcaInfo.state": {"max_length": 32},
    "HcaInfo.phys_state": {"max_length": 32},
    "HcaInfo.link_layer": {"max_length": 32},
    "HcaInfo.rate": {"max_length": 64},
    "HcaInfo.guid": {"max_length": 64},
    "HcaInfo.gid": {"max_length": 64},
    "FabricMembership.name": {"regex": FABRIC_NAME_RE.pattern},
    "FabricMembership.hcas": {"allow_empty": True, "child": {"max_length": 64}},
    # The bounds of the columns they are stored in (replicas.Member).
    "EngineState.member": {"max_length": 64},
    "EngineState.replica": {"max_length": 64},
    "EngineState.rank": {"min_value": 0, "max_value": INT16_MAX},
    "EngineState.state": {"choices": ENGINE_STATES},
    "EngineState.pid": {"min_value": 0, "max_value": INT32_MAX},
    "EngineState.exit_code": {"min_value": -INT32_MAX - 1, "max_value": INT32_MAX},
    "EngineState.log_tail": {"max_length": 2000, "child": {"allow_blank": True}},
    "EngineState.restarts": {"min_value": 0, "max_value": INT32_MAX},
    "Heartbeat.agent_version": {"max_length": 64},
    "Heartbeat.mgmt_addr": {"max_length": 255, "allow_blank": True},
    "Heartbeat.mgmt_interface": {"max_length": 64, "allow_blank": True},
    "Heartbeat.discovery_errors": {"max_length": 100},
    "Heartbeat.desired_version": {"min_value": 0},
    # Telemetry is kept in Redis, not in columns: these bound what one block may hold.
    "GpuReading.index": {"min_value": 0, "max_value": 1023},
    "GpuReading.uuid": {"max_length": 64},
    "GpuReading.util": {"min_value": 0, "max_value": 100},
    "GpuReading.mem_util": {"min_value": 0, "max_value": 100},
    "GpuReading.mem_used_mib": {"min_value": 0, "max_value": INT32_MAX},
    "GpuReading.mem_total_mib": {"min_value": 0, "max_value": INT32_MAX},
    "GpuReading.temp_c": {"min_value": 0, "max_value": 200},
    "GpuReading.power_w": {"min_value": 0, "max_value": 100_000},
    "GpuReading.power_limit_w": {"min_value": 0, "max_value": 100_000},
    "GpuReading.ecc_corrected": {"min_value": 0, "max_value": 2**62},
    "GpuReading.ecc_uncorrected": {"min_value": 0, "max_value": 2**62},
    "GpuReading.xids": {"max_length": 32, "allow_empty": True, "child": {"min_value": 0, "max_value": 65535}},
    "GpuReading.last_xid": {"min_value": 0, "max_value": 65535},
    "GpuReading.error": {"max_length": 255},
    "Telemetry.source": {"choices": TELEMETRY_SOURCES},
    "Telemetry.gpus": {"max_length": 64, "allow_empty": True},
    "Telemetry.note": {"max_length": 500},
}


def _scalar(kind: Any, limits: dict[str, Any], where: str) -> serializers.Field:
    limits = dict(limits)
    if "choices" in limits:
        return serializers.ChoiceField(**limits)
    if kind is str:
        if "regex" in limits:
            return serializers.RegexField(limits.pop("regex"), **limits)
        return serializers.CharField(**limits)
    if kind is int:
        return serializers.IntegerField(**limits)
    if kind is float:
        return serializers.FloatField(**limits)
    if kind is bool:
        return serializers.BooleanField(**limits)
    raise TypeError(f"{where}: no serializer field for {kind!r}")


def _field(cls: type, f: dataclasses.Field, kind: Any) -> serializers.Field:
    where = f"{cls.__name__}.{f.name}"
    limits = dict(LIMITS.get(where, {}))
    options: dict[str, Any] = {}
    if f.default is not dataclasses.MISSING:
        options["default"] = f.default
    elif f.default_factory is not dataclasses.MISSING:
        options["default"] = f.default_factory
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
        options["allow_null"] = True
    if kind is str and "allow_blank" not in limits:
        limits["allow_blank"] = options.get("default") == ""
    if dataclasses.is_dataclass(kind):
        return _serializer(kind)(**limits, **options)
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        if dataclasses.is_dataclass(item):
            return _serializer(item)(many=True, **limits, **options)
        child = _scalar(item, limits.pop("child", {}), where + "[]")
        return serializers.ListField(child=child, **limits, **options)
    return _scalar(kind, {**limits, **options}, where)


def _serializer(cls: type) -> type[serializers.Serializer]:
    kinds = typing.get_type_hints(cls)
    attrs: dict[str, Any] = {f.name: _field(cls, f, kinds[f.name]) for f in dataclasses.fields(cls)}
    return type(f"{cls.__name__}Serializer", (serializers.Serializer,), attrs)


def _validate(self, data):
    errors = inventory_problems(data)
    if errors:
        raise serializers.ValidationError({"inventory": errors})
    return data


def _validate_mgmt_addr(self, value: str) -> str:
    problem = mgmt_addr_check(value)
    if problem:
        raise serializers.ValidationError(problem)
    return value


HeartbeatSerializer = type("HeartbeatSerializer", (_serializer(Heartbeat),),
                           {"validate": _validate, "validate_mgmt_addr": _validate_mgmt_addr})

# A bound for a field the protocol no longer has would be dropped in silence.
_unknown = set(LIMITS) - {f"{c.__name__}.{f.name}" for c in (GpuInfo, HcaInfo, FabricMembership, EngineState, Heartbeat,
                                                               GpuReading, Telemetry)
                          for f in dataclasses.fields(c)}
if _unknown:
    raise TypeError(f"nodes.validation.LIMITS names fields agent.protocol does not have: {sorted(_unknown)}")
