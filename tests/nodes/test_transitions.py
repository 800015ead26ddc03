"""The node state machine: every (from, to) pair of NODE_TRANSITIONS."""

import itertools

import pytest
from django.utils import timezone

from core.choices import EventSeverity
from core.exceptions import InvalidTransition, NotFound
from core.models import Event
from nodes import liveness
from nodes.choices import LIVE, NODE_TRANSITIONS, NodeEventKind, NodeStatus
from nodes.models import Node
from nodes.services import node_cordon, node_transition, node_uncordon
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db

ALL_PAIRS = list(itertools.product(NodeStatus.values, repeat=2))
ALLOWED = [(a, b) for a, b in ALL_PAIRS if b in NODE_TRANSITIONS.get(a, set())]
DISALLOWED = [(a, b) for a, b in ALL_PAIRS if b not in NODE_TRANSITIONS.get(a, set())]


def _long_ago():
    return timezone.now() - timezone.timedelta(hours=1)


def test_the_table_covers_every_status_and_the_design():
    assert set(NODE_TRANSITIONS) == set(NodeStatus.values)
    for targets in NODE_TRANSITIONS.values():
        assert targets <= set(NodeStatus.values)
    # DESIGN.md: registered -> ready <-> cordoned; ready|cordoned -> draining -> drained;
    # any live state -> lost -> ready.
    assert NodeStatus.READY in NODE_TRANSITIONS[NodeStatus.REGISTERED]
    assert NodeStatus.CORDONED in NODE_TRANSITIONS[NodeStatus.READY]
    assert NodeStatus.READY in NODE_TRANSITIONS[NodeStatus.CORDONED]
    assert NodeStatus.DRAINING in NODE_TRANSITIONS[NodeStatus.READY] & NODE_TRANSITIONS[NodeStatus.CORDONED]
    assert NodeStatus.DRAINED in NODE_TRANSITIONS[NodeStatus.DRAINING]
    for status in LIVE:
        assert NodeStatus.LOST in NODE_TRANSITIONS[status]
    assert NODE_TRANSITIONS[NodeStatus.LOST] == {NodeStatus.READY}
    assert len(ALLOWED) + len(DISALLOWED) == len(NodeStatus.values) ** 2


@pytest.mark.parametrize(("start", "to"), ALLOWED, ids=[f"{a}->{b}" for a, b in ALLOWED])
def test_allowed_transition_changes_status_and_writes_an_event(start, to, django_capture_on_commit_callbacks):
    node = NodeFactory(name="node01", status=start, status_changed_at=_long_ago())
    store = liveness.store()
    generation = store.version("node01") if store.caches_nodes else None

    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        result = node_transition(node_name="node01", to=to, reason="because a test said so")

    assert result is not None and result.status == to
    node.refresh_from_db()
    assert node.status == to
    assert node.status_reason == "because a test said so"
    assert timezone.now() - node.status_changed_at < timezone.timedelta(seconds=30)
    event = Event.objects.get(node=node, kind=NodeEventKind.NODE_STATUS)
    assert event.data == {"from": start, "to": to}
    assert event.message == f"{start} -> {to}: because a test said so"
    assert event.subject == "node/node01"
    # The agent API's cached view of the node is invalidated once committed.
    assert len(callbacks) >= 1
    if store.caches_nodes:
        assert store.version("node01") == generation + 1


@pytest.mark.parametrize(("start", "to"), DISALLOWED, ids=[f"{a}->{b}" for a, b in DISALLOWED])
def test_disallowed_transition_raises_and_changes_nothing(start, to, django_capture_on_commit_callbacks):
    changed_at = _long_ago()
    node = NodeFactory(name="node01", status=start, status_changed_at=changed_at, status_reason="before")

    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with pytest.raises(InvalidTransition, match=f"node node01 is {start}; it cannot become {to}"):
            node_transition(node_name="node01", to=to, reason="nope")

    node.refresh_from_db()
    assert (node.status, node.status_changed_at, node.status_reason) == (start, changed_at, "before")
    assert not Event.objects.exists()
    assert callbacks == []


def test_unknown_status_is_not_a_transition():
    NodeFactory(name="node01", status=NodeStatus.READY)
    with pytest.raises(InvalidTransition):
        node_transition(node_name="node01", to="retired")
    assert Node.objects.get(name="node01").status == NodeStatus.READY


def test_unknown_node_is_not_found():
    with pytest.raises(NotFound, match="no node named 'node99'"):
        node_transition(node_name="node99", to=NodeStatus.READY)


def test_compare_and_set_with_expected_status():
    NodeFactory(name="node01", status=NodeStatus.READY)

    # Someone else moved the node first: nothing happens, nothing raised.
    assert node_transition(node_name="node01", to=NodeStatus.LOST, expected=NodeStatus.CORDONED) is None
    assert Node.objects.get(name="node01").status == NodeStatus.READY
    assert not Event.objects.exists()

    # The expected status holds: the change is made, once.
    node = node_transition(
        node_name="node01", to=NodeStatus.LOST, expected=NodeStatus.READY, severity=EventSeverity.ERROR
    )
    assert node.status == NodeStatus.LOST
    assert Event.objects.get().severity == EventSeverity.ERROR
    assert node_transition(node_name="node01", to=NodeStatus.LOST, expected=NodeStatus.READY) is None
    assert Event.objects.count() == 1


def test_compare_and_set_still_refuses_a_disallowed_transition():
    NodeFactory(name="node01", status=NodeStatus.LOST)
    with pytest.raises(InvalidTransition):
        node_transition(node_name="node01", to=NodeStatus.CORDONED, expected=NodeStatus.LOST)
    assert Node.objects.get(name="node01").status == NodeStatus.LOST


def test_cordon_and_uncordon():
    NodeFactory(name="node01", status=NodeStatus.READY)
    assert node_cordon(node_name="node01").status == NodeStatus.CORDONED
    with pytest.raises(InvalidTransition, match="cordoned; it cannot become cordoned"):
        node_cordon(node_name="node01")
    assert node_uncordon(node_name="node01").status == NodeStatus.READY
    with pytest.raises(InvalidTransition):
        node_uncordon(node_name="node01")
    reasons = list(Event.objects.order_by("id").values_list("message", flat=True))
    assert reasons == ["ready -> cordoned: cordoned by an operator", "cordoned -> ready: uncordoned by an operator"]


def test_long_reason_is_cut_to_fit():
    NodeFactory(name="node01", status=NodeStatus.READY)
    node = node_transition(node_name="node01", to=NodeStatus.CORDONED, reason="x" * 1000)
    node.refresh_from_db()
    assert node.status_reason == "x" * 255
