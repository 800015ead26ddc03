"""The members ``make engine-check`` and the table tests run through the
adapters: every rank of replicas of several shapes, with and without extra
arguments and parallel overrides. Addresses are loopback strings, never
contacted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from replicas.engines import LaunchInput  # noqa: E402

SHAPES = [(1, 1), (1, 8), (2, 4), (2, 8), (4, 8)]

# Arguments a catalog entry plausibly passes, in the engine's own spelling.
EXTRA_ARGS = {
    "vllm": ["--max-model-len", "8192", "--gpu-memory-utilization", "0.9", "--enable-prefix-caching",
             "--max_num_seqs", "256", "--trust-remote-code"],
    "sglang": ["--context-length", "8192", "--mem-fraction-static", "0.85", "--enable-metrics",
               "--trust-remote-code"],
    "sim": ["--token-delay", "0.01"],
}

# (nodes, gpus per node, args): layouts other than the default.
OVERRIDES = {
    "vllm": [
        (1, 8, ["--tensor-parallel-size", "4"]),  # pipeline 2 on one node
        (2, 4, ["--tensor-parallel-size", "8"]),  # tensor parallel across both nodes
        (4, 8, ["--pipeline-parallel-size", "2"]),  # tensor 16
    ],
    "sglang": [
        (2, 8, ["--pp-size", "2"]),  # tensor 8 per stage
        (4, 8, ["--tp-size", "16"]),  # pipeline 2
        (1, 8, ["--tensor-parallel-size", "8"]),  # the long alias
    ],
    "sim": [],
}


def member(engine: str, *, nodes: int, gpus_per_node: int, rank: int, args: list[str] | None = None,
           fabric: str | None = "auto", model: str = "llama-70b") -> LaunchInput:
    if fabric == "auto":
        fabric = "ib-a" if nodes > 1 else None
    first_gpu = 8 - gpus_per_node if gpus_per_node < 8 else 0  # not always 0..n-1
    return LaunchInput(
        model=model,
        engine=engine,
        weights=f"/models/{model}",
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        rank=rank,
        mgmt_addr=f"127.0.1.{rank + 1}",
        mgmt_interface="ens1f0",
        gpus=list(range(first_gpu, first_gpu + gpus_per_node)),
        leader_addr="127.0.1.1",
        http_port=20000,
        rendezvous_port=20001 if nodes > 1 else None,
        fabric=fabric,
        hcas=(["mlx5_0", "mlx5_1"] if fabric == "ib-a" else ["mlx5_2", "mlx5_3"]) if fabric else [],
        args=list(args or []),
        env={"HF_HUB_OFFLINE": "1"},
        worker_port=20002 if rank > 0 else None,
    )


def members(engine: str) -> Iterator[LaunchInput]:
    for nodes, gpus in SHAPES:
        for args in ([], EXTRA_ARGS[engine]):
            for rank in range(nodes):
                yield member(engine, nodes=nodes, gpus_per_node=gpus, rank=rank, args=args)
        if nodes == 1:  # a single-node replica on a node that has a fabric
            yield member(engine, nodes=nodes, gpus_per_node=gpus, rank=0, fabric="ib-b")
    for nodes, gpus, args in OVERRIDES[engine]:
        for rank in range(nodes):
            yield member(engine, nodes=nodes, gpus_per_node=gpus, rank=rank, args=args)
