"""The lost-node sweep, called directly with shifted timestamps.

Time is a line of our own: ``T`` is the wall clock when the test starts, and
every heartbeat, every listener liveness mark and every sweep is placed on it
explicitly. The sweep runs against both liveness stores: Redis (production)
and the node rows themselves (the embedded default).
"""

from __future__ import annotations

import datetime as dt
import time

import pytest

from agent.protocol import example_heartbeat
from core.choices import CoreEventKind, EventSeverity
from core.models import Event
from nodes import heartbeat, liveness
from nodes.choices import NodeEventKind, NodeStatus
from nodes.models import ControlPlaneClock, Node
from nodes.sweep import nodes_sweep_lost
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db

GRACE = 10.0
DEAF_AFTER = 5.0


@pytest.fixture(params=["redis", "database"])
def store(request, settings):
    settings.LLMGW_NODE_GRACE = GRACE
    settings.LLMGW_DEAF_AFTER = DEAF_AFTER
    # These tests are about one node's silence at a time; the hold on mass
    # silence (several nodes at once) is not what they exercise.
    settings.LLMGW_MASS_SILENCE_FRACTION = 1.0
    if request.param == "database":
        settings.LLMGW_REDIS_URL = ""
    elif not settings.LLMGW_REDIS_URL:
        pytest.skip("needs Redis (make test sets LLMGW_REDIS_URL)")
    liveness.store.cache_clear()
    yield liveness.store()
    liveness.store.cache_clear()


class Timeline:
    """Sweeps and heartbeats at chosen moments, ``T + offset`` seconds."""

    def __init__(self, store) -> None:
        self.store = store
        self.t0 = time.time() - 3600  # an hour ago: every moment of the test is in the past

    def at(self, offset: float) -> dt.datetime:
        return dt.datetime.fromtimestamp(self.t0 + offset, tz=dt.timezone.utc)

    def node(self, name: str, *, at: float = 0.0, status: str = NodeStatus.READY) -> Node:
        return NodeFactory(name=name, status=status, status_changed_at=self.at(at), last_heartbeat_at=self.at(at))

    def heartbeat(self, name: str, offset: float) -> None:
        self.store.record(name, self.t0 + offset)

    def sweep(self, offset: float, *, listener: bool = True) -> list[str]:
        if listener:
            self.store.mark_listener_alive(self.t0 + offset)
        return nodes_sweep_lost(now=self.at(offset))

    def sweep_every(self, start: float, stop: float, step: float = 2.0, **kwargs) -> list[str]:
        """Sweeps as beat runs them, every ``step`` seconds; the names declared lost."""
        lost = []
        offset = start
        while offset <= stop:
            lost += self.sweep(offset, **kwargs)
            offset += step
        return lost


@pytest.fixture
def line(store):
    return Timeline(store)


def _status(name: str) -> str:
    return Node.objects.get(name=name).status


def _control_plane_events() -> list[str]:
    return list(Event.objects.filter(kind=CoreEventKind.CONTROL_PLANE).order_by("id").values_list("message", flat=True))


def test_a_node_silent_past_the_grace_period_is_lost(line):
    line.node("node01")
    line.node("node02")
    line.heartbeat("node01", 0)
    line.heartbeat("node02", 0)
    assert line.sweep_every(0, 8) == []
    line.heartbeat("node02", 8)  # node02 keeps talking; node01 went quiet at 0

    assert line.sweep(10) == []  # exactly the grace period: not yet
    assert line.sweep(10.5) == ["node01"]
    assert _status("node01") == NodeStatus.LOST
    assert _status("node02") == NodeStatus.READY

    event = Event.objects.get(node__name="node01", kind=NodeEventKind.NODE_STATUS)
    assert event.data == {"from": "ready", "to": "lost"}
    assert event.severity == EventSeverity.ERROR
    assert "no heartbeat for 10s (grace 10s)" in event.message

    # Compare-and-set: sweeping again declares nothing twice.
    assert line.sweep(12) == []
    assert Event.objects.filter(node__name="node01", kind=NodeEventKind.NODE_STATUS).count() == 1


