"""The replica and drain state machines: every (from, to) pair of
REPLICA_TRANSITIONS and DRAIN_TRANSITIONS, through the one transition helper
(core.statemachine) that nodes use too (tests/nodes/test_transitions.py)."""

import itertools

import pytest
from django.utils import timezone
from rest_framework import status

from core.choices import EventSeverity
from core.exceptions import InvalidTransition
from core.models import Event
from gateway import selectors as gateway_selectors
from replicas.choices import DRAIN_ACTIVE, DRAIN_ENDED, DRAIN_TRANSITIONS, REPLICA_TRANSITIONS, DrainStatus, ReplicaEventKind, ReplicaStatus
from web.errors import exception_handler
from replicas import hooks
from replicas.drain import DRAIN_STATES
from replicas.exceptions import InvalidDrainTransition, InvalidReplicaTransition
from replicas.models import Drain, Replica
from replicas.services import replica_transition, replicas_transition_scheduled
from tests.factories import CatalogEntryFactory, NodeFactory

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue")]


def _pairs(values, table):
    pairs = list(itertools.product(values, repeat=2))
    allowed = [(a, b) for a, b in pairs if b in table.get(a, set())]
    disallowed = [(a, b) for a, b in pairs if b not in table.get(a, set())]
    return allowed, disallowed


REPLICA_ALLOWED, REPLICA_DISALLOWED = _pairs(ReplicaStatus.values, REPLICA_TRANSITIONS)
DRAIN_ALLOWED, DRAIN_DISALLOWED = _pairs(DrainStatus.values, DRAIN_TRANSITIONS)


def _ids(pairs):
    return [f"{a}->{b}" for a, b in pairs]


def _long_ago():
    return timezone.now() - timezone.timedelta(hours=1)


def _replica(status, **fields):
    model = CatalogEntryFactory(name="m")
    return Replica.objects.create(model=model, status=status, status_changed_at=_long_ago(), **fields)


# --- the tables --------------------------------------------------------------------------


def test_the_tables_cover_every_status():
    for table, values in ((REPLICA_TRANSITIONS, ReplicaStatus.values), (DRAIN_TRANSITIONS, DrainStatus.values)):
        assert set(table) == set(values)
        for targets in table.values():
            assert targets <= set(values)
    assert REPLICA_TRANSITIONS[ReplicaStatus.STOPPED] == set()
    assert DRAIN_TRANSITIONS[DrainStatus.DONE] == set()
    # An ended drain never resumes, whichever way it ended; an active one can be called off.
    assert DRAIN_TRANSITIONS[DrainStatus.CANCELLED] == set()
    assert DRAIN_ACTIVE == {DrainStatus.RUNNING, DrainStatus.BLOCKED}
    assert DRAIN_ENDED == set(DrainStatus.values) - DRAIN_ACTIVE
    for status in DRAIN_ACTIVE:
        assert DrainStatus.CANCELLED in DRAIN_TRANSITIONS[status]
    assert len(REPLICA_ALLOWED) + len(REPLICA_DISALLOWED) == len(ReplicaStatus.values) ** 2
    assert len(DRAIN_ALLOWED) + len(DRAIN_DISALLOWED) == len(DrainStatus.values) ** 2


# --- replicas ----------------------------------------------------------------------------


@pytest.mark.parametrize(("start", "to"), REPLICA_ALLOWED, ids=_ids(REPLICA_ALLOWED))
def test_allowed_replica_transition_changes_status_and_writes_an_event(start, to):
    replica = _replica(start, pending_reason="no room")

    result = replica_transition(replica_id=replica.pk, to=to, reason="because a test said so")

    assert result is not None and result.status == to
    replica.refresh_from_db()
    assert (replica.status, replica.status_reason) == (to, "because a test said so")
    assert timezone.now() - replica.status_changed_at < timezone.timedelta(seconds=30)
    if to == ReplicaStatus.READY:
        assert replica.ready_at == replica.status_changed_at
    if to == ReplicaStatus.SCHEDULED:
        assert replica.pending_reason == ""
    event = Event.objects.get(kind=ReplicaEventKind.REPLICA_STATUS)
    assert event.subject == f"replica/{replica.pk}"
    assert event.message == f"m replica {replica.pk}: {start} -> {to}: because a test said so"
    assert event.data == {"model": "m", "replica": replica.pk, "from": start, "to": to}


@pytest.mark.parametrize(("start", "to"), REPLICA_DISALLOWED, ids=_ids(REPLICA_DISALLOWED))
def test_disallowed_replica_transition_raises_and_changes_nothing(start, to, django_capture_on_commit_callbacks):
    changed_at = _long_ago()
    replica = _replica(start, status_reason="before")
    Replica.objects.filter(pk=replica.pk).update(status_changed_at=changed_at)

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        with pytest.raises(InvalidReplicaTransition, match=f"replica m#{replica.pk} is {start}; it cannot become {to}"):
            replica_transition(replica_id=replica.pk, to=to, reason="nope")

    replica.refresh_from_db()
    assert (replica.status, replica.status_changed_at, replica.status_reason) == (start, changed_at, "before")
    assert not Event.objects.exists()
    assert callbacks == []


