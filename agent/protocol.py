"""The contract between an agent and the control plane.

This module is the only thing the two sides share. It imports nothing but the
standard library, so the agent stays installable without Django, and the
control plane's serializers are tested against the examples below.

Heartbeat: ``POST /agent/v1/nodes/<node id>/heartbeat`` with a JSON
``Heartbeat``; the answer is a ``HeartbeatReply``. The node id in the URL must
be the common name of the client certificate.

Desired-state long-poll: ``GET /agent/v1/nodes/<node id>/desired?version=N&wait=S``
answers at once with a ``DesiredState`` when its version differs from N, and
otherwise when it changes or after S seconds (then with the same version).
The listener parks such a request without holding a thread, so an agent may
keep one open at all times. An agent that gets the same version back sooner
than S should pause a moment before asking again (a server without parking
answers at once).

A control plane that is up but cannot reach one of its own dependencies
(its database, its Redis) answers 503 with a ``Retry-After`` header and a JSON
``{"error": ..., "dependency": ...}``: the agent tries again after that many
seconds (at most its heartbeat interval), without backing off further.

Either side may be newer than the other: a reader keeps the fields it knows
and ignores the rest (``from_dict``), so adding a field never breaks an older
agent or control plane. Removing or renaming one does: that is a new
``PROTOCOL_VERSION``.
"""

from __future__ import annotations

import ipaddress
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from functools import cache
from typing import Any, TypeVar

PROTOCOL_VERSION = 1

API_PREFIX = "/agent/v1"

# "backoff": its engine failed at start and the agent restarts it after a
# growing delay (EngineState.restarts says how many times it has so far).
ENGINE_STATES = ("starting", "running", "exited", "backoff")

# The node id is also the hostname, the VM name and the certificate's common
# name: an RFC 1123 label, lowercase (dots allowed, as in a short FQDN).
NODE_ID_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")
FABRIC_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
HCA_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# A member id names a directory under the agent's work_dir.
MEMBER_ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")

# A host name where a deployment allows them instead of an address (RFC 1123).
HOSTNAME_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


def mgmt_addr_problem(addr: str, *, hostnames: bool = False, loopback: bool = True) -> str:
    """Why ``addr`` cannot be a node's management address ('' when it can).

    The gateway and the health checks reach engines there: it is an IP
    address (or, where the deployment says so, a host name), never a string
    that could carry a port, a path or a bracket into a URL. Addresses that
    are nobody's node are refused always: unspecified, multicast, link-local
    (which needs a zone to mean anything), IPv4-mapped IPv6 (write the IPv4
    address); loopback only when ``loopback`` (a cluster on one machine)."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        if hostnames and HOSTNAME_RE.match(addr) and not addr.replace(".", "").isdigit():
            return ""
        what = "an IP address or a host name" if hostnames else "an IP address (host names are not allowed here)"
        return f"{addr[:80]!r} is not {what}"
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        return f"{addr} carries a zone (%{ip.scope_id}); give an address routable without one"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return f"{addr} is an IPv4-mapped IPv6 address; give the IPv4 address {ip.ipv4_mapped} itself"
    if ip.is_unspecified or ip.is_multicast:
        return f"{addr} is not the address of one machine"
    if ip.is_link_local:
        return f"{addr} is a link-local address; give an address routable from the control plane"
    if ip.is_loopback and not loopback:
        return (f"{addr} is a loopback address: the gateway would send requests to itself. Loopback nodes are "
                "accepted only on a one-machine cluster (LLMGW_ALLOW_LOOPBACK_NODES)")
    return ""


def url_host(addr: str) -> str:
    """A management address as the host part of a URL, built from the parsed
    address (IPv6 in brackets); ValueError for anything that is not one."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        if not HOSTNAME_RE.match(addr):
            raise ValueError(f"{addr[:80]!r} is not an address or a host name") from None
        return addr.lower()
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        raise ValueError(f"{addr} carries a zone")
    return f"[{ip.compressed}]" if ip.version == 6 else ip.compressed


def http_url(addr: str, port: int, path: str = "") -> str:
    """``http://host:port/path`` from its parts: a validated address, a port
    number, and a path of our own (never a node's)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"{port!r} is not a TCP port")
    if path and not path.startswith("/"):
        raise ValueError(f"{path!r} is not an absolute path")
    return f"http://{url_host(addr)}:{port}{path}"


T = TypeVar("T")


def node_path(node_id: str) -> str:
    """Where a node's resources live on the agent API (``/heartbeat``, ``/desired``)."""
    return f"{API_PREFIX}/nodes/{node_id}"


