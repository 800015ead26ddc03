"""Every agent at once, for ``bench/heartbeats.py --cold-start``.

A cold start: every node opens its connection and sends its first heartbeat
(registration: the node, its GPUs, HCAs and fabrics are written) with
``concurrency`` requests in flight, as agents started together would. Then
the agent API is restarted and every agent reconnects at once and heartbeats
again; last, the lost-node sweep runs and must declare no node lost.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from _tls_load import LoadGenerator, PhaseResult, SimNode


def _registered(node: SimNode, body: bytes, result: PhaseResult) -> None:
    if json.loads(body).get("status") != "ready":
        result.error("not ready")


async def cold_start(gen: LoadGenerator, nodes: list[SimNode], *, concurrency: int,
                     restart: Callable[[], None], measure) -> dict:
    """``measure(phase, kind, coro)`` runs and reports a phase; ``restart``
    stops the agent API and starts it again (blocking)."""
    started = time.perf_counter()
    await measure(f"cold: connect (c={concurrency})", "cold connect", gen.connect_all(nodes, concurrency=concurrency))
    await measure(
        f"cold: register (c={concurrency})", "cold register",
        gen.closed_loop(nodes, kind="heartbeat", concurrency=concurrency, once=True, check=_registered,
                        name="register"),
    )
    registered_in = time.perf_counter() - started
    t0 = time.perf_counter()
    await asyncio.get_running_loop().run_in_executor(None, restart)
    restarted_in = time.perf_counter() - t0
    started = time.perf_counter()
    await measure(f"restart: reconnect (c={concurrency})", "restart connect",
                  gen.connect_all(nodes, concurrency=concurrency))
    await measure(f"restart: heartbeat (c={concurrency})", "restart heartbeat",
                  gen.closed_loop(nodes, kind="heartbeat", concurrency=concurrency, once=True, name="heard"))
    return {"registered_in": registered_in, "restarted_in": restarted_in,
            "heard_again_in": time.perf_counter() - started}


def sweep_and_count(nodes: list[SimNode]) -> dict:
    """Run the lost-node sweep once (as beat would) and count the nodes by status."""
    from django.db.models import Count

    from nodes.sweep import nodes_sweep_lost

    declared = nodes_sweep_lost()
    from nodes.models import Node

    by_status = dict(Node.objects.values_list("status").annotate(n=Count("pk")))
    return {"declared_lost_by_sweep": len(declared or []), "by_status": by_status, "nodes": len(nodes)}
