"""What every engine adapter takes and gives, and the parts they share.

An adapter turns one member of a placed replica (``LaunchInput``) into what
the node's agent runs (``LaunchSpec``): argv, environment, GPUs, the ports the
process binds on its node, and whether it serves the HTTP API. Nothing here
imports Django or touches the network; the control plane feeds it rows, the
engine check (``tools/engine_check``) feeds it made-up members and parses the
result with the engines' real argument parsers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from agent.protocol import url_host

from . import flags, policy
from .errors import EngineArgsError, LaunchError

__all__ = ["EngineAdapter", "EngineArgsError", "LaunchError", "LaunchInput", "LaunchSpec", "MANAGED_ENV"]

logger = logging.getLogger(__name__)

# Environment the adapters derive from the allocation and the node's
# inventory. A catalog entry cannot set these: the scheduler's allocation and
# the agent's discovery are the truth (a wrong NCCL_IB_HCA pairs HCAs across
# fabrics and hangs the first all-reduce).
MANAGED_ENV = {
    "CUDA_VISIBLE_DEVICES": "the GPUs come from the scheduler's allocation",
    "NCCL_IB_HCA": "the HCAs come from the node's inventory in the replica's fabric",
    "NCCL_SOCKET_IFNAME": "the interface comes from the node's mgmt_interface",
    "GLOO_SOCKET_IFNAME": "the interface comes from the node's mgmt_interface",
}


@dataclass(frozen=True)
class LaunchInput:
    """One member of a placed replica, with what its node reported.

    ``http_port`` and ``rendezvous_port`` are allocated on the leader's node
    (rank 0); every rank gets the same two numbers, because workers connect to
    the leader's rendezvous. ``worker_port`` is a port allocated on this
    member's own node, for engines whose ranks above 0 listen too (SGLang's
    health server); ``member_ports`` says which engines need it.
    """

    model: str  # catalog name: what clients ask for, and the served model name
    engine: str
    weights: str  # model path (or id) the engine loads
    nodes: int  # nodes per replica
    gpus_per_node: int
    rank: int
    mgmt_addr: str  # this node's management address
    mgmt_interface: str  # the interface that address is on
    gpus: list[int]  # GPU indices allocated on this node
    leader_addr: str  # rank 0's mgmt_addr
    http_port: int  # the leader's HTTP port
    rendezvous_port: int | None = None  # the leader's rendezvous port (multi-node)
    fabric: str | None = None  # None: single-node on an island
    hcas: list[str] = field(default_factory=list)  # this node's HCAs in ``fabric``
    args: list[str] = field(default_factory=list)  # the catalog entry's extra engine arguments
    env: dict[str, str] = field(default_factory=dict)  # the catalog entry's environment
    worker_port: int | None = None  # a port on this node for a listening rank > 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def rendezvous(self) -> str:
        return f"{_host_for_url(self.leader_addr)}:{self.rendezvous_port}"


@dataclass(frozen=True)
class LaunchSpec:
    """What the agent runs for one member."""

    argv: list[str]
    env: dict[str, str]
    gpus: list[int]
    ports: dict[str, int]  # ports this process binds on its own node, by purpose
    serves_http: bool  # only the leader serves the API
    health_path: str | None = None  # on the leader's http port

    def health_url(self, host: str) -> str | None:
        if not (self.serves_http and self.health_path and "http" in self.ports):
            return None
        return f"http://{_host_for_url(host)}:{self.ports['http']}{self.health_path}"


class EngineAdapter:
    """Base of the adapters: validation and environment they all share.

    Subclasses set the class attributes and implement ``command``.
    """

    name: str = ""
    version: str | None = None  # engine release whose parser the flags were read from
    # Flags a catalog entry may not pass, with the reason given back to it.
    managed: dict[str, str] = {}
    managed_prefixes: dict[str, str] = {}  # every flag starting with one of these
    # Flags a catalog entry may pass instead of ours (parallel layout).
    overridable: frozenset[str] = frozenset()
    # vLLM's parser turns ``--max_model_len`` into ``--max-model-len``.
    underscores_are_dashes: bool = False
    # vLLM's parser reads ``--json-arg.key value`` as part of ``--json-arg``.
    dotted_keys: bool = False
    health_path: str | None = "/health"
    # Environment an engine reads that llmgw sets for it (besides MANAGED_ENV).
    managed_env: dict[str, str] = {}
    emitted: frozenset[str] = frozenset()  # every flag ``command`` may emit
    # Without NCCL_IB_HCA, NCCL would take any HCA of the node, another
    # fabric's included: a multi-node member must have its fabric's HCAs.
    needs_hcas: bool = True
    # Alias -> flag, for when no option table is at hand (the tables know them all).
    fallback_aliases: dict[str, str] = {}

    def known_flags(self) -> set[str]:
        """Flags this adapter knows without a table: what it emits or refuses."""
        return set(self.managed) | set(self.overridable) | set(self.emitted) | set(self.fallback_aliases)

    # -- what the scheduler asks -------------------------------------------

    def member_ports(self, *, nodes: int, rank: int) -> tuple[str, ...]:
        """Ports to allocate on this member's node, by purpose."""
        if rank == 0:
            return ("http", "rendezvous") if nodes > 1 else ("http",)
        return ()

    # -- validation ----------------------------------------------------------

    def table(self) -> flags.OptionTable | None:
        return flags.load_table(self.name, self.version) if self.version else None

    def check_args(self, args: list[str], *, nodes: int | None = None, gpus_per_node: int | None = None) -> None:
        """Refuse what the engine would misread or what llmgw must decide."""
        parsed = self.read_args(args)
        if nodes is not None and gpus_per_node is not None:
            self.parallel_layout(parsed, nodes=nodes, gpus_per_node=gpus_per_node)

    def read_args(self, args: list[str]) -> list[flags.UserFlag]:
        parsed = flags.parse_user_args(self, args, self.table())
        for item in parsed:
            for name in sorted(item.names):
                reason = self.managed_reason(name)
                if reason is not None:
                    raise EngineArgsError(f"{item.raw}: {self.name} flag {name} is set by llmgw ({reason}); remove it")
                refusal = policy.flag_refusal(self.name, name)
                if refusal is not None and not refusal.admin_may:
                    raise EngineArgsError(f"{item.raw}: {policy.refusal_message(refusal)}")
        return parsed

    def admin_flags(self, args: list[str]) -> list[policy.Refusal]:
        """The flags of ``args`` that only an admin may set (the rest already checked)."""
        found = []
        for item in self.read_args(args):
            for name in sorted(item.names):
                refusal = policy.flag_refusal(self.name, name)
                if refusal is not None and refusal.admin_may:
                    found.append(refusal)
        return found

    def managed_reason(self, flag: str) -> str | None:
        if flag in self.overridable:
            return None
        if flag in self.managed:
            return self.managed[flag]
        for prefix, reason in self.managed_prefixes.items():
            if flag.startswith(prefix):
                return reason
        if flag in ("--help", "--version"):
            return "the engine would print it and exit"
        if flag.endswith(("-port", "-ports")):
            return "ports are allocated per node by the scheduler; a fixed one collides with the other engines on the node"
        return None

    def parallel_layout(self, parsed: list[flags.UserFlag], *, nodes: int, gpus_per_node: int) -> dict[str, int]:
        """Parallel sizes for the replica's shape, honouring the entry's overrides;
        refuses overrides that do not use exactly the replica's GPUs."""
        return {}

    def check_env(self, env: dict[str, str]) -> None:
        refused = [r for r in (policy.env_refusal(k) for k in env if isinstance(k, str)) if r is not None]
        if refused:
            raise EngineArgsError("env: " + "; ".join(policy.refusal_message(r) for r in refused))
        for key, value in env.items():
            if not isinstance(key, str) or not key or "=" in key or "\0" in key:
                raise EngineArgsError(f"env: {key!r} is not a valid variable name")
            if not isinstance(value, str):
                raise EngineArgsError(f"env: {key} must be a string, not {type(value).__name__}")
            if key in MANAGED_ENV:
                raise EngineArgsError(f"env: {key} is set by llmgw ({MANAGED_ENV[key]}); remove it")
            if key in self.managed_env:
                raise EngineArgsError(f"env: {key} is set by llmgw ({self.managed_env[key]}); remove it")

    def check_model_name(self, name: str) -> None:
        """Engine-specific limits on the served model name."""

    # -- launch ----------------------------------------------------------------

    def launch(self, inp: LaunchInput) -> LaunchSpec:
        check_input(inp, needs_hcas=self.needs_hcas)
        parsed = self.read_args(list(inp.args))
        self.check_model_name(inp.model)
        layout = self.parallel_layout(parsed, nodes=inp.nodes, gpus_per_node=inp.gpus_per_node)
        user_flags = set().union(*(item.names for item in parsed)) if parsed else set()
        argv = self.command(inp, layout=layout, user_flags=user_flags) + list(inp.args)
        return LaunchSpec(
            argv=argv,
            env=self.environment(inp),
            gpus=list(inp.gpus),
            ports=self.ports(inp),
            serves_http=inp.is_leader,
            health_path=self.health_path if inp.is_leader else None,
        )

    def command(self, inp: LaunchInput, *, layout: dict[str, int], user_flags: set[str]) -> list[str]:
        raise NotImplementedError

    def ports(self, inp: LaunchInput) -> dict[str, int]:
        if not inp.is_leader:
            return {}
        ports = {"http": inp.http_port}
        if inp.multi_node:
            ports["rendezvous"] = _required(inp.rendezvous_port, "rendezvous_port", inp)
        return ports

    def environment(self, inp: LaunchInput) -> dict[str, str]:
        managed = {k for k in inp.env if k in MANAGED_ENV or k in self.managed_env}
        if managed:
            # The catalog refuses these; a row that has them anyway still
            # launches, with the allocation's values (or none: an island
            # gets no NCCL_IB_HCA at all).
            logger.warning("engine=%s model=%s rank=%s ignoring catalog env %s", self.name, inp.model, inp.rank, ",".join(sorted(managed)))
        refused = {k for k in inp.env if k not in managed and policy.env_refusal(k) is not None}
        if refused:
            # A row saved before the policy: its code-loading variables never reach a node.
            logger.warning("engine=%s model=%s rank=%s dropping refused catalog env %s", self.name, inp.model,
                           inp.rank, ",".join(sorted(refused)))
        env = {k: v for k, v in inp.env.items() if k not in managed and k not in refused}
        env.update(node_environment(inp))
        env.update(self.engine_environment(inp))
        return env

    def engine_environment(self, inp: LaunchInput) -> dict[str, str]:
        return {}


