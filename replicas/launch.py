"""From a placed member to what its agent runs: the engine adapters of
``replicas.engines`` fed with the node's inventory."""

from __future__ import annotations

from typing import Any

from agent.protocol import WEIGHTS_PATH_ARG
from nodes.models import Node

from .engines import LaunchInput, launch_spec
from .models import CatalogEntry, Member


def member_launch(
    *,
    model: CatalogEntry,
    member: Member,
    node: Node,
    fabric: str | None,
    hcas: list[str],
    leader: Node,
    http_port: int,
    rendezvous_port: int | None,
    worker_port: int | None = None,
) -> dict[str, Any]:
    spec = launch_spec(
        LaunchInput(
            model=model.name,
            engine=model.engine,
            # Managed weights: the agent puts their local path in (agent.weights).
            weights=WEIGHTS_PATH_ARG if model.manifest else model.weights,
            nodes=model.nodes,
            gpus_per_node=model.gpus_per_node,
            args=list(model.args or []),
            env=dict(model.env or {}),
            rank=member.rank,
            mgmt_addr=node.mgmt_addr,
            mgmt_interface=node.mgmt_interface,
            fabric=fabric,
            hcas=sorted(hcas) if fabric else [],
            gpus=list(member.gpus),
            leader_addr=leader.mgmt_addr,
            http_port=http_port,
            rendezvous_port=rendezvous_port,
            worker_port=worker_port,
        )
    )
    ports = dict(spec.ports)
    if member.rank == 0:
        # Workers reach the leader here; shown on the leader for the operator.
        ports.setdefault("http", http_port)
        if rendezvous_port:
            ports.setdefault("rendezvous", rendezvous_port)
    return {
        "argv": list(spec.argv),
        "env": dict(spec.env),
        "ports": ports,
        "serves_http": spec.serves_http,
        "health_url": spec.health_url(node.mgmt_addr),
    }
