"""A simulated cluster for end-to-end tests: real agents and sim engines,
a real agent API, Celery worker and beat, on PostgreSQL and Redis, with
clocks shortened by configuration."""

from __future__ import annotations

import pytest

from cli.simcluster import SEEDS_NODES, SimCluster, SimNode
from cli.wait import wait_until
from tests.conftest import server_env
from tests.control_plane import control_plane_env

GRACE = 3.0
AGENT_TIMINGS = {
    "heartbeat_interval": "1s",
    "reconnect_base": "200ms",
    "reconnect_max": "2s",
    "supervisor.health_interval": "300ms",
    "supervisor.stop_timeout": "3s",
}


def fast_env(*, grace: float = GRACE) -> dict[str, str]:
    env = control_plane_env(grace=grace, sweep=0.5)
    env.update(
        LLMGW_HEARTBEAT_INTERVAL="1",
        LLMGW_RECONCILE_INTERVAL="1",
        LLMGW_ROUTING_SETTLE="0.5",
        LLMGW_STOP_GRACE="10",
        LLMGW_DEAF_AFTER="5",
    )
    return env


@pytest.fixture
def sim_cluster(agent_api_factory, celery_factory, client_cert, tmp_path, settings):
    """start(nodes=SEEDS_NODES, grace=GRACE, **settings) -> a SimCluster whose
    agents are running and registered; ``settings`` override the control
    plane's environment (LLMGW_RECONCILE_INTERVAL="600", ...)."""
    from nodes.choices import NodeStatus
    from nodes.models import Node
    from pki.services import bundle_write, cert_issue_client

    clusters: list[SimCluster] = []

    def issue(name, out):
        bundle_write(issued=cert_issue_client(node_id=name), out_dir=out)

    def start(nodes=SEEDS_NODES, *, grace: float = GRACE, agent_timings=None, **overrides: str) -> SimCluster:
        env = {**fast_env(grace=grace), **overrides}
        for key in ("LLMGW_NODE_GRACE", "LLMGW_ROUTING_SETTLE", "LLMGW_STOP_GRACE"):
            setattr(settings, key, float(env[key]))
        api = agent_api_factory(workers=1, threads=8, **env)
        celery_factory("worker", **env).wait_ready()
        celery_factory("beat", **env)
        cluster = SimCluster(base=tmp_path / "sim", env=server_env(**env), agent_url=api.url,
                             agent_timings={**AGENT_TIMINGS, **(agent_timings or {})})
        cluster.base.mkdir(parents=True, exist_ok=True)
        cluster.api = api
        clusters.append(cluster)
        for node in nodes:
            cluster.add_node(SimNode(node.name, node.addr, node.gpus, node.fabric, node.hcas), issue_cert=issue)
            cluster.start_agent(node.name)
        names = [n.name for n in nodes]
        wait_until(
            lambda: Node.objects.filter(name__in=names, status=NodeStatus.READY).count() == len(names),
            timeout=30, message="every simulated node to register and be ready",
        )
        return cluster

    yield start
    for cluster in clusters:
        cluster.stop()
