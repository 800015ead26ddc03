"""sim: the simulated multi-node engine of ``agent.engines.sim``.

It runs under the agent's own interpreter (``{python}``, which the agent
replaces) and behaves like a real engine's launch sequence: the leader binds
the rendezvous port and serves only once every worker has joined; workers
listen on nothing. Each member states its fabric, so a replica placed across
two fabrics forms and then hangs, as NCCL does.

Its environment is a real engine's (GPUs, NCCL, Gloo), so what a simulated
cluster launches shows exactly what a real one would be given.
"""

from __future__ import annotations

from agent.protocol import WEIGHTS_PATH_ARG

from .base import EngineAdapter, LaunchInput

AGENT_PYTHON = "{python}"  # agent.engine_process.PYTHON_PLACEHOLDER


class SimAdapter(EngineAdapter):
    name = "sim"
    version = None  # its parser is ours; the tests run the adapter's output through it
    health_path = "/health"
    needs_hcas = False  # it speaks no NCCL
    managed = {
        "--rank": "it is the member's rank",
        "--nnodes": "it is the catalog entry's nodes",
        "--rendezvous": "it is the leader's address and rendezvous port",
        "--host": "the leader binds its node's management address",
        "--port": "ports are allocated per node by the scheduler",
        "--model": "it is the catalog entry's name",
        "--fabric": "it is the replica's fabric",
        "--weights": "it is the local path of the catalog entry's managed weights",
    }
    emitted = frozenset(managed)

    def command(self, inp: LaunchInput, *, layout: dict[str, int], user_flags: set[str]) -> list[str]:
        argv = [AGENT_PYTHON, "-m", "agent.engines.sim", "--rank", str(inp.rank), "--nnodes", str(inp.nodes)]
        if inp.multi_node:
            argv += ["--rendezvous", inp.rendezvous]
        if inp.is_leader:
            argv += ["--host", inp.mgmt_addr, "--port", str(inp.http_port)]
        argv += ["--model", inp.model]
        if inp.fabric:
            argv += ["--fabric", inp.fabric]
        if inp.weights == WEIGHTS_PATH_ARG:
            # Managed weights: the agent puts in their local path, and the
            # sim engine refuses to start without them.
            argv += ["--weights", inp.weights]
        return argv
