"""The control plane's own dependencies go away for 20 s and come back.

A whole control plane (web, agent API, worker, beat) on a Redis and a
PostgreSQL of this test's own, real agents running real sim engines. Redis
goes away, then PostgreSQL; after each, the invariants hold: no node that was
heartbeating declared lost, no healthy replica failed, no GPU given twice,
every wanted replica ready, the operator API answered 503 (never 500) while
the dependency was away, and an Event records the outage.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from cli.simcluster import SimCluster, SimNode
from cli.wait import wait_until
from tests.conftest import REPO, server_env
from tests.control_plane import wait_for_a_sweep_that_could_blame
from tests.e2e.dependencies import own_services  # noqa: F401 - fixture
from tests.e2e.sim import AGENT_TIMINGS, fast_env

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

OUTAGE = 20.0
# Beat and the worker reconnect to the broker with a backoff of their own.
RECOVERY = 45.0
NODES = [SimNode(f"node0{i}", f"127.0.1.{i}", gpus=4, fabric=None) for i in (1, 2, 3)]
CATALOG = [{"name": "small", "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 2, "replicas": 2}]


def manage(env: dict[str, str], code: str) -> str:
    done = subprocess.run([sys.executable, "manage.py", "shell", "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""  # after the shell's own notices


class OperatorProbe:
    """GET /api/v1/nodes/ twice a second, keeping every answer's status."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token
        self.answers: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(headers={"Authorization": f"Token {self.token}"}, timeout=15) as client:
            while not self._stop.is_set():
                try:
                    r = client.get(f"{self.url}/api/v1/nodes/")
                    said = r.json().get("dependency", "") if r.status_code == 503 else ""
                    self.answers.append((time.time(), r.status_code, said or r.text[:300]))
                except httpx.HTTPError as exc:
                    self.answers.append((time.time(), 0, str(exc)))
                self._stop.wait(0.5)

    def between(self, start: float, end: float) -> list[tuple[float, int, str]]:
        return [a for a in self.answers if start <= a[0] <= end]

    def __enter__(self) -> "OperatorProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=20)


def test_redis_then_postgresql_gone_for_20s_and_back(
    own_services, agent_api_factory, celery_factory, web_factory, client_cert, tmp_path
):
    from pki.services import bundle_write, cert_issue_client

    redis_server, postgres = own_services
    env = fast_env()
    env.update(CELERY_BROKER_URL=redis_server.url, LLMGW_REDIS_URL=redis_server.url, DATABASE_URL=postgres.url)
    process_env = server_env(**env)
    subprocess.run([sys.executable, "manage.py", "migrate", "--no-input", "-v", "0"], cwd=REPO, env=process_env,
                   check=True, timeout=300)
    token = manage(process_env, "from django.contrib.auth import get_user_model; "
                   "from accounts.services import token_create; "
                   "u = get_user_model().objects.create_superuser('admin', '', 'pw-for-tests'); "
                   "print(token_create(user=u).token)")

    api = agent_api_factory(workers=1, threads=8, **env)
    celery_factory("worker", **env).wait_ready()
    celery_factory("beat", **env)
    web = web_factory(**env)
    cluster = SimCluster(base=tmp_path / "sim", env=process_env, agent_url=api.url, agent_timings=AGENT_TIMINGS)
    cluster.base.mkdir(parents=True, exist_ok=True)
    try:
        for node in NODES:
            cluster.add_node(node, issue_cert=lambda name, out: bundle_write(
                issued=cert_issue_client(node_id=name), out_dir=out))
            cluster.start_agent(node.name)
        names = [n.name for n in NODES]
        wait_until(lambda: postgres.query("SELECT count(*) FROM nodes_node WHERE status = 'ready'")[0][0] == 3,
                   timeout=60, message="three ready nodes")
        manage(process_env, f"from replicas.catalog import catalog_apply; catalog_apply(entries={CATALOG!r})")
        wait_until(lambda: len(ready_replicas(postgres)) == 2, timeout=90, message="two ready replicas")
        replicas = ready_replicas(postgres)

        with OperatorProbe(web.url, token) as probe:
            # --- Redis away -------------------------------------------------------
            down = time.time()
            redis_server.stop()
            time.sleep(OUTAGE / 2)  # the scenario: halfway through the outage, the operator asks
            ctl = ctl_nodes(web.url, token)
            time.sleep(OUTAGE / 2)
            redis_server.start()
            back = time.time()
            assert ctl.returncode == 1 and "503: the control plane is up, but its redis is down" in ctl.stderr, ctl
            outage_recorded(postgres, "redis", down)
            settled(postgres, env, cluster, names, replicas)
            answered_503_never_500(probe.between(down + 3, back - 1), "redis")

            # --- PostgreSQL away ----------------------------------------------------
            down = time.time()
            postgres.stop()
            time.sleep(OUTAGE)  # the scenario: PostgreSQL stays away this long
            postgres.start()
            back = time.time()
            outage_recorded(postgres, "database", down)
            settled(postgres, env, cluster, names, replicas)
            answered_503_never_500(probe.between(down + 3, back - 1), "database")
        assert not [a for a in probe.answers if a[1] >= 500 and a[1] != 503], "the operator API answered 500"
        for name in names:
            log = (cluster.nodes[name].dir / "agent.log").read_text()
            # Heartbeats were answered throughout, from the database or from the agent API's last copy.
            assert "cannot serve this request" not in log, f"{name}'s heartbeats were refused"
    finally:
        cluster.stop()