class ProtocolError(TypeError, ValueError):
    """A message that does not follow this contract: a required field
    missing, or a value of the wrong type. The one error ``from_dict`` raises
    (a TypeError, and a ValueError, for readers that catch either)."""


@cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _number(kind: type, value: Any, where: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ProtocolError(f"{where}: expected a number, not {_json_kind(value)}")
    try:
        number = kind(value)
    except (ValueError, OverflowError):
        raise ProtocolError(f"{where}: {value!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is int and isinstance(value, float) and number != value:
        raise ProtocolError(f"{where}: {value!r} is not an integer")
    if kind is float and not math.isfinite(number):
        raise ProtocolError(f"{where}: {value!r} is not a finite number")
    return number


def _value(kind: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(kind)
    if is_dataclass(kind):
        return _from_dict(kind, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a JSON list, not {_json_kind(value)}")
        (item,) = typing.get_args(kind)
        return [_value(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ProtocolError(f"{where}: expected a JSON object, not {_json_kind(value)}")
        _, item = typing.get_args(kind)
        return {str(k): _value(item, v, f"{where}.{k}") for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(kind)):
            return None
        return _value(options[0], value, where)
    if kind is int or kind is float:
        return _number(kind, value, where)
    if kind is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where}: expected true or false, not {_json_kind(value)}")
        return value
    if kind is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected a string, not {_json_kind(value)}")
        return value
    return value


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a JSON list" if isinstance(value, list) else "a JSON object"


def _from_dict(cls: type[T], data: Any, where: str) -> T:
    if not isinstance(data, Mapping):
        raise ProtocolError(f"{where or cls.__name__} must be a JSON object, not {_json_kind(data)}")
    kinds = _field_types(cls)
    values = {}
    for f in fields(cls):
        if not f.init:
            continue
        if f.name in data:
            values[f.name] = _value(kinds[f.name], data[f.name], f"{where}.{f.name}" if where else f.name)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ProtocolError(f"{cls.__name__} is missing the required field {where + '.' if where else ''}{f.name}")
    return cls(**values)


def from_dict(cls: type[T], data: Any) -> T:
    """An instance of the dataclass ``cls`` from decoded JSON, nested
    dataclasses included. Fields it does not know are ignored (the other side
    may be newer). Anything else that does not fit (a required field missing,
    a value of the wrong type, a number that is not finite) raises
    ``ProtocolError`` naming the field, and nothing else is raised."""
    return _from_dict(cls, data, "")


@dataclass
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_mib: int
    pci_bus_id: str


@dataclass
class HcaInfo:
    name: str
    fabric: str | None = None  # the fabric the agent's configuration names for it
    port: int = 1
    state: str = ""  # "ACTIVE", "DOWN", ...
    phys_state: str = ""  # "LinkUp", ...
    link_layer: str = ""  # "InfiniBand" or "Ethernet"
    rate: str = ""  # "400 Gb/sec (4X NDR)"
    guid: str = ""  # node_guid, "0c42:a103:00ab:cdef"
    gid: str = ""  # ports/<n>/gids/0


@dataclass
class FabricMembership:
    name: str
    hcas: list[str]


@dataclass
class EngineState:
    member: str  # the member id the desired state named
    replica: str
    rank: int
    state: str  # one of ENGINE_STATES
    pid: int | None = None
    exit_code: int | None = None
    healthy: bool = False
    log_tail: list[str] = field(default_factory=list)
    restarts: int = 0  # times the agent restarted it after it failed at start


# Where a telemetry block's readings came from: NVML, nvidia-smi's query
# (NVML absent: fewer fields, no Xid events), or a simulated node's fake NVML.
TELEMETRY_SOURCES = ("nvml", "nvidia-smi", "sim")


@dataclass
class GpuReading:
    """One GPU's readings in a telemetry block. None: not read (the source
    cannot tell, or the GPU does not support it), never a made-up zero."""

    index: int
    uuid: str = ""
    util: int | None = None  # GPU utilisation, percent
    mem_util: int | None = None  # memory controller utilisation, percent
    mem_used_mib: int | None = None
    mem_total_mib: int | None = None
    temp_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    ecc_corrected: int | None = None  # volatile counts (since the driver loaded)
    ecc_uncorrected: int | None = None
    pending_retirement: bool | None = None  # retired pages or remapped rows waiting for a reset
    thermal_throttle: bool | None = None
    xids: list[int] = field(default_factory=list)  # Xid events since the last block the control plane took
    last_xid: int | None = None
    lost: bool = False  # NVML_ERROR_GPU_IS_LOST: fallen off the bus
    error: str = ""  # what NVML said when reading this GPU failed


@dataclass
class Telemetry:
    """The compact block a heartbeat carries at most every telemetry interval."""

    source: str  # one of TELEMETRY_SOURCES
    gpus: list[GpuReading] = field(default_factory=list)
    note: str = ""  # why the preferred source is not used (said once in the log, here every time)


@dataclass
class Heartbeat:
    agent_version: str
    mgmt_addr: str
    mgmt_interface: str
    fabrics: list[FabricMembership] = field(default_factory=list)
    gpus: list[GpuInfo] = field(default_factory=list)
    hcas: list[HcaInfo] = field(default_factory=list)
    discovery_errors: list[str] = field(default_factory=list)
    engines: list[EngineState] = field(default_factory=list)
    desired_version: int = 0  # the version of desired state the agent holds
    protocol: int = PROTOCOL_VERSION
    telemetry: Telemetry | None = None  # GPU readings, at most every telemetry interval

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Heartbeat":
        return from_dict(cls, data)


@dataclass
class DesiredMember:
    member: str
    replica: str
    model: str
    rank: int
    engine: str
    argv: list[str]
    env: dict[str, str]
    gpus: list[int]
    ports: dict[str, int]
    serves_http: bool
    health_url: str | None = None


@dataclass
class DesiredState:
    version: int
    members: list[DesiredMember] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DesiredState":
        return from_dict(cls, data)


@dataclass
class HeartbeatReply:
    node: str
    status: str
    heartbeat_interval: float
    desired: DesiredState
    # The longest the agent may wait between two attempts while it cannot
    # get through (its backoff cap), so that once the control plane hears
    # again every node reaches it within its grace period. 0: not said (an
    # older control plane); the agent keeps its configured reconnect_max.
    reconnect_max: float = 0.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "HeartbeatReply":
        return from_dict(cls, data)


def example_telemetry(*, gpus: int = 8, node_id: str = "node-1") -> Telemetry:
    """A realistic telemetry block of a busy 8-GPU node, for tests and benchmarks."""
    return Telemetry(
        source="nvml",
        gpus=[
            GpuReading(
                index=i, uuid=f"GPU-3b6d8f0c-2a1e-5c4b-9e7d-0f1a2b3c4d{i:02x}", util=87 - i, mem_util=41,
                mem_used_mib=120_000 + i, mem_total_mib=143771, temp_c=61 + i, power_w=612.5, power_limit_w=700.0,
                ecc_corrected=0, ecc_uncorrected=0, pending_retirement=False, thermal_throttle=False,
            )
            for i in range(gpus)
        ],
    )


def example_heartbeat(*, gpus: int = 8, fabric: str | None = "ib-a") -> Heartbeat:
    """A realistic heartbeat, for tests and benchmarks on both sides."""
    hca_names = ["mlx5_0", "mlx5_1"] if fabric else []
    return Heartbeat(
        agent_version="0.1.0",
        mgmt_addr="127.0.1.1",
        mgmt_interface="lo",
        fabrics=[FabricMembership(name=fabric, hcas=hca_names)] if fabric else [],
        gpus=[
            GpuInfo(
                index=i,
                uuid=f"GPU-3b6d8f0c-2a1e-5c4b-9e7d-0f1a2b3c4d{i:02x}",
                name="NVIDIA H200",
                memory_mib=143771,
                pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
            )
            for i in range(gpus)
        ],
        hcas=[
            HcaInfo(
                name=name,
                fabric=fabric,
                state="ACTIVE",
                phys_state="LinkUp",
                link_layer="InfiniBand",
                rate="400 Gb/sec (4X NDR)",
                guid=f"0c42:a103:00ab:cd{i:02x}",
                gid=f"fe80:0000:0000:0000:0c42:a103:00ab:cd{i:02x}",
            )
            for i, name in enumerate(hca_names)
        ],
    )
