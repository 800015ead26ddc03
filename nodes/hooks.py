"""Where apps built on nodes plug in, registered from their AppConfig.ready().

nodes knows nothing of replicas; replicas needs to hear what nodes hear. These
lists are that seam, explicit and greppable, rather than signals. Every hook
is called with keyword arguments.
"""

from __future__ import annotations

from typing import Any, Callable

# (node=Node, engines=list of engine state dicts) -> None, inside the heartbeat's transaction.
engine_report_handlers: list[Callable[..., None]] = []
# (node=Node, gpu_ids=list of Gpu pks) -> None, inside the heartbeat's
# transaction: GPUs the node stopped reporting (now marked missing).
gpus_vanished_handlers: list[Callable[..., None]] = []
# (node=Node, reasons={Gpu pk: why}) -> None, inside the transaction that
# quarantined those GPUs (nodes.gpus), which holds the node's row.
gpus_quarantined_handlers: list[Callable[..., None]] = []
# (node=Node) -> None, inside the transaction that put a GPU back in service.
gpus_cleared_handlers: list[Callable[..., None]] = []
# (node_name=str) -> None, after the node was marked lost.
node_lost_handlers: list[Callable[..., None]] = []
# (node_name=str, reason=str) -> None, inside the transaction that took the
# node out of draining (an operator uncordoned it), which holds its row.
node_undrained_handlers: list[Callable[..., None]] = []
# (node_name=str) -> list of desired member dicts (agent.protocol.DesiredMember).
desired_member_providers: list[Callable[..., list[dict[str, Any]]]] = []
# () -> {node name: replicas with a member on the node}, for listings.
replica_counters: list[Callable[..., dict[str, int]]] = []