def ready_replicas(postgres) -> set[int]:
    return {row[0] for row in postgres.query("SELECT id FROM replicas_replica WHERE status = 'ready'")}


def ctl_nodes(url: str, token: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LLMGW_URL=url, LLMGW_TOKEN=token)
    return subprocess.run([sys.executable, "-m", "cli", "ctl", "nodes"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def outage_recorded(postgres, dependency: str, down: float) -> None:
    def recorded():
        try:
            rows = postgres.query(
                "SELECT data FROM nodes_event WHERE kind = 'control_plane' AND subject = %s", f"dependency/{dependency}"
            )
        except Exception:  # noqa: BLE001 - PostgreSQL itself may still be starting
            return False
        return [r[0] for r in rows if r[0]["back_at"] > down]

    wait_until(recorded, timeout=RECOVERY, message=f"an Event recording the outage of {dependency}")
    (data,) = recorded()
    assert OUTAGE - 3 <= data["seconds"] <= OUTAGE + 15, data


def settled(postgres, env: dict[str, str], cluster: SimCluster, names: list[str], replicas: set[int]) -> None:
    # A sweep has run, after the outage, that would have declared lost a node
    # unheard since it ended: only then does finding none lost mean something.
    wait_for_a_sweep_that_could_blame(env, silent_since=time.time(), timeout=RECOVERY,
                                      clock=lambda: own_clock(postgres))
    lost = postgres.query("SELECT subject, message FROM nodes_event WHERE kind = 'node.status' "
                          "AND data->>'to' = 'lost'")
    assert not lost, f"nodes declared lost though they heartbeated: {lost}"
    assert postgres.query("SELECT count(*) FROM nodes_node WHERE status = 'ready'")[0][0] == len(names)
    failed = postgres.query("SELECT subject, message FROM nodes_event WHERE kind = 'replica.status' "
                            "AND data->>'to' = 'failed'")
    assert not failed, f"healthy replicas failed: {failed}"
    wait_until(lambda: ready_replicas(postgres) == replicas, timeout=RECOVERY, message="the same replicas ready")
    used = [(node, gpu) for node, gpus in postgres.query(
        "SELECT node_id, gpus FROM replicas_member WHERE state <> 'gone'") for gpu in gpus]
    assert len(used) == len(set(used)), f"a GPU given twice: {used}"
    for name in names:
        assert cluster.nodes[name].proc.poll() is None, f"the agent of {name} died"


def own_clock(postgres) -> tuple[float | None, float | None, bool]:
    """The ControlPlaneClock row of this test's own PostgreSQL (see tests.control_plane)."""
    rows = postgres.query("SELECT extract(epoch FROM last_sweep_at), extract(epoch FROM heard_since), "
                          "holding_since IS NOT NULL FROM nodes_controlplaneclock WHERE id = 1")
    if not rows:
        return None, None, False
    last, heard, holding = rows[0]
    return (float(last) if last is not None else None, float(heard) if heard is not None else None, bool(holding))


def answered_503_never_500(answers: list[tuple[float, int, str]], dependency: str) -> None:
    codes = [a[1] for a in answers]
    assert codes, "no operator API answer during the outage"
    assert 500 not in codes, [a for a in answers if a[1] == 500][:2]
    unavailable = [a for a in answers if a[1] == 503]
    assert unavailable, f"no 503 while {dependency} was away: {codes}"
    assert all(a[2] == dependency for a in unavailable), unavailable[:2]
