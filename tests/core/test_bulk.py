"""core.bulk: COPY on PostgreSQL and bulk_create elsewhere write the same rows."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from core.bulk import rows_insert, rows_insert_returning
from core.models import Event
from replicas.models import GpuAllocation, Member, Replica
from tests.factories import CatalogEntryFactory, node_with_gpus

# Text that COPY's text format must escape: tab, newline, backslash, quotes, NUL-free unicode.
AWKWARD = 'a\tb\nc\\d "quoted" \'single\' \\N ünï €'


@pytest.fixture(params=["postgresql", "fallback"])
def path(request, monkeypatch):
    """Each test runs through COPY and through bulk_create (the embedded path)."""
    assert connection.vendor == "postgresql"
    if request.param == "fallback":
        monkeypatch.setattr(connection, "vendor", "sqlite")
    return request.param


def _member_rows(replica, nodes):
    return [
        {"replica_id": replica.pk, "node_id": nodes[rank].pk, "rank": rank, "gpus": [rank],
         "argv": ["--flag", AWKWARD], "env": {"K": AWKWARD, "EMPTY": ""}, "ports": {"http": 2000 + rank},
         "serves_http": rank == 0, "health_url": f"http://127.0.0.1:{2000 + rank}/health"}
        for rank in range(2)
    ]


@pytest.mark.django_db(transaction=True)
def test_rows_are_written_whole_with_defaults_and_ids_in_order(path):
    node, second = node_with_gpus("node01", gpus=0), node_with_gpus("node02", gpus=0)
    model = CatalogEntryFactory(nodes=2)
    replica = Replica.objects.create(model=model, status="pending", status_changed_at=timezone.now())
    other = Replica.objects.create(model=model, status="pending", status_changed_at=timezone.now())
    with transaction.atomic():
        ids = rows_insert_returning(Member, _member_rows(replica, [node, second]) + _member_rows(other, [node, second])[:1])
    members = list(Member.objects.order_by("pk"))
    assert [m.pk for m in members] == ids and len(set(ids)) == 3
    assert [(m.replica_id, m.rank) for m in members] == [(replica.pk, 0), (replica.pk, 1), (other.pk, 0)]
    first = members[0]
    assert first.argv == ["--flag", AWKWARD] and first.env == {"K": AWKWARD, "EMPTY": ""}
    assert first.ports == {"http": 2000} and first.gpus == [0] and first.serves_http is True
    # What the rows left out is the model's default.
    assert (first.state, first.pid, first.healthy, first.log_tail, first.restarts, first.reported_at) == (
        "pending", None, False, [], 0, None)

    with transaction.atomic():
        rows_insert(Event, [
            {"kind": "replica.status", "subject": "replica/1", "message": AWKWARD, "node_id": node.pk,
             "severity": "warning", "data": {"text": AWKWARD, "n": [1, None, True]}},
            {"kind": "replica.status", "subject": "replica/2", "message": "plain"},
        ])
    events = list(Event.objects.order_by("pk"))
    assert [e.subject for e in events] == ["replica/1", "replica/2"]
    assert events[0].message == AWKWARD and events[0].data == {"text": AWKWARD, "n": [1, None, True]}
    assert events[0].node_id == node.pk and events[0].severity == "warning"
    assert events[1].created_at is not None and events[1].node_id is None
    assert events[1].severity == "info" and events[1].data == {}


@pytest.mark.django_db(transaction=True)
def test_a_gpu_given_twice_is_an_integrity_error_and_nothing_is_kept(path):
    node, second = node_with_gpus("node01", gpus=1), node_with_gpus("node02", gpus=0)
    gpu = node.gpus.get()
    model = CatalogEntryFactory(nodes=2)
    replica = Replica.objects.create(model=model, status="pending", status_changed_at=timezone.now())
    with pytest.raises(IntegrityError):
        with transaction.atomic():
            a, b = rows_insert_returning(Member, _member_rows(replica, [node, second]))
            rows_insert(GpuAllocation, [{"gpu_id": gpu.pk, "member_id": a, "node_id": node.pk},
                                        {"gpu_id": gpu.pk, "member_id": b, "node_id": node.pk}])
    assert not Member.objects.exists() and not GpuAllocation.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_missing_referenced_row_is_refused_at_commit(path):
    """The foreign keys are checked as for any insert (deferred to the commit)."""
    with pytest.raises(IntegrityError):
        with transaction.atomic():
            rows_insert(Event, [{"kind": "replica.status", "subject": "x", "message": "y", "node_id": 987654}])
    assert not Event.objects.exists()
