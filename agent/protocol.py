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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PROTOCOL_VERSION = 1

ENGINE_STATES = ("starting", "running", "exited")


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
    fabric: str | None  # the fabric the agent's configuration names for it
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    def from_dict(cls, data: dict[str, Any]) -> "DesiredState":
        return cls(
            version=int(data["version"]),
            members=[DesiredMember(**m) for m in data.get("members", [])],
        )


@dataclass
class HeartbeatReply:
    node: str
    status: str
    heartbeat_interval: float
    desired: DesiredState

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HeartbeatReply":
        return cls(
            node=data["node"],
            status=data["status"],
            heartbeat_interval=float(data["heartbeat_interval"]),
            desired=DesiredState.from_dict(data["desired"]),
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
