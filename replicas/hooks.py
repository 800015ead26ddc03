"""Where apps built on replicas plug in, registered from their AppConfig.ready()
(as ``nodes.hooks`` is for replicas).

replicas knows nothing of request routing; a stopping replica still waits
until no request is in flight on it. The routing app answers that here.
"""

from __future__ import annotations

from typing import Callable

# (replica_id=int) -> int: requests in flight on the replica, plus one for
# every router that may still send it one. Summed over the providers.
#
# No provider means no routing app is installed: nothing sends the replica
# requests, so 0 is the truth. A routing app that is installed registers its
# provider in its ready(), importing it at the top of its modules, so a
# provider that fails to load stops the process at start rather than
# reading as "nothing in flight".
inflight_providers: list[Callable[..., int]] = []


def replica_inflight(*, replica_id: int) -> int:
    return sum(provider(replica_id=replica_id) for provider in inflight_providers)


# () -> {model name: (in flight, held, last request at (unix) or None)}: the
# requests of every gateway process of the deployment, summed by the provider.
# Summed again over the providers. The autoscaler's main signal.
load_providers: list[Callable[[], dict[str, tuple[int, int, float | None]]]] = []


def gateway_load() -> dict[str, tuple[int, int, float | None]]:
    total: dict[str, tuple[int, int, float | None]] = {}
    for provider in load_providers:
        for model, (inflight, held, last) in provider().items():
            was = total.get(model, (0, 0, None))
            lasts = [x for x in (was[2], last) if x is not None]
            total[model] = (was[0] + inflight, was[1] + held, max(lasts) if lasts else None)
    return total


# (replicas={replica id: engine base URL}) -> {replica id: {"waiting": int,
# "running": int, "kv_usage": float}}: the engines' own load. The first
# provider answers; without one the autoscaler reads the engines' /metrics
# itself (replicas.autoscaling.signals), so that a routing app which already
# scrapes them can hand its readings over instead.
engine_load_providers: list[Callable[..., dict[int, dict]]] = []