def int_flag_values(parsed: list[flags.UserFlag], wanted: tuple[str, ...]) -> tuple[dict[str, int], str]:
    """The entry's values of these flags, and how it wrote them (for messages)."""
    found: dict[str, int] = {}
    written: list[str] = []
    for item in parsed:
        for flag in wanted:
            if flag in item.names:
                try:
                    found[flag] = int(item.values[-1])
                except (IndexError, ValueError):
                    raise EngineArgsError(f"{item.raw}: needs a whole number") from None
                if found[flag] < 1:
                    raise EngineArgsError(f"{item.raw} {found[flag]}: must be at least 1")
                written.append(item.raw if "=" in item.raw else f"{item.raw} {item.values[-1]}")
    return found, " ".join(written)


def node_environment(inp: LaunchInput) -> dict[str, str]:
    """GPUs from the allocation, NCCL and Gloo from the node's inventory.

    NCCL reads both ``NCCL_IB_HCA`` and ``NCCL_SOCKET_IFNAME`` as lists of
    *prefixes* (``mlx5_1`` also selects ``mlx5_10``; ``eth1`` also ``eth10``),
    so the lists start with ``=``, NCCL's mark for exact names: an HCA of
    another fabric whose name merely starts the same must never be used.
    Gloo takes plain interface names.
    """
    env = {
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in inp.gpus),
        "NCCL_SOCKET_IFNAME": f"={inp.mgmt_interface}",
        "GLOO_SOCKET_IFNAME": inp.mgmt_interface,
    }
    if inp.fabric and inp.hcas:
        env["NCCL_IB_HCA"] = "=" + ",".join(inp.hcas)
    return env