def test_a_node_within_grace_is_not_lost(line):
    line.node("node01")
    for offset in range(0, 60, 5):
        line.heartbeat("node01", offset)
        assert line.sweep_every(offset, offset + 4) == []
    assert _status("node01") == NodeStatus.READY
    assert not Event.objects.filter(kind=NodeEventKind.NODE_STATUS).exists()


@pytest.mark.parametrize("status", [NodeStatus.REGISTERED, NodeStatus.CORDONED, NodeStatus.DRAINING, NodeStatus.DRAINED])
def test_every_live_status_can_be_lost(line, status):
    line.node("node01", status=status)
    line.heartbeat("node01", 0)
    assert line.sweep_every(0, 10) == []
    assert line.sweep(12) == ["node01"]
    assert Event.objects.get(kind=NodeEventKind.NODE_STATUS).data == {"from": status, "to": "lost"}


def test_a_node_that_never_heartbeat_is_judged_from_its_status_change(line):
    node = line.node("node01", status=NodeStatus.REGISTERED)
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=None)
    assert line.sweep_every(0, 10) == []
    assert line.sweep(12) == ["node01"]


def test_a_status_change_restarts_the_grace_period(line):
    """A node an operator just uncordoned is not lost a moment later for an old silence."""
    line.node("node01", status=NodeStatus.CORDONED)
    line.heartbeat("node01", 0)
    assert line.sweep_every(0, 8) == []
    Node.objects.filter(name="node01").update(status=NodeStatus.READY, status_changed_at=line.at(9))
    assert line.sweep_every(10, 18) == []
    assert line.sweep(19.5) == ["node01"]


def test_a_stale_listener_mark_means_nobody_is_lost(line):
    """The agent API is down: silence says nothing about the nodes."""
    line.node("node01")
    line.node("node02")
    line.heartbeat("node01", 0)
    line.heartbeat("node02", 0)
    assert line.sweep_every(0, 4) == []
    # The agent API stops writing its mark at 4; sweeps keep running.
    assert line.sweep_every(6, 60, listener=False) == []
    assert {_status("node01"), _status("node02")} == {NodeStatus.READY}
    assert not Event.objects.filter(kind=NodeEventKind.NODE_STATUS).exists()

    messages = _control_plane_events()
    deaf = [m for m in messages if "agent API has not been running" in m]
    assert len(deaf) == 1, messages  # said once, not every sweep
    assert "no node will be declared lost" in deaf[0]
    assert Event.objects.get(message=deaf[0]).severity == EventSeverity.WARNING
    clock = ControlPlaneClock.objects.get()
    assert clock.deaf_since is not None and clock.heard_since is None


def test_after_the_listener_was_down_every_node_gets_a_fresh_grace_period(line):
    line.node("node01")
    line.node("node02")
    line.heartbeat("node01", 0)
    line.heartbeat("node02", 0)
    assert line.sweep_every(0, 4) == []
    assert line.sweep_every(6, 40, listener=False) == []  # down for 2x grace and more

    # Hearing resumes at 42. node01's agent reconnects at 44 and keeps
    # heartbeating; node02 really died while we were deaf.
    assert line.sweep(42) == []
    assert "fresh grace period of 10s" in _control_plane_events()[-1]
    assert ControlPlaneClock.objects.get().heard_since == line.at(42)
    for offset in (44, 49):
        line.heartbeat("node01", offset)
    assert line.sweep_every(44, 52) == []  # within 42 + grace: nobody blamed yet
    assert {_status("node01"), _status("node02")} == {NodeStatus.READY}
    assert line.sweep(52.5) == ["node02"]
    assert _status("node01") == NodeStatus.READY


