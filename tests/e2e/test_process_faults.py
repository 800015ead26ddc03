"""Processes of the control plane killed at the worst moment, on the
production process set (tests/e2e/production.py): a worker SIGKILLed in the
middle of a reconcile, of a drain step and of a rebuild (each at a pause
point of tests/e2e/paused_worker.py, inside the step's transaction, holding
its locks), beat killed and restarted, an agent API killed with long-polls
parked. After each: no GPU given twice, no replica across fabrics, no node
declared lost that was heartbeating, no healthy replica failed, every wanted
replica ready again within a bound."""

from __future__ import annotations

import os
import signal
import time

import pytest

from cli.simcluster import SimNode
from cli.wait import wait_until
from nodes.choices import NodeStatus
from nodes.models import ControlPlaneClock, Node
from replicas.choices import DrainStatus, MemberState, ReplicaStatus
from replicas.models import Drain, GpuAllocation, Member, Replica
from tests.control_plane import wait_for_a_sweep_that_could_blame
from tests.e2e.production import NODES, invariants, production_set, ready_count  # noqa: F401 - fixture

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# Four nodes of 4 GPUs, a model of one whole node: two replicas leave two nodes free.
SMALL_NODES = [SimNode(n.name, n.addr, 4, n.fabric, n.hcas) for n in NODES]
MODEL = {"name": "small", "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 4, "replicas": 2}
BOUND = 90  # seconds for every wanted replica to be ready again


def started(production_set, **env):
    prod = production_set(SMALL_NODES, **env)
    applied = prod.rest("POST", "catalog/apply/", json={"models": [MODEL]})
    assert applied.status_code == 200, applied.text
    wait_until(lambda: ready_count("small") == 2, timeout=BOUND, message="two ready replicas")
    return prod


def scale(prod, replicas: int, *, web: int = 1) -> None:
    answer = prod.rest("POST", "models/small/scale/", web=web, json={"replicas": replicas})
    assert answer.status_code == 200, answer.text


def allocations_consistent() -> None:
    """Every GPU allocation belongs to a member that holds that many GPUs."""
    held = sum(len(m.gpus) for m in Member.objects.exclude(state=MemberState.GONE))
    assert GpuAllocation.objects.count() <= held, (GpuAllocation.objects.count(), held)


def test_worker_killed_in_the_middle_of_a_reconcile(production_set):
    prod = started(production_set)
    scale(prod, 3)
    prod.kill_paused_worker("reconcile")
    wait_until(lambda: ready_count("small") == 3, timeout=BOUND, message="three ready replicas")
    invariants()
    allocations_consistent()
    assert Replica.objects.exclude(status__in=[ReplicaStatus.READY, ReplicaStatus.STOPPED]).count() == 0


def test_worker_killed_in_the_middle_of_a_drain_step(production_set):
    prod = started(production_set)
    node = Member.objects.filter(replica__status=ReplicaStatus.READY).select_related("node").first().node.name
    (prod.pause_dir / "drain").touch()
    answer = prod.rest("POST", "drains/", json={"node": node})
    assert answer.status_code == 201, answer.text
    prod.kill_paused_worker("drain")
    wait_until(lambda: Drain.objects.get(pk=answer.json()["id"]).status == DrainStatus.DONE, timeout=BOUND,
               message=f"the drain of {node} done")
    wait_until(lambda: ready_count("small") == 2, timeout=BOUND, message="two ready replicas")
    assert not Member.objects.filter(node__name=node).exclude(state=MemberState.GONE).exists()
    invariants()
    allocations_consistent()


def test_worker_killed_in_the_middle_of_a_rebuild(production_set):
    prod = started(production_set)
    victim = Member.objects.filter(replica__status=ReplicaStatus.READY).select_related("node", "replica").first()
    (prod.pause_dir / "rebuild").touch()
    prod.cluster.kill_node(victim.node.name)
    # The sweep commits the node's LOST transition; its follow-up, failing the
    # node's replica, dies with the worker before it commits.
    prod.kill_paused_worker("rebuild")
    assert Node.objects.get(name=victim.node.name).status == NodeStatus.LOST
    wait_until(lambda: Replica.objects.get(pk=victim.replica_id).status == ReplicaStatus.STOPPED, timeout=BOUND,
               message="the lost node's replica failed and reaped all the same")
    wait_until(lambda: ready_count("small") == 2, timeout=BOUND, message="a replacement ready")
    invariants(lost={victim.node.name}, failed={victim.replica_id})
    allocations_consistent()


def test_beat_killed_and_restarted(production_set):
    prod = started(production_set)
    os.killpg(prod.beat.proc.pid, signal.SIGKILL)
    prod.beat.proc.wait(timeout=10)
    time.sleep(8)  # the scenario: beat away for more than twice the grace period (3 s), no sweep, no reconcile
    restarted = time.time()
    prod.beat.start()
    wait_until(lambda: ControlPlaneClock.objects.filter(last_sweep_at__gt=_aware(restarted)).exists(),
               timeout=BOUND, message="a sweep after beat restarted")
    scale(prod, 3)
    wait_until(lambda: ready_count("small") == 3, timeout=BOUND, message="three ready replicas")
    # The restarted beat's sweeps have come to where they would blame a silent node.
    wait_for_a_sweep_that_could_blame(prod.env, silent_since=time.time(), timeout=BOUND)
    invariants()
    assert Node.objects.filter(status=NodeStatus.READY).count() == len(SMALL_NODES)


def test_agent_api_killed_with_long_polls_parked(production_set):
    prod = started(production_set, grace=10.0, api_env={"LLMGW_LOG_LEVEL": "DEBUG"})
    on_second = [name for name, api in prod.api_of.items() if api == 1]
    polls = [prod.long_poll(name, api=1, version=Node.objects.get(name=name).desired_version) for name in on_second]
    api = prod.apis[1]

    def parked() -> bool:
        # The listener logs each long-poll it parks (nodes.watch); the agents'
        # own wait 25 s (agent.runner.LONG_POLL_WAIT), ours 60 s.
        log = api.log()
        return all(f"long-poll parked node={name} version={version} wait={wait}s" in log
                   for name, version in ((p.name, p.version) for p in polls) for wait in (25, 60))

    wait_until(parked, timeout=30, message="the agents' own long-polls and ours parked")
    os.killpg(api.proc.pid, signal.SIGKILL)
    api.proc.wait(timeout=10)
    for poll in polls:
        # A parked long-poll whose server died ends with an error, never hangs.
        poll._thread.join(timeout=30)
        assert poll.answer is None and poll.error, (poll.answer, poll.error)
    killed = time.time()
    api.start()
    # The agents reconnect on their own: heard again, then told of a change.
    wait_until(lambda: all(_heard_since(prod, name, killed) for name in on_second), timeout=BOUND,
               message="the agents of the killed agent API heard again")
    scale(prod, 4)  # one replica per node: the nodes of the restarted agent API get one each
    wait_until(lambda: ready_count("small") == 4, timeout=BOUND, message="four ready replicas")
    assert {m.node.name for m in Member.objects.filter(replica__status=ReplicaStatus.READY)} >= set(on_second)
    invariants()
    for name in on_second:
        assert prod.cluster.nodes[name].proc.poll() is None, f"the agent of {name} died"


def _aware(timestamp: float):
    import datetime as dt

    return dt.datetime.fromtimestamp(timestamp, tz=dt.timezone.utc)


def _heard_since(prod, name: str, since: float) -> bool:
    from nodes.liveness import RedisLiveness

    seen = RedisLiveness(prod.env["LLMGW_REDIS_URL"]).seen(name)
    return seen is not None and seen > since