def test_replica_compare_and_set_misses_quietly():
    replica = _replica(ReplicaStatus.READY)
    assert replica_transition(replica_id=replica.pk, to=ReplicaStatus.FAILED, expected=ReplicaStatus.STARTING) is None
    assert replica_transition(replica_id=replica.pk + 1000, to=ReplicaStatus.FAILED) is None
    assert Replica.objects.get(pk=replica.pk).status == ReplicaStatus.READY
    assert not Event.objects.exists()


def test_a_batch_of_placements_stores_the_reason_its_event_gives():
    model = CatalogEntryFactory(name="m")
    replicas = [Replica.objects.create(model=model, status=ReplicaStatus.PENDING, status_changed_at=_long_ago(),
                                       pending_reason="no room yet") for _ in range(3)]
    reasons = {r.pk: f"on ib-a: node0{i} GPUs 0,1" for i, r in enumerate(replicas)}

    replicas_transition_scheduled(replicas=replicas, reasons=reasons)

    for replica in Replica.objects.filter(pk__in=reasons):
        assert (replica.status, replica.status_reason, replica.pending_reason) == (
            ReplicaStatus.SCHEDULED, reasons[replica.pk], "")
        event = Event.objects.get(subject=f"replica/{replica.pk}")
        assert event.message == f"m replica {replica.pk}: pending -> scheduled: {reasons[replica.pk]}"
        assert event.data["to"] == ReplicaStatus.SCHEDULED


def test_a_batch_with_one_disallowed_row_changes_nothing():
    model = CatalogEntryFactory(name="m")
    pending = Replica.objects.create(model=model, status=ReplicaStatus.PENDING, status_changed_at=_long_ago())
    ready = Replica.objects.create(model=model, status=ReplicaStatus.READY, status_changed_at=_long_ago())

    with pytest.raises(InvalidReplicaTransition, match="is ready; it cannot become scheduled"):
        replicas_transition_scheduled(replicas=[pending, ready], reasons={pending.pk: "a", ready.pk: "b"})

    assert Replica.objects.get(pk=pending.pk).status == ReplicaStatus.PENDING
    assert Replica.objects.get(pk=ready.pk).status == ReplicaStatus.READY
    assert not Event.objects.exists()


# --- drains ------------------------------------------------------------------------------


def _drain(status):
    node = NodeFactory(name="node01")
    return Drain.objects.create(node=node, status=status, log=["before"])


@pytest.mark.parametrize(("start", "to"), DRAIN_ALLOWED, ids=_ids(DRAIN_ALLOWED))
def test_allowed_drain_transition_changes_status_and_writes_an_event(start, to):
    drain = _drain(start)

    result = DRAIN_STATES.transition(Drain.objects.filter(pk=drain.pk), to=to, reason="because a test said so",
                                     severity=EventSeverity.WARNING)

    assert result is not None and result.status == to
    drain.refresh_from_db()
    assert drain.status == to
    assert timezone.now() - drain.status_changed_at < timezone.timedelta(seconds=30)
    assert drain.log[0] == "before" and drain.log[-1].endswith(" because a test said so")
    assert (drain.finished_at is not None) == (to in DRAIN_ENDED)
    event = Event.objects.get(kind=ReplicaEventKind.DRAIN)
    assert (event.subject, event.message, event.severity) == ("node/node01", "drain: because a test said so", "warning")
    assert event.data == {"from": start, "to": to}


@pytest.mark.parametrize(("start", "to"), DRAIN_DISALLOWED, ids=_ids(DRAIN_DISALLOWED))
def test_disallowed_drain_transition_raises_and_changes_nothing(start, to):
    drain = _drain(start)
    changed_at = drain.status_changed_at

    with pytest.raises(InvalidDrainTransition, match=f"drain {drain.pk} of node01 is {start}; it cannot become {to}"):
        DRAIN_STATES.transition(Drain.objects.filter(pk=drain.pk), to=to, reason="nope")

    drain.refresh_from_db()
    assert (drain.status, drain.status_changed_at, drain.log, drain.finished_at) == (start, changed_at, ["before"], None)
    assert not Event.objects.exists()


# --- what callers see --------------------------------------------------------------------


@pytest.mark.parametrize("error", [InvalidTransition, InvalidReplicaTransition, InvalidDrainTransition])
def test_the_operator_api_answers_a_refused_transition_with_409(error):
    response = exception_handler(error("replica m#3 is stopped; it cannot become ready"), {})
    assert response.status_code == status.HTTP_409_CONFLICT
    assert response.data == {"detail": "replica m#3 is stopped; it cannot become ready"}


def test_the_gateway_registers_its_inflight_provider():
    # Installed, so registered at start: a drain never mistakes a missing
    # provider for "nothing in flight".
    assert gateway_selectors.replica_inflight in hooks.inflight_providers
    assert hooks.replica_inflight(replica_id=123456) == 0


def test_without_a_router_nothing_is_in_flight(monkeypatch):
    monkeypatch.setattr(hooks, "inflight_providers", [])
    assert hooks.replica_inflight(replica_id=1) == 0
    monkeypatch.setattr(hooks, "inflight_providers", [lambda replica_id: 2, lambda replica_id: 1])
    assert hooks.replica_inflight(replica_id=1) == 3
