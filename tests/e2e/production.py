"""The control plane as production runs it: two web, two agent API, two
Celery workers and one beat, on PostgreSQL (the test database) and a Redis of
the test's own (so that nobody else's pub/sub wakes its long-polls), with
real agents spread across both agent API processes.

The workers load ``tests.e2e.paused_worker``: the Celery app plus pause
points a test arms to kill a worker at a known moment (see that module).
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from cli.commands import beat_argv, worker_argv
from cli.simcluster import SimCluster, SimNode
from cli.wait import wait_until
from tests.conftest import Server, mtls_client, server_env
from tests.control_plane import CeleryProcess
from tests.e2e.dependencies import OwnRedis
from tests.e2e.sim import AGENT_TIMINGS, fast_env

# Loopback addresses of these tests' own, so that no other cluster's engines clash with them.
NODES = [
    SimNode("node01", "127.0.9.1", fabric="ib-a", hcas=("mlx5_0", "mlx5_1")),
    SimNode("node02", "127.0.9.2", fabric="ib-a", hcas=("mlx5_0", "mlx5_1")),
    SimNode("node03", "127.0.9.3", fabric="ib-b", hcas=("mlx5_2", "mlx5_3")),
    SimNode("node04", "127.0.9.4", fabric="ib-b", hcas=("mlx5_2", "mlx5_3")),
]


@dataclass
class ProductionSet:
    webs: list[Server]
    apis: list[Server]
    workers: list[CeleryProcess]
    beat: CeleryProcess
    cluster: SimCluster
    token: str
    env: dict[str, str]
    pause_dir: Path
    api_of: dict[str, int] = field(default_factory=dict)  # node name -> index in apis

    def rest(self, method: str, path: str, *, web: int = 0, **kwargs) -> httpx.Response:
        with httpx.Client(headers={"Authorization": f"Token {self.token}"}, timeout=30) as client:
            return client.request(method, f"{self.webs[web].url}/api/v1/{path}", **kwargs)

    def certs(self, name: str) -> tuple[str, str, str]:
        folder = self.cluster.nodes[name].dir
        return str(folder / f"{name}.pem"), str(folder / f"{name}-key.pem"), str(folder / "ca.pem")

    def long_poll(self, name: str, *, api: int, version: int, wait: float = 60.0) -> "LongPoll":
        """A desired-state long-poll of node ``name`` parked on agent API ``api``."""
        return LongPoll(self.apis[api].url, name, self.certs(name), version, wait).start()

    # --- workers -----------------------------------------------------------------

    def start_worker(self, n: int) -> CeleryProcess:
        argv = worker_argv(concurrency=2, hostname=f"worker-{n}-{time.monotonic_ns()}@%h")
        argv[argv.index("llmgw_site")] = "tests.e2e.paused_worker"
        env = {**self.env, "LLMGW_TEST_PAUSE_DIR": str(self.pause_dir)}
        worker = CeleryProcess("worker", argv, env, self.pause_dir.parent / f"worker-{n}.log").start()
        worker.wait_ready(timeout=60)
        if n < len(self.workers):
            self.workers[n] = worker
        else:
            self.workers.append(worker)
        return worker

    def kill_paused_worker(self, point: str, *, timeout: float = 60.0) -> int:
        """Arm ``point``, wait for a worker to pause there, SIGKILL it, start
        a worker in its place (what a service manager does). Returns its pid."""
        paused = self.pause_dir / f"{point}.paused"
        paused.unlink(missing_ok=True)
        (self.pause_dir / point).touch()
        wait_until(lambda: paused.exists() and paused.read_text(), timeout=timeout,
                   message=f"a worker paused at {point}")
        pid = int(paused.read_text())
        (n,) = [i for i, w in enumerate(self.workers) if w.proc.pid == pid]
        self.workers[n].proc.send_signal(signal.SIGKILL)
        self.workers[n].proc.wait(timeout=10)
        self.start_worker(n)
        return pid


@dataclass
class LongPoll:
    url: str
    name: str
    certs: tuple[str, str, str]
    version: int
    wait: float
    answer: dict | None = None
    error: str = ""
    _thread: threading.Thread | None = None

    def start(self) -> "LongPoll":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            with mtls_client(*self.certs, timeout=self.wait + 30) as client:
                response = client.get(f"{self.url}/agent/v1/nodes/{self.name}/desired",
                                      params={"version": self.version, "wait": self.wait})
            response.raise_for_status()
            self.answer = response.json()
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def result(self) -> dict:
        self._thread.join(timeout=self.wait + 40)
        assert self.answer is not None, f"the long-poll of {self.name} got no answer: {self.error}"
        return self.answer


@pytest.fixture
def production_set(agent_api_factory, web_factory, admin_token, pki_dir, tmp_path, settings):
    """start(nodes=NODES, grace=..., **env) -> a running ProductionSet whose
    agents are registered and ready; node i talks to agent API i % 2."""
    from nodes.choices import NodeStatus
    from nodes.models import Node
    from pki.services import bundle_write, cert_issue_client

    redis_server = OwnRedis().start()
    started: list[ProductionSet] = []

    def start(nodes=NODES, *, grace: float = 3.0, api_env: dict[str, str] | None = None,
              **overrides: str) -> ProductionSet:
        env = {**fast_env(grace=grace), "CELERY_BROKER_URL": redis_server.url, "LLMGW_REDIS_URL": redis_server.url,
               **overrides}
        for key in ("LLMGW_NODE_GRACE", "LLMGW_ROUTING_SETTLE", "LLMGW_STOP_GRACE"):
            setattr(settings, key, float(env[key]))
        apis = [agent_api_factory(workers=1, threads=8, **{**env, **(api_env or {})}) for _ in range(2)]
        webs = [web_factory(**env) for _ in range(2)]
        pause_dir = tmp_path / "pause"
        pause_dir.mkdir()
        process_env = server_env(**env)
        beat = CeleryProcess("beat", beat_argv(schedule=str(tmp_path / "beat-schedule")), process_env,
                             tmp_path / "beat.log")
        cluster = SimCluster(base=tmp_path / "sim", env=process_env, agent_url=apis[0].url,
                             agent_timings=AGENT_TIMINGS)
        cluster.base.mkdir(parents=True, exist_ok=True)
        prod = ProductionSet(webs, apis, [], beat, cluster, admin_token, process_env, pause_dir)
        started.append(prod)
        for n in range(2):
            prod.start_worker(n)
        beat.start()
        for i, node in enumerate(nodes):
            prod.api_of[node.name] = i % 2
            cluster.add_node(SimNode(node.name, node.addr, node.gpus, node.fabric, node.hcas),
                             issue_cert=lambda name, out: bundle_write(issued=cert_issue_client(node_id=name),
                                                                       out_dir=out),
                             server=apis[i % 2].url)
            cluster.start_agent(node.name)
        names = [n.name for n in nodes]
        wait_until(lambda: Node.objects.filter(name__in=names, status=NodeStatus.READY).count() == len(names),
                   timeout=60, message="every simulated node to register and be ready")
        return prod

    try:
        yield start
    finally:
        for prod in started:
            prod.cluster.stop()
            for proc in [*prod.workers, prod.beat]:
                proc.stop()
            for server in [*prod.apis, *prod.webs]:
                server.stop()
        redis_server.stop()


def invariants(*, lost: set[str] = frozenset(), failed: set[int] = frozenset()) -> None:
    """What must hold after any fault: no GPU given twice, no replica across
    fabrics, no node declared lost but those in ``lost``, no replica failed
    but those in ``failed``."""
    from core.models import Event
    from nodes.choices import NodeEventKind
    from replicas.choices import MemberState, ReplicaEventKind, ReplicaStatus
    from replicas.models import Member, Replica

    used = [(m.node_id, gpu) for m in Member.objects.exclude(state=MemberState.GONE) for gpu in m.gpus]
    assert len(used) == len(set(used)), f"a GPU given twice: {sorted(used)}"
    for replica in Replica.objects.exclude(status=ReplicaStatus.STOPPED).prefetch_related("members__node__fabrics"):
        fabrics = [{f.pk for f in m.node.fabrics.all()} for m in replica.members.exclude(state=MemberState.GONE)]
        if len(fabrics) > 1:
            assert set.intersection(*fabrics), f"replica {replica.pk} spans fabrics: {fabrics}"
    declared_lost = {e.subject.split("/", 1)[1] for e in Event.objects.filter(kind=NodeEventKind.NODE_STATUS, data__to="lost")}
    assert declared_lost <= set(lost), f"nodes declared lost though they heartbeated: {declared_lost - set(lost)}"
    failed_now = {int(e.subject.split("/", 1)[1]) for e in
                  Event.objects.filter(kind=ReplicaEventKind.REPLICA_STATUS, data__to="failed")}
    assert failed_now <= set(failed), f"healthy replicas failed: {failed_now - set(failed)}"


def ready_count(model: str) -> int:
    from replicas.choices import ReplicaStatus
    from replicas.models import Replica

    return Replica.objects.filter(model__name=model, status=ReplicaStatus.READY, draining=False).count()
