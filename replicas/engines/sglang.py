"""SGLang: ``python -m sglang.launch_server``.

Flags read from SGLang 0.5.23's own parser (``make engine-check``):

- ``--model-path`` and ``--served-model-name`` (the catalog name, which the
  gateway routes on; SGLang refuses a ``:`` in it, which it keeps for LoRA);
- ``--tp-size`` = nodes x GPUs per node: one tensor-parallel group over the
  whole replica, unless the catalog entry sets ``--tp-size`` or
  ``--pp-size`` (then the other fills the replica);
- multi-node: ``--nnodes``, ``--node-rank`` and ``--dist-init-addr
  <leader>:<rendezvous port>`` (the leader binds it);
- the leader gets ``--host``/``--port`` and is the only rank that runs the
  tokenizer and the HTTP API.

Unlike vLLM's headless workers, SGLang's ranks above 0 start a small health
server of their own (``/health``, ``/ping``) on ``--host``/``--port``, 127.0.0.1:30000
unless told otherwise, so two workers on one node would collide. Each of
them therefore gets a port allocated on its own node (``worker_port``,
reported as ``ports["health"]``). It is not the API: ``serves_http`` stays
True for rank 0 only, and only the leader is routed to.

``SGLANG_HOST_IP`` is the node's management address, for the same reason as
vLLM's ``VLLM_HOST_IP``: otherwise SGLang guesses it from the interfaces.
"""

from __future__ import annotations

from . import flags
from .base import EngineAdapter, EngineArgsError, LaunchError, LaunchInput, int_flag_values

PYTHON = "python"  # the engine's interpreter on the node (its venv first on PATH)

TP = "--tp-size"
PP = "--pp-size"


class SglangAdapter(EngineAdapter):
    name = "sglang"
    version = "0.5.23"
    health_path = "/health"
    overridable = frozenset({TP, PP, "--tensor-parallel-size", "--pipeline-parallel-size"})
    managed = {
        "--model-path": "it is the catalog entry's model",
        "--model": "it is the catalog entry's model",
        "--served-model-name": "the gateway routes on the catalog name",
        "--host": "each rank binds its node's management address",
        "--port": "ports are allocated per node by the scheduler",
        "--nnodes": "it is the catalog entry's nodes",
        "--node-rank": "it is the member's rank",
        "--dist-init-addr": "it is the leader's address and rendezvous port",
        "--nccl-init-addr": "it is the leader's address and rendezvous port",
        "--dp-size": "a replica is one engine group; scale with the catalog's replicas",
        "--data-parallel-size": "a replica is one engine group; scale with the catalog's replicas",
        "--base-gpu-id": "the GPUs are the scheduler's allocation (CUDA_VISIBLE_DEVICES)",
        "--config": "a config file could set any of these where no check sees it; put the options in args",
    }
    managed_env = {
        "SGLANG_HOST_IP": "it is the node's management address",
    }
    fallback_aliases = {
        "--tensor-parallel-size": TP,
        "--pipeline-parallel-size": PP,
        "--model": "--model-path",
        "--nccl-init-addr": "--dist-init-addr",
        "--data-parallel-size": "--dp-size",
    }
    emitted = frozenset({"--model-path", "--served-model-name", TP, PP, "--nnodes", "--node-rank", "--dist-init-addr",
                         "--host", "--port"})

    def member_ports(self, *, nodes: int, rank: int) -> tuple[str, ...]:
        if rank == 0:
            return super().member_ports(nodes=nodes, rank=rank)
        return ("health",)

    def check_model_name(self, name: str) -> None:
        if ":" in name:
            raise EngineArgsError(f"name {name!r}: SGLang refuses a ':' in the served model name (it marks a LoRA adapter)")

    def parallel_layout(self, parsed: list[flags.UserFlag], *, nodes: int, gpus_per_node: int) -> dict[str, int]:
        given, written = int_flag_values(parsed, (TP, PP))
        total = nodes * gpus_per_node
        tp, pp = given.get(TP), given.get(PP)
        if tp is None and pp is None:
            tp, pp = total, 1
        elif tp is None:
            tp = total // pp if total % pp == 0 else 0
        elif pp is None:
            pp = total // tp if total % tp == 0 else 0
        if not tp or not pp or tp * pp != total:
            raise EngineArgsError(
                f"{written}: a replica has {nodes} node(s) x {gpus_per_node} GPUs = {total}; {TP} x {PP} must equal {total}"
            )
        return {"tensor": tp, "pipeline": pp}

    def command(self, inp: LaunchInput, *, layout: dict[str, int], user_flags: set[str]) -> list[str]:
        argv = [PYTHON, "-m", "sglang.launch_server", "--model-path", inp.weights, "--served-model-name", inp.model]
        if TP not in user_flags:
            argv += [TP, str(layout["tensor"])]
        if PP not in user_flags and layout["pipeline"] != 1:
            argv += [PP, str(layout["pipeline"])]
        if inp.multi_node:
            argv += ["--nnodes", str(inp.nodes), "--node-rank", str(inp.rank), "--dist-init-addr", inp.rendezvous]
        argv += ["--host", inp.mgmt_addr, "--port", str(self._listen_port(inp))]
        return argv

    def ports(self, inp: LaunchInput) -> dict[str, int]:
        if inp.is_leader:
            return super().ports(inp)
        return {"health": self._listen_port(inp)}

    def _listen_port(self, inp: LaunchInput) -> int:
        if inp.is_leader:
            return inp.http_port
        if inp.worker_port is None:
            raise LaunchError(
                f"sglang member rank {inp.rank} of {inp.model}: needs worker_port, a port allocated on its own node "
                "for the health server SGLang starts on ranks above 0"
            )
        return inp.worker_port

    def engine_environment(self, inp: LaunchInput) -> dict[str, str]:
        return {"SGLANG_HOST_IP": inp.mgmt_addr}
