"""sim: the simulated multi-node engine of ``agent.engines.sim``.

It runs under the agent's own interpreter (``{python}``, which the agent
replaces) and behaves like a real engine's launch sequence: the leader binds
the rendezvous port and serves only once every worker has joined; workers
listen on nothing. Each member states its fabric, so a replica placed across
two fabrics forms and then hangs, as NCCL does.

Its environment is a real engine's (GPUs, NCCL, Gloo), so what a simulated
cluster launches shows exactly what a real one would be given.

A catalog entry sets the sim's performance model with engine args (vLLM's
names where vLLM has the knob: ``--max-num-seqs 64 --num-gpu-blocks-override
2000``). ``SIM_OPTIONS`` is the table of every flag the sim engine's parser
takes, with what its value must be: the catalog refuses, at apply, a flag the
engine does not know and a value it would refuse (the test suite holds this
table against ``agent.engines.sim``'s parser, which this package may not
import).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agent.protocol import WEIGHTS_PATH_ARG

from . import flags
from .base import EngineAdapter, LaunchInput
from .errors import EngineArgsError


@dataclass(frozen=True)
class SimOption:
    dest: str
    kind: str  # "count" (a whole number >= 1), "seconds" (a number >= 0), "switch" (no value), "managed"


SIM_OPTIONS: dict[str, SimOption] = {
    "--max-num-seqs": SimOption("max_num_seqs", "count"),
    "--block-size": SimOption("block_size", "count"),
    "--num-gpu-blocks-override": SimOption("num_gpu_blocks_override", "count"),
    "--max-model-len": SimOption("max_model_len", "count"),
    "--enable-prefix-caching": SimOption("enable_prefix_caching", "switch"),
    "--no-enable-prefix-caching": SimOption("enable_prefix_caching", "switch"),
    "--prefill-overhead": SimOption("prefill_overhead", "seconds"),
    "--prefill-time-per-token": SimOption("prefill_time_per_token", "seconds"),
    "--decode-step-base": SimOption("decode_step_base", "seconds"),
    "--decode-step-per-seq": SimOption("decode_step_per_seq", "seconds"),
    "--token-delay": SimOption("token_delay", "seconds"),
    "--join-timeout": SimOption("join_timeout", "seconds"),
    "--peer-timeout": SimOption("peer_timeout", "seconds"),
}
# agent/engines/sim_model.py's defaults, for the checks that combine flags.
SIM_DEFAULTS = {"block_size": 16, "num_gpu_blocks_override": 25_000, "max_model_len": 32_768}

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
    _table: flags.OptionTable | None = None

    def table(self) -> flags.OptionTable:
        """The sim's own flags, read like an engine's option table (no version: the parser is ours)."""
        if self._table is None:
            options = {name: {"dest": o.dest, "value": "none" if o.kind == "switch" else "required"}
                       for name, o in SIM_OPTIONS.items()}
            for name in self.managed:
                options[name] = {"dest": name[2:].replace("-", "_"), "value": "required"}
            options["--help"] = {"dest": "help", "value": "none"}
            self._table = flags.OptionTable.from_dict({"engine": self.name, "version": "", "options": options})
        return self._table

    def check_args(self, args: list[str], *, nodes: int | None = None, gpus_per_node: int | None = None) -> None:
        """Besides the flags themselves, refuse what the sim engine would exit on at start."""
        values: dict[str, float] = {}
        for item in self.read_args(args):
            option = SIM_OPTIONS[item.name]
            if option.kind == "switch":
                continue
            raw = item.values[0]
            values[option.dest] = _value(item.raw, raw, option.kind)
        settled = {**SIM_DEFAULTS, **values}
        holds = settled["num_gpu_blocks_override"] * settled["block_size"]
        if settled["max_model_len"] > holds:
            raise EngineArgsError(
                f"--max-model-len {settled['max_model_len']:g} is more than the sim's KV cache holds "
                f"(--num-gpu-blocks-override {settled['num_gpu_blocks_override']:g} x --block-size "
                f"{settled['block_size']:g} = {holds:g} tokens); lower --max-model-len or raise the blocks"
            )

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


def _value(flag: str, raw: str, kind: str) -> float:
    if kind == "count":
        try:
            number = int(raw)
        except ValueError:
            number = 0
        if number < 1:
            raise EngineArgsError(f"{flag} {raw}: must be a whole number of at least 1")
        return number
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise EngineArgsError(f"{flag} {raw}: must be a number of seconds, 0 or more (0.0001 is 0.1 ms)")
    return seconds