def test_after_a_gap_in_sweeps_every_node_gets_a_fresh_grace_period(line):
    """Beat or the database was down: the first sweep after the gap does not
    blame nodes for a silence nobody was listening to."""
    line.node("node01")
    line.heartbeat("node01", 0)
    assert line.sweep_every(0, 4) == []
    # No sweep between 4 and 30 (more than DEAF_AFTER); the listener was
    # marking itself alive all along, but node01 is silent since 0.
    line.store.mark_listener_alive(line.t0 + 29)
    assert line.sweep(30) == []
    assert _status("node01") == NodeStatus.READY
    assert "fresh grace period" in _control_plane_events()[-1]
    assert line.sweep_every(32, 40) == []
    assert line.sweep(40.5) == ["node01"]


def test_a_short_gap_in_sweeps_does_not_reset_grace(line):
    line.node("node01")
    line.heartbeat("node01", 0)
    assert line.sweep_every(0, 4) == []
    resets = len(_control_plane_events())
    assert line.sweep(4 + DEAF_AFTER - 0.5) == []  # a late sweep, still inside DEAF_AFTER
    assert line.sweep(10.5) == ["node01"]  # judged from 0, not from the late sweep
    assert len(_control_plane_events()) == resets


def test_a_lost_node_that_heartbeats_again_comes_back_ready_and_empty(line):
    line.node("node01")
    line.heartbeat("node01", 0)
    assert line.sweep_every(0, 10) == []
    assert line.sweep(11) == ["node01"]
    assert _status("node01") == NodeStatus.LOST

    reply = heartbeat.node_heartbeat(node_name="node01", payload=example_heartbeat().to_dict())
    assert reply["status"] == NodeStatus.READY
    assert reply["desired"]["members"] == []
    node = Node.objects.get(name="node01")
    assert node.status == NodeStatus.READY
    back = Event.objects.filter(node=node, kind=NodeEventKind.NODE_STATUS).latest("id")
    assert back.data == {"from": "lost", "to": "ready"}
    assert "comes back empty" in back.message

    # Back for good: the next sweeps (now, in real time) do not lose it again.
    now = time.time() - line.t0
    assert line.sweep(now) == []
    assert line.sweep(now + GRACE / 2) == []
    assert _status("node01") == NodeStatus.READY


def test_lost_nodes_are_not_swept_again(line):
    line.node("node01", status=NodeStatus.LOST)
    assert line.sweep_every(0, 40) == []
    assert not Event.objects.filter(kind=NodeEventKind.NODE_STATUS).exists()


def test_sweep_keeps_the_stored_heartbeat_copy_roughly_current(line, store):
    if not store.caches_nodes:
        pytest.skip("the embedded default keeps liveness in the node row itself")
    line.node("node01", at=0)
    line.sweep_every(0, 4)
    line.heartbeat("node01", 100)
    line.sweep(101)
    assert Node.objects.get(name="node01").last_heartbeat_at == line.at(100)


@pytest.fixture
def mass_line(line, settings):
    settings.LLMGW_MASS_SILENCE_FRACTION = 0.5
    return line


def test_nodes_falling_silent_together_hold_failover_though_their_deadlines_differ(mass_line):
    """Frozen at one moment, their last heartbeats a few seconds apart: the
    first past its deadline is not failed over alone; the hold counts them all."""
    line = mass_line
    for name in ("node01", "node02", "node03", "node04"):
        line.node(name)
    for name, last in (("node01", 4.0), ("node02", 6.0), ("node03", 8.0)):
        line.heartbeat(name, last)
    for offset in range(0, 40, 2):
        line.heartbeat("node04", offset)
    # Sweeps all along (no gap that would give everyone a fresh grace period).
    lost = line.sweep_every(0, 30)
    assert lost == []
    assert {_status(n) for n in ("node01", "node02", "node03", "node04")} == {NodeStatus.READY}
    assert any("3 of 4 nodes went silent at once" in m for m in _control_plane_events())


def test_one_node_silent_among_many_is_failed_over(mass_line):
    line = mass_line
    for name in ("node01", "node02", "node03", "node04"):
        line.node(name)
    line.heartbeat("node01", 4.0)
    for name in ("node02", "node03", "node04"):
        for offset in range(0, 30, 2):
            line.heartbeat(name, offset)
    assert line.sweep_every(0, 28) == ["node01"]
    assert not any("went silent at once" in m for m in _control_plane_events())
