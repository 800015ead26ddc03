"""Engine launch specs: from a replica member to the argv and environment its
agent runs. Pure functions over dataclasses; no Django.

    spec = launch_spec(LaunchInput(model="llama-70b", engine="vllm", ...))

The catalog validates an entry with ``check_entry`` (or ``check_args`` and
``check_env``) before it is saved; the scheduler asks ``member_ports`` which
ports to allocate on each member's node.
"""

from __future__ import annotations

from .base import MANAGED_ENV, EngineAdapter, EngineArgsError, LaunchError, LaunchInput, LaunchSpec
from .sglang import SglangAdapter
from .sim import SimAdapter
from .vllm import VllmAdapter

__all__ = [
    "ADAPTERS",
    "MANAGED_ENV",
    "EngineAdapter",
    "EngineArgsError",
    "LaunchError",
    "LaunchInput",
    "LaunchSpec",
    "adapter_for",
    "check_args",
    "check_entry",
    "check_env",
    "launch_spec",
    "member_ports",
    "register",
]

ADAPTERS: dict[str, EngineAdapter] = {}


def register(adapter: EngineAdapter) -> EngineAdapter:
    ADAPTERS[adapter.name] = adapter
    return adapter


for _adapter in (VllmAdapter(), SglangAdapter(), SimAdapter()):
    register(_adapter)


def adapter_for(engine: str) -> EngineAdapter:
    try:
        return ADAPTERS[engine]
    except KeyError:
        raise EngineArgsError(f"engine {engine!r} is not one of {', '.join(sorted(ADAPTERS))}") from None


def launch_spec(inp: LaunchInput) -> LaunchSpec:
    """The argv, environment, GPUs and ports of one member."""
    return adapter_for(inp.engine).launch(inp)


def member_ports(engine: str, *, nodes: int, rank: int) -> tuple[str, ...]:
    """Purposes of the ports to allocate on the node of the member of this rank.

    Rank 0: ``http`` (and ``rendezvous`` for a multi-node replica); ranks above
    0: nothing, except SGLang's ``health`` (passed as ``worker_port``).
    """
    return adapter_for(engine).member_ports(nodes=nodes, rank=rank)


def check_args(engine: str, args: list[str], *, nodes: int | None = None, gpus_per_node: int | None = None) -> None:
    """Refuse abbreviated, short, unknown or llmgw-managed flags, naming the flag.

    With ``nodes`` and ``gpus_per_node``, also check that overridden parallel
    sizes use exactly the replica's GPUs.
    """
    adapter_for(engine).check_args(args, nodes=nodes, gpus_per_node=gpus_per_node)


def check_env(engine: str, env: dict[str, str]) -> None:
    """Refuse environment that llmgw sets from the allocation and inventory."""
    if not isinstance(env, dict):
        raise EngineArgsError(f"env must be a mapping, not {type(env).__name__}")
    adapter_for(engine).check_env(env)


def check_entry(*, engine: str, name: str, args: list[str], env: dict[str, str], nodes: int, gpus_per_node: int) -> None:
    """Everything the adapters can say about a catalog entry before it is saved."""
    adapter = adapter_for(engine)
    adapter.check_model_name(name)
    adapter.check_args(args, nodes=nodes, gpus_per_node=gpus_per_node)
    check_env(engine, env)
