"""Rollouts end to end: real agents and sim engines, the gateway under steady
load, a change of a model's launch applied while it serves.

The broken revision is an argument the sim engine refuses at start (argparse
exits 2 on a value that is not a float), not an unknown flag: the catalog may
refuse unknown sim flags at apply.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from cli.wait import wait_until
from replicas import rollout
from replicas.catalog import catalog_apply
from replicas.choices import ReplicaStatus, RolloutStatus
from replicas.models import Member, Replica, Rollout
from tests.e2e.sim import fast_env
from tests.e2e.test_drain_traffic import Traffic

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MODEL = "small"
NEW_ARGS = ["--token-delay", "0.005"]
# A launch the catalog accepts (any value of an allowed variable) and the
# engine refuses at start, as vLLM does an unknown attention backend.
BROKEN_ENV = {"VLLM_ATTENTION_BACKEND": "NO_SUCH_BACKEND"}
AGENT = {"supervisor.restart_backoff": "200ms", "supervisor.restart_backoff_max": "1s"}


class ReadyWatch:
    """The model's ready replicas, sampled every 50 ms while a rollout runs."""

    def __init__(self, model: str = MODEL) -> None:
        self.model, self.samples = model, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        from django.db import connection
        try:
            while not self._stop.is_set():
                self.samples.append(Replica.objects.filter(model__name=self.model, status=ReplicaStatus.READY).count())
                time.sleep(0.05)
        finally:
            connection.close()

    def __enter__(self) -> "ReadyWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _start(sim_cluster, web_factory, entry: dict, **env):
    cluster = sim_cluster(agent_timings=AGENT, **env)
    web = web_factory(LLMGW_GATEWAY_OPEN="1", **fast_env(), **env)
    catalog_apply(entries=[entry])
    wait_until(lambda: Replica.objects.filter(model__name=entry["name"], status=ReplicaStatus.READY).count()
               == entry["replicas"], timeout=60, message="ready replicas")
    wait_until(lambda: httpx.get(f"{web.url}/v1/models", timeout=5).json()["data"], timeout=10,
               message="the gateway to route the model")
    return cluster, web


def _rollout_ends(status=RolloutStatus.DONE, timeout=120.0):
    def ended():
        last = Rollout.objects.first()
        return last is not None and last.status == status
    wait_until(ended, timeout=timeout, message=f"the rollout to be {status} "
               f"({(Rollout.objects.first() or Rollout()).waiting_for})")
    return Rollout.objects.first()


def _ready_argvs(model: str = MODEL) -> list[list[str]]:
    return [m.argv for m in Member.objects.filter(replica__model__name=model, replica__status=ReplicaStatus.READY)]


def _all_on(revision: int, wanted: int, model: str = MODEL) -> bool:
    ready = list(Replica.objects.filter(model__name=model, status=ReplicaStatus.READY).select_related("revision"))
    return len(ready) == wanted and {r.revision.number for r in ready} == {revision}


