"""Writes to nodes: status (the one place it changes), cordon, and what the
nodes should run. Inventory is ``nodes.inventory``, the lost-node sweep
``nodes.sweep``, the control plane's own clock ``nodes.clock``."""

from __future__ import annotations

from django.db import transaction
from django.db.models import F

from core.choices import EventSeverity
from core.exceptions import NotFound
from core.statemachine import StateMachine

from . import hooks, liveness, longpoll
from .choices import NODE_TRANSITIONS, NodeEventKind, NodeStatus
from .models import Node


def _bump_on_commit(node_names: list[str]) -> None:
    """After commit: invalidate the agent API's cached view of the nodes and
    wake their parked desired-state long-polls (one Redis round trip)."""
    transaction.on_commit(lambda: liveness.store().bump_many(node_names, channel=longpoll.CHANNEL))


def _desired_versions_bump(node_names: list[str]) -> None:
    # Its own short transaction, taking the rows in ascending pk: the lock
    # order (docs/architecture.md) puts nodes before members and replicas, so
    # a bump asked for while those are held waits until they are released.
    with transaction.atomic():
        ids = list(
            Node.objects.select_for_update(no_key=True).filter(name__in=node_names).order_by("pk").values_list("pk", flat=True)
        )
        Node.objects.filter(pk__in=ids).update(desired_version=F("desired_version") + 1)
    liveness.store().bump_many(node_names, channel=longpoll.CHANNEL)


def nodes_desired_changed(*, node_names: list[str], held: bool = False) -> None:
    """What the nodes should run changed: bump their versions and tell their
    agents. ``held``: the caller's transaction holds these nodes' rows
    already (a placement locks its nodes first), so the versions move with
    it; otherwise they move right after it commits, because locking a node
    row while holding member or replica rows would invert the lock order and
    deadlock with heartbeats. (A version that failed to move is moved again
    by the reconcile: ``replicas.reconcile.members_nudge``.)"""
    names = sorted(set(node_names))
    if not names:
        return
    if held:
        Node.objects.filter(name__in=names).update(desired_version=F("desired_version") + 1)
        _bump_on_commit(names)
    else:
        # robust: the caller's work is committed; a bump that fails is logged
        # and made up for by the reconcile, never an error for the caller.
        transaction.on_commit(lambda: _desired_versions_bump(names), robust=True)


def node_desired_changed(*, node_name: str) -> None:
    nodes_desired_changed(node_names=[node_name])


class NodeStates(StateMachine):
    noun = "node"
    table = NODE_TRANSITIONS
    event_kind = NodeEventKind.NODE_STATUS
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


def node_cordon(*, node_name: str, actor: str = "") -> Node:
    """``actor`` names who asked (the web UI passes 'user NAME'); the Event says it."""
    return node_transition(node_name=node_name, to=NodeStatus.CORDONED, reason=f"cordoned by {actor or 'an operator'}")


def node_uncordon(*, node_name: str, actor: str = "") -> Node:
    """Back in service. A drain under way ends with it (and never resumes):
    its replicas stop moving and keep running here."""
    who = actor or "an operator"
    with transaction.atomic():
        node = node_transition(node_name=node_name, to=NodeStatus.READY, reason=f"uncordoned by {who}")
        for handler in hooks.node_undrained_handlers:
            handler(node_name=node_name, reason=f"{node_name} uncordoned by {who}")
    return node
