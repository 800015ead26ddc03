"""Where apps built on nodes plug in, registered from their AppConfig.ready().

nodes knows nothing of replicas; replicas needs to hear what nodes hear. These
lists are that seam, explicit and greppable, rather than signals.
"""

from __future__ import annotations

from typing import Any, Callable

# (node, engines reported by its agent) -> None, inside the heartbeat's transaction.
engine_report_handlers: list[Callable[..., None]] = []
# (node name) -> None, after the node was marked lost.
node_lost_handlers: list[Callable[..., None]] = []
# (node name, version) -> list of desired member dicts (agent.protocol.DesiredMember).
desired_member_providers: list[Callable[..., list[dict[str, Any]]]] = []
# (node name) -> int: replicas with a member on the node, for listings.
replica_counters: list[Callable[..., dict[str, int]]] = []