def test_args_change_rolls_every_replica_under_load_pause_resume_undo(sim_cluster, web_factory):
    entry = {"name": MODEL, "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 4, "replicas": 4}
    cluster, web = _start(sim_cluster, web_factory, entry)
    with Traffic(web.url, threads=4) as traffic, ReadyWatch() as watch:
        traffic.wait_served(10, what="before the change")
        catalog_apply(entries=[{**entry, "args": NEW_ARGS}])
        # Pause once the first replacement is ready: nothing new starts.
        wait_until(lambda: (Rollout.objects.first() or Rollout()).updated >= 1, timeout=60,
                   message="the first replacement ready")
        rollout.rollout_pause(name=MODEL, actor="tests")
        # Let what was under way finish: no replacement pending or starting, no
        # original marked to go (still ready while its requests finish) or stopping.
        wait_until(lambda: not Replica.objects.filter(model__name=MODEL, status__in=[
            ReplicaStatus.PENDING, ReplicaStatus.SCHEDULED, ReplicaStatus.STAGING, ReplicaStatus.STARTING,
            ReplicaStatus.STOPPING]).exists() and not Replica.objects.filter(
            model__name=MODEL, status=ReplicaStatus.READY, draining=True).exists(),
            timeout=60, message="what the rollout had under way to finish")
        held = sorted(Replica.objects.filter(model__name=MODEL, status=ReplicaStatus.READY)
                      .values_list("revision__number", flat=True))
        time.sleep(4)
        assert sorted(Replica.objects.filter(model__name=MODEL, status=ReplicaStatus.READY)
                      .values_list("revision__number", flat=True)) == held
        assert 1 in held, "paused before the end"
        rollout.rollout_resume(name=MODEL, actor="tests")
        done = _rollout_ends()
        wait_until(lambda: _all_on(2, 4), timeout=30, message="every ready replica on revision 2")
        traffic.wait_served(10, after=time.monotonic(), what="after the rollout")
    assert all("--token-delay" in argv and "0.005" in argv for argv in _ready_argvs())
    assert len(traffic.results) > 50, "too little traffic to mean anything"
    assert traffic.failures() == []
    assert min(watch.samples) >= 4, f"ready replicas dropped below the wanted count: {sorted(set(watch.samples))}"
    assert done.updated == 4
    # Undo: back to revision 1's argv, itself a rollout.
    model, undo = rollout.rollout_undo(name=MODEL, actor="tests")
    assert undo is not None and model.revision == 3
    _rollout_ends()
    wait_until(lambda: _all_on(3, 4), timeout=30, message="every ready replica on revision 3")
    assert all("--token-delay" not in argv for argv in _ready_argvs())


def test_no_spare_capacity_keeps_at_most_max_unavailable_down(sim_cluster, web_factory):
    entry = {"name": MODEL, "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 8, "replicas": 4,
             "max_unavailable": 1}
    cluster, web = _start(sim_cluster, web_factory, entry)
    with Traffic(web.url, threads=4) as traffic, ReadyWatch() as watch:
        traffic.wait_served(10, what="before the change")
        catalog_apply(entries=[{**entry, "args": NEW_ARGS}])
        _rollout_ends(timeout=180)
        wait_until(lambda: _all_on(2, 4), timeout=30, message="every ready replica on revision 2")
    assert traffic.failures() == []
    assert min(watch.samples) >= 3, sorted(set(watch.samples))
    assert min(watch.samples) == 3, "with no room, one was down at a time"
    said = Rollout.objects.first().log
    assert any("no room to surge" in line for line in said), said


def test_a_broken_revision_stops_after_the_bound_with_the_old_replicas_serving(sim_cluster, web_factory):
    entry = {"name": MODEL, "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 4, "replicas": 2}
    env = {"LLMGW_ENGINE_START_ATTEMPTS": "2", "LLMGW_ROLLOUT_MAX_FAILURES": "2"}
    cluster, web = _start(sim_cluster, web_factory, entry, **env)
    old = set(Replica.objects.filter(status=ReplicaStatus.READY).values_list("pk", flat=True))
    with Traffic(web.url, threads=2) as traffic:
        traffic.wait_served(5, what="before the change")
        catalog_apply(entries=[{**entry, "env": BROKEN_ENV}])
        failed = _rollout_ends(RolloutStatus.FAILED, timeout=120)
        traffic.wait_served(10, after=time.monotonic(), what="after the rollout failed")
    assert traffic.failures() == []
    assert "2 replica(s) of the new revision failed before becoming ready" in failed.status_reason
    assert "Invalid attention backend: 'NO_SUCH_BACKEND'" in failed.status_reason, failed.status_reason
    assert "failed at start 2 times (exited with status 2)" in failed.status_reason
    assert set(Replica.objects.filter(status=ReplicaStatus.READY).values_list("pk", flat=True)) == old
    time.sleep(3)  # nothing more of the broken revision is tried
    assert not Replica.objects.filter(revision__number=2).exclude(status=ReplicaStatus.STOPPED).exists()
    assert not Member.objects.filter(replica__model__name=MODEL, replica__status=ReplicaStatus.READY,
                                     env__has_key="VLLM_ATTENTION_BACKEND").exists()


def test_a_multi_node_model_rolls_within_its_fabric(sim_cluster, web_factory):
    entry = {"name": MODEL, "engine": "sim", "model": "/m", "nodes": 2, "gpus_per_node": 4, "replicas": 2}
    cluster, web = _start(sim_cluster, web_factory, entry)
    with Traffic(web.url, threads=2) as traffic, ReadyWatch() as watch:
        traffic.wait_served(5, what="before the change")
        catalog_apply(entries=[{**entry, "args": NEW_ARGS}])
        _rollout_ends(timeout=180)
        wait_until(lambda: _all_on(2, 2), timeout=30, message="every ready replica on revision 2")
    assert traffic.failures() == []
    assert min(watch.samples) >= 2, sorted(set(watch.samples))
    for replica in Replica.objects.filter(status=ReplicaStatus.READY).select_related("fabric"):
        members = list(replica.members.select_related("node").prefetch_related("node__fabrics"))
        assert len(members) == 2
        assert all(replica.fabric.name in {f.name for f in m.node.fabrics.all()} for m in members), replica
        assert all("0.005" in m.argv for m in members)
