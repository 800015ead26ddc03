"""The simulated cluster the cluster benchmarks run on (failover, rollout,
weights, autoscale, routing): a database of their own, the control plane's
processes as ``llmgw up`` starts them, and simulated nodes with real agents.

    os.environ.update(env)                       # the benchmark's settings
    database_ready(pg=..., db_name=..., redis_url=...)
    cluster = BenchCluster.start(base, webs=1)   # agent API, worker, beat, web
    try:
        cluster.start_nodes(nodes)               # until every one is ready
        ...                                      # cluster.web_ports, .webs, SimCluster's kill_node, ...
    finally:
        cluster.stop()                           # every process, its children with it

Every process gets a session of its own (``cli.processes``): stopping one
signals its whole group, so gunicorn's and uvicorn's workers and an agent's
engines go with it. Ports are whatever the kernel hands out on 127.0.0.1
(the engines' come from LLMGW_PORT_MIN..LLMGW_PORT_MAX, as always).
"""

from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from cli.simcluster import SimCluster, SimNode

HOST = "127.0.0.1"
# Short enough that a lost or restarted node is seen within seconds.
AGENT_TIMINGS = {"heartbeat_interval": "1s", "reconnect_base": "200ms", "reconnect_max": "2s",
                 "supervisor.health_interval": "200ms", "supervisor.stop_timeout": "3s"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def recreate_database(server: str, name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def database_ready(*, pg: str, db_name: str, redis_url: str) -> None:
    """The benchmark's database dropped and created again, Django set up on
    it, its Redis database emptied, the migrations run. ``os.environ`` already
    holds the benchmark's settings (DATABASE_URL naming ``db_name`` on ``pg``)."""
    recreate_database(pg, db_name)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    import django

    django.setup()
    import redis
    from django.core.management import call_command

    redis.Redis.from_url(redis_url).flushdb()
    call_command("migrate", verbosity=0)


@dataclass
class BenchCluster(SimCluster):
    """A SimCluster whose control plane runs: the agent API (mTLS, one
    worker), a Celery worker and beat, and ``len(web_ports)`` web processes
    with the gateway (named ``web``, or ``web0``, ``web1``, ... when more
    than one), each logging to ``<base>/<name>.log``."""

    web_ports: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, base: Path, *, webs: int = 0, agent_timings: dict | None = None) -> BenchCluster:
        """Needs Django set up (``database_ready``); the child processes get
        ``os.environ`` as it is now."""
        from cli.commands import web_argv
        from cli.up import process_commands
        from pki.services import pki_ensure_agent_listener

        pki_ensure_agent_listener(hosts=["localhost"], ips=[HOST])
        agent_port = free_port()
        cluster = cls(base=base, env=dict(os.environ), agent_url=f"https://{HOST}:{agent_port}",
                      agent_timings=dict(AGENT_TIMINGS if agent_timings is None else agent_timings),
                      web_ports=[free_port() for _ in range(webs)])
        commands = process_commands(host=HOST, web_port=0, agent_port=agent_port, agent_workers=1)
        try:
            for name in ("agent-api", "worker", "beat"):
                cluster.processes.start(name, commands[name])
            for name, port in zip(cluster.web_names, cluster.web_ports):
                cluster.processes.start(name, web_argv(host=HOST, port=port))
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @property
    def web_names(self) -> list[str]:
        return ["web"] if len(self.web_ports) == 1 else [f"web{i}" for i in range(len(self.web_ports))]

    @property
    def webs(self) -> list[subprocess.Popen]:
        return [self.processes.procs[name] for name in self.web_names]

    @property
    def gateways(self) -> list[str]:
        return [f"http://{HOST}:{port}" for port in self.web_ports]

    def start_nodes(self, nodes: list[SimNode], *, timeout: float = 60) -> None:
        """Each node's certificate and kit, its agent started; returns when
        all of them are ready."""
        from cli.wait import wait_until
        from nodes.choices import NodeStatus
        from nodes.models import Node
        from pki.services import bundle_write, cert_issue_client

        for node in nodes:
            self.add_node(node, issue_cert=lambda name, out: bundle_write(issued=cert_issue_client(node_id=name),
                                                                          out_dir=out))
            self.start_agent(node.name)
        wait_until(lambda: Node.objects.filter(status=NodeStatus.READY).count() == len(nodes), timeout=timeout,
                   message=f"{len(nodes)} ready nodes")