def check_input(inp: LaunchInput, *, needs_hcas: bool = True) -> None:
    """Refuse a member the scheduler should never have produced."""
    where = f"{inp.engine} member rank {inp.rank} of {inp.model}"
    if inp.nodes < 1 or inp.gpus_per_node < 1:
        raise LaunchError(f"{where}: nodes and gpus_per_node must be at least 1")
    if not 0 <= inp.rank < inp.nodes:
        raise LaunchError(f"{where}: rank must be in 0..{inp.nodes - 1}")
    if len(inp.gpus) != inp.gpus_per_node or len(set(inp.gpus)) != len(inp.gpus):
        raise LaunchError(f"{where}: needs {inp.gpus_per_node} distinct GPUs on its node, was given {list(inp.gpus)}")
    if inp.multi_node and not inp.fabric:
        raise LaunchError(f"{where}: a {inp.nodes}-node replica needs a fabric; a node without one takes single-node replicas only")
    if inp.multi_node and inp.rendezvous_port is None:
        raise LaunchError(f"{where}: a multi-node member needs the leader's rendezvous_port")
    if needs_hcas and inp.multi_node and not inp.hcas:
        raise LaunchError(f"{where}: node {inp.mgmt_addr} has no HCA in fabric {inp.fabric}")
    if not inp.mgmt_interface:
        raise LaunchError(f"{where}: node {inp.mgmt_addr} reported no mgmt_interface")
    if not inp.weights:
        raise LaunchError(f"{where}: no weights path")


def _required(value: int | None, what: str, inp: LaunchInput) -> int:
    if value is None:
        raise LaunchError(f"{inp.engine} member rank {inp.rank} of {inp.model}: needs {what}")
    return value


def _host_for_url(host: str) -> str:
    """The host part of a URL, from the parsed address (agent.protocol)."""
    try:
        return url_host(host)
    except ValueError:
        raise LaunchError(f"node address {host[:80]!r} is not an address; the node must report an IP address") from None
