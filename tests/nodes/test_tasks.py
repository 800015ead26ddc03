"""The lost-node sweep as it runs in production: beat schedules it, a real
Celery worker executes it, nodes heartbeat over mTLS to a real agent API."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from core.models import Event
from nodes.choices import NodeEventKind, NodeStatus
from nodes.models import ControlPlaneClock, Node
from tests.control_plane import (  # noqa: F401 - fixtures
    celery_factory,
    control_plane_env,
    heartbeat_once,
    heartbeaters,
    wait_until,
)

GRACE = 3.0
SWEEP = 1.0
# Beat's period, the queue, the worker picking the task up: how long after its
# deadline a lost node may be declared on an idle machine (the wait below
# allows more, for a busy one).
LATENESS = SWEEP + 3.0

pytestmark = pytest.mark.django_db(transaction=True)


def lost_events(node: str):
    return Event.objects.filter(kind=NodeEventKind.NODE_STATUS, subject=f"node/{node}", data__to=NodeStatus.LOST)


def wait_for_a_sweep_after(moment: dt.datetime) -> None:
    wait_until(lambda: ControlPlaneClock.objects.filter(pk=1, last_sweep_at__gt=moment).exists(),
               timeout=30, message=f"a sweep after {moment:%H:%M:%S.%f}")


def test_tasks_are_registered_with_the_beat_schedule():
    from llmgw_site.celery import app

    app.loader.import_default_modules()
    assert "nodes.tasks.nodes_sweep_lost" in app.tasks
    entry = app.conf.beat_schedule["nodes-sweep-lost"]
    assert entry["task"] == "nodes.tasks.nodes_sweep_lost"


def test_each_beat_entry_is_named_after_the_app_whose_task_it_runs():
    """A reader looking for what 'pki-...' runs should find it in pki."""
    from llmgw_site.celery import app

    app.loader.import_default_modules()
    for name, entry in app.conf.beat_schedule.items():
        assert entry["task"] in app.tasks, f"beat entry {name} runs {entry['task']}, which no app registers"
        owner = entry["task"].split(".", 1)[0]
        assert name.startswith(f"{owner}-"), f"beat entry {name} runs {entry['task']}: name it {owner}-..."


def test_real_worker_and_beat_mark_a_silent_node_lost(agent_api_factory, celery_factory, heartbeaters, client_cert):
    env = control_plane_env(grace=GRACE, sweep=SWEEP)
    # The agent API first: its "listener alive" mark is what lets the sweep
    # blame nodes at all.
    agent_api = agent_api_factory(**env)
    worker = celery_factory("worker", **env)
    celery_factory("beat", **env)
    worker.wait_ready()
    wait_until(
        lambda: ControlPlaneClock.objects.filter(pk=1, heard_since__isnull=False).exists(),
        timeout=30,
        message="a first sweep by the worker",
    )

    silent_certs = client_cert("silent01")
    chatty = heartbeaters(agent_api.url, "chatty01", client_cert("chatty01"), interval=0.5)
    response = heartbeat_once(agent_api.url, "silent01", silent_certs)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == NodeStatus.READY
    last_heard = Node.objects.get(name="silent01").last_heartbeat_at
    deadline = last_heard.timestamp() + GRACE

    wait_until(
        lambda: Node.objects.filter(name="silent01", status=NodeStatus.LOST).exists(),
        timeout=GRACE + LATENESS + 10,
        message="silent01 marked lost",
    )
    (event,) = lost_events("silent01")
    declared = event.created_at.timestamp()
    assert deadline <= declared, (declared - deadline, worker.log())  # never before its grace ran out
    assert event.data["from"] == NodeStatus.READY
    assert "no heartbeat for" in event.message

    # The node that kept heartbeating through all of it is still ready, two sweeps on.
    wait_for_a_sweep_after(timezone.now())
    wait_for_a_sweep_after(timezone.now())
    assert chatty.ok >= 5
    assert Node.objects.get(name="chatty01").status == NodeStatus.READY
    assert not lost_events("chatty01").exists()

    # The lost node comes back with its next heartbeat.
    response = heartbeat_once(agent_api.url, "silent01", silent_certs)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == NodeStatus.READY
    node = Node.objects.get(name="silent01")
    assert node.status == NodeStatus.READY
    assert Event.objects.filter(
        kind=NodeEventKind.NODE_STATUS, subject="node/silent01", data__from=NodeStatus.LOST, data__to=NodeStatus.READY
    ).exists()
    # And the sweeps that follow leave it alone while it is heard.
    chatty.stop()
    silent = heartbeaters(agent_api.url, "silent01", silent_certs, interval=0.5)
    wait_for_a_sweep_after(timezone.now() + dt.timedelta(seconds=GRACE))  # a whole grace period on
    assert silent.ok >= 3
    assert lost_events("silent01").count() == 1
    assert Node.objects.get(name="silent01").status == NodeStatus.READY
