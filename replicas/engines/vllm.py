"""vLLM: ``vllm serve <weights>``, multi-node with the multiprocessing backend.

Flags read from vLLM 0.33.0's own parser (``make engine-check``):

- tensor parallel size = GPUs per node, pipeline parallel size = nodes,
  unless the catalog entry sets either (then the other fills the replica:
  their product, times ``--prefill-context-parallel-size`` if given, must be
  the replica's GPU count);
- multi-node: ``--nnodes``, ``--node-rank``, ``--master-addr``,
  ``--master-port`` (the leader binds it: the rendezvous port) and
  ``--distributed-executor-backend mp`` (vLLM refuses ``nnodes > 1`` with
  Ray); ranks above 0 run ``--headless``: no API server at all;
- the leader gets ``--host``/``--port`` and serves the model under its
  catalog name (``--served-model-name``), which is what the gateway routes on.

``VLLM_HOST_IP`` is the node's management address: the leader advertises its
message queues on ``get_ip()``, which without it is the address of the
default route, not necessarily the interface the other nodes reach.
"""

from __future__ import annotations

from . import flags
from .base import EngineAdapter, EngineArgsError, LaunchInput, int_flag_values

VLLM = "vllm"

TP = "--tensor-parallel-size"
PP = "--pipeline-parallel-size"
PCP = "--prefill-context-parallel-size"


class VllmAdapter(EngineAdapter):
    name = "vllm"
    version = "0.33.0"
    underscores_are_dashes = True  # FlexibleArgumentParser reads --max_model_len as --max-model-len
    dotted_keys = True  # --compilation-config.mode 3 is part of --compilation-config
    health_path = "/health"
    overridable = frozenset({TP, PP})
    managed = {
        "--model": "the weights path is the positional argument, from the catalog entry's model",
        "--served-model-name": "the gateway routes on the catalog name",
        "--host": "the leader binds its node's management address",
        "--port": "ports are allocated per node by the scheduler",
        "--nnodes": "it is the catalog entry's nodes",
        "--node-rank": "it is the member's rank",
        "--master-addr": "it is the leader's management address",
        "--master-port": "the rendezvous port is allocated on the leader",
        "--distributed-executor-backend": "multi-node replicas run the multiprocessing backend",
        "--headless": "ranks above 0 run headless, the leader serves",
        "--config": "a config file could set any of these where no check sees it; put the options in args",
        "--api-server-count": "the leader runs one API server on its allocated port",
        "--grpc": "the gateway speaks HTTP to the leader",
        "--uds": "the gateway reaches the leader over TCP",
    }
    managed_prefixes = {
        "--data-parallel": "a replica is one engine group; scale with the catalog's replicas",
    }
    managed_env = {
        "VLLM_HOST_IP": "it is the node's management address",
    }
    emitted = frozenset({TP, PP, "--served-model-name", "--host", "--port", "--nnodes", "--node-rank", "--master-addr",
                         "--master-port", "--distributed-executor-backend", "--headless"})

    def parallel_layout(self, parsed: list[flags.UserFlag], *, nodes: int, gpus_per_node: int) -> dict[str, int]:
        given, written = int_flag_values(parsed, (TP, PP, PCP))
        total = nodes * gpus_per_node
        tp, pp, pcp = given.get(TP), given.get(PP), given.get(PCP, 1)
        if tp is None and pp is None and pcp == 1:
            tp, pp = gpus_per_node, nodes
        elif tp is None:
            pp = pp or 1
            tp = total // (pp * pcp) if total % (pp * pcp) == 0 else 0
        elif pp is None:
            pp = total // (tp * pcp) if total % (tp * pcp) == 0 else 0
        if not tp or not pp or tp * pp * pcp != total:
            raise EngineArgsError(
                f"{written}: a replica has {nodes} node(s) x {gpus_per_node} GPUs = {total}; "
                f"{TP} x {PP}{' x ' + PCP if PCP in given else ''} must equal {total}"
            )
        return {"tensor": tp, "pipeline": pp}

    def command(self, inp: LaunchInput, *, layout: dict[str, int], user_flags: set[str]) -> list[str]:
        argv = [VLLM, "serve", inp.weights, "--served-model-name", inp.model]
        if TP not in user_flags:
            argv += [TP, str(layout["tensor"])]
        if PP not in user_flags:
            argv += [PP, str(layout["pipeline"])]
        if inp.multi_node:
            argv += [
                "--nnodes", str(inp.nodes),
                "--node-rank", str(inp.rank),
                "--master-addr", inp.leader_addr,
                "--master-port", str(inp.rendezvous_port),
                "--distributed-executor-backend", "mp",
            ]
        if inp.is_leader:
            argv += ["--host", inp.mgmt_addr, "--port", str(inp.http_port)]
        else:
            argv.append("--headless")
        return argv

    def engine_environment(self, inp: LaunchInput) -> dict[str, str]:
        return {"VLLM_HOST_IP": inp.mgmt_addr}
