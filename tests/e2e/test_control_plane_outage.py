"""The control plane's own outage is never blamed on its nodes.

Agent API, worker and beat stop for twice the grace period while agents keep
trying to heartbeat (and fail). When the control plane is back, every node
gets a fresh grace period from the moment it can be heard again: nodes whose
agents kept trying stay ready, and a node whose agent really stopped is lost
only once that fresh grace period has run out.
"""

from __future__ import annotations

import datetime as dt
import time

import pytest

from core.choices import CoreEventKind
from core.models import Event
from nodes.choices import NodeEventKind, NodeStatus
from nodes.models import ControlPlaneClock, Node
from tests.control_plane import control_plane_env, wait_for_a_sweep_that_could_blame, wait_until

GRACE = 4.0
SWEEP = 1.0
OUTAGE = 2 * GRACE
LATENESS = SWEEP + 3.0

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def lost_events(node: str):
    return Event.objects.filter(kind=NodeEventKind.NODE_STATUS, subject=f"node/{node}", data__to=NodeStatus.LOST)


def test_outage_of_the_control_plane_loses_no_heartbeating_node(
    agent_api_factory, celery_factory, heartbeaters, client_cert
):
    env = control_plane_env(grace=GRACE, sweep=SWEEP)

    def control_plane_start(port: int | None = None):
        agent_api = agent_api_factory(port=port, **env)
        worker = celery_factory("worker", **env)
        beat = celery_factory("beat", **env)
        worker.wait_ready()
        return agent_api, worker, beat

    agent_api, worker, beat = control_plane_start()
    wait_until(
        lambda: ControlPlaneClock.objects.filter(pk=1, heard_since__isnull=False).exists(),
        timeout=30,
        message="a first sweep",
    )
    steady = [heartbeaters(agent_api.url, name, client_cert(name)) for name in ("steady01", "steady02")]
    quitter = heartbeaters(agent_api.url, "quitter01", client_cert("quitter01"))
    wait_until(
        lambda: Node.objects.filter(status=NodeStatus.READY).count() == 3,
        timeout=15,
        message="three ready nodes",
    )

    # The outage: the whole control plane goes away; one agent stops with it.
    for process in (beat, worker, agent_api):
        process.stop()
    quitter.stop()
    down_at = time.time()
    failed_before = [b.failed for b in steady]
    time.sleep(OUTAGE)  # the scenario: the control plane stays away this long
    assert all(b.failed - before >= 3 for b, before in zip(steady, failed_before)), (
        "the agents should have kept trying (and failing) during the outage"
    )

    up_at = time.time()
    agent_api, worker, beat = control_plane_start(port=agent_api.port)
    assert up_at - down_at >= OUTAGE

    wait_until(
        lambda: Node.objects.filter(name="quitter01", status=NodeStatus.LOST).exists(),
        timeout=GRACE + LATENESS + 20,
        message="quitter01 marked lost after the fresh grace period",
    )
    (event,) = lost_events("quitter01")
    declared = event.created_at.timestamp()
    heard_since = ControlPlaneClock.objects.get(pk=1).heard_since.timestamp()
    # Not blamed at once for the outage: a full grace period from the moment
    # the control plane could hear again, and not much more.
    assert heard_since >= up_at - 1
    assert heard_since + GRACE <= declared <= heard_since + GRACE + LATENESS, (declared - heard_since, worker.log())
    assert Event.objects.filter(
        kind=CoreEventKind.CONTROL_PLANE,
        created_at__gte=dt.datetime.fromtimestamp(up_at - 1, tz=dt.timezone.utc),
        message__contains="fresh grace period",
    ).exists()

    # quitter01 shows a sweep could blame a silent node; one more such sweep
    # a grace period on, and the agents that kept trying are heard and stay ready.
    wait_for_a_sweep_that_could_blame(env, silent_since=declared, timeout=GRACE + LATENESS + 20)
    for beater in steady:
        assert beater.last_ok_at is not None and beater.last_ok_at > up_at, "the agent got through again"
        assert not lost_events(beater.node_id).exists(), f"{beater.node_id} was declared lost"
        assert Node.objects.get(name=beater.node_id).status == NodeStatus.READY
        assert NodeStatus.LOST not in beater.statuses


# --- agents in backoff when the agent API comes back (issue 9, item 3) -------------


@pytest.mark.parametrize("outage", [6.0, 25.0])
def test_agents_backing_off_are_heard_within_the_fresh_grace(sim_cluster, agent_api_factory, outage):
    """Real agents with the default backoff cap (30 s) and a grace of 3 s: the
    control plane tells them a cap that fits its grace, so after the agent
    API's outage each one retries in time and none is declared lost."""
    from tests.e2e.sim import GRACE as SIM_GRACE
    from tests.e2e.sim import fast_env

    cluster = sim_cluster(agent_timings={"reconnect_base": "1s", "reconnect_max": "30s"})
    names = list(cluster.nodes)
    # Every agent has heard the control plane's cap at least once.
    wait_until(lambda: all((cluster.nodes[n].work_dir / "control-plane.json").exists() for n in names),
               timeout=20, message="every agent told its reconnect cap")

    cluster.api.stop()
    time.sleep(outage)  # the scenario: the agent API stays away this long, the agents backing off
    up_at = time.time()
    cluster.api = agent_api_factory(port=cluster.api.port, workers=1, threads=8, **fast_env())

    # Long enough for every agent's next attempt and several fresh grace periods.
    from nodes import liveness

    wait_until(lambda: all(liveness.store().seen_all().get(n, 0) > up_at for n in names),
               timeout=3 * SIM_GRACE, message="every agent heard again within the fresh grace")
    # A sweep has run that would have declared lost an agent still silent.
    wait_for_a_sweep_that_could_blame(fast_env(), silent_since=up_at, timeout=6 * SIM_GRACE)
    for name in names:
        assert not lost_events(name).exists(), f"{name} was declared lost though its agent kept trying"
        assert Node.objects.get(name=name).status == NodeStatus.READY
