"""Events: kinds owned by the app that records them, one table kept from
when Event lived in nodes."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader

from accounts.choices import AccountEventKind
from core import events
from core.choices import CoreEventKind
from core.events import event_kinds, event_kinds_register, event_record, events_record
from core.exceptions import UnknownEventKind
from core.models import Event
from nodes.choices import NodeEventKind
from provisioning.choices import ProvisioningEventKind
from replicas.choices import ReplicaEventKind

# Every kind the UI, ctl and the tests read (those of before the move spelled as then).
KINDS_BEFORE = {
    "node.registered": "nodes", "node.status": "nodes", "node.inventory": "nodes",
    "gpu.conflict": "nodes", "gpu.missing": "nodes", "control_plane": "core", "model": "replicas",
    "replica.status": "replicas", "replica.pending": "replicas", "drain": "replicas", "rollout": "replicas",
    "provisioning": "provisioning", "account": "accounts",
    # Kinds added since, by the app that records them.
    "gpu.quarantined": "nodes", "gpu.cleared": "nodes", "gpu.xid": "nodes",
    "autoscale": "replicas", "weights": "replicas",
}


def test_every_kind_is_registered_by_the_app_that_records_it():
    assert dict(events._kinds) == KINDS_BEFORE
    assert set(event_kinds()) == set(KINDS_BEFORE)
    owned = {*CoreEventKind.values, *NodeEventKind.values, *ReplicaEventKind.values, *ProvisioningEventKind.values,
             *AccountEventKind.values}
    assert owned == set(KINDS_BEFORE)


@pytest.mark.django_db
def test_an_unknown_kind_is_refused_before_anything_is_written():
    with pytest.raises(UnknownEventKind, match=r"event kind 'node.stattus' is not registered.*node\.status"):
        event_record(kind="node.stattus", subject="node/node01", message="typo")
    with pytest.raises(UnknownEventKind):
        events_record([Event(kind="drain", subject="a", message="b"), Event(kind="nope", subject="c", message="d")])
    assert not Event.objects.exists()
    event_record(kind=NodeEventKind.NODE_STATUS, subject="node/node01", message="known")
    assert Event.objects.get().kind == "node.status"


def test_a_kind_has_one_owner():
    event_kinds_register(owner="nodes", kinds=NodeEventKind)  # again: harmless
    with pytest.raises(ImproperlyConfigured, match="'drain' of gateway is already registered by replicas"):
        event_kinds_register(owner="gateway", kinds=["drain"])
    with pytest.raises(ImproperlyConfigured, match="longer than the Event.kind column"):
        event_kinds_register(owner="gateway", kinds=["x" * 33])
    assert "x" * 33 not in event_kinds()


def test_kind_carries_no_choices_in_the_model_or_the_migrations():
    assert not Event._meta.get_field("kind").choices
    state = MigrationLoader(None).project_state()
    assert not state.models["core", "event"].fields["kind"].choices
    assert ("nodes", "event") not in state.models


@pytest.mark.django_db(transaction=True)
def test_rows_written_before_the_move_are_read_after_it():
    """Migrate back to where Event lived in nodes, write one there, migrate
    forward: the same row, through core's model (table nodes_event)."""
    before = [("nodes", "0006_gpu_missing_and_conflicts")]
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    try:
        executor.migrate(before)
        old = MigrationExecutor(connection).loader.project_state(before).apps
        node = old.get_model("nodes", "Node").objects.create(name="old01", status="ready", status_changed_at="2026-01-01T00:00Z")
        old.get_model("nodes", "Event").objects.create(kind="node.status", subject="node/old01", message="before", node=node)
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(latest)
    event = Event.objects.get(subject="node/old01")
    assert (event.message, event.node.name, Event._meta.db_table) == ("before", "old01", "nodes_event")
