"""Writes to nodes: status (the one place it changes), cordon, and what the
nodes should run. Inventory is ``nodes.inventory``, the lost-node sweep
``nodes.sweep``, the control plane's own clock ``nodes.clock``."""

from __future__ import annotations

from django.db import transaction
from django.db.models import F

from . import liveness, watch
from .choices import NODE_TRANSITIONS, EventKind, EventSeverity, NodeStatus
from .exceptions import NotFound
from .models import Node
from .statemachine import StateMachine


def _bump_on_commit(node_names: list[str]) -> None:
    """After commit: invalidate the agent API's cached view of the nodes and
    wake their parked desired-state long-polls (one Redis round trip)."""
    transaction.on_commit(lambda: liveness.store().bump_many(node_names, channel=watch.CHANNEL))


def nodes_desired_changed(*, node_names: list[str]) -> None:
    """What the nodes should run changed: bump their versions (inside the
    caller's transaction) and tell their agents after commit."""
    Node.objects.filter(name__in=node_names).update(desired_version=F("desired_version") + 1)
    _bump_on_commit(node_names)


def node_desired_changed(*, node_name: str) -> None:
    nodes_desired_changed(node_names=[node_name])


class NodeStates(StateMachine):
    noun = "node"
    table = NODE_TRANSITIONS
    event_kind = EventKind.NODE_STATUS
    reason_max = 255

    def subject(self, node: Node) -> str:
        return f"node/{node.name}"

    def event_node(self, node: Node) -> Node:
        return node

    def changed(self, node: Node, previous: str, to: str) -> None:
        _bump_on_commit([node.name])


NODE_STATES = NodeStates()


def node_transition(
    *,
    node_name: str,
    to: str,
    reason: str = "",
    expected: str | None = None,
    severity: str = EventSeverity.INFO,
) -> Node | None:
    """The one place a node's status changes.

    With ``expected``, a compare-and-set: if the node is no longer in that
    status, nothing happens and None is returned.
    """
    return NODE_STATES.transition(
        Node.objects.filter(name=node_name), to=to, reason=reason, expected=expected, severity=severity,
        missing=NotFound(f"no node named {node_name!r}; 'llmgw ctl nodes' lists them"),
    )


def node_cordon(*, node_name: str) -> Node:
    return node_transition(node_name=node_name, to=NodeStatus.CORDONED, reason="cordoned by an operator")


def node_uncordon(*, node_name: str) -> Node:
    return node_transition(node_name=node_name, to=NodeStatus.READY, reason="uncordoned by an operator")
