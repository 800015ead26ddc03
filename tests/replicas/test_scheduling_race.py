"""Two schedulers racing with stale snapshots never allocate a GPU twice."""

import threading

import pytest
from django.db import connection
from django.utils import timezone

from replicas import scheduling
from replicas.choices import ReplicaStatus
from replicas.models import GpuAllocation, Replica
from tests.factories import CatalogEntryFactory, node_with_gpus

pytestmark = pytest.mark.django_db(transaction=True)


def test_racing_schedulers_with_the_same_stale_snapshot(no_reconcile_enqueue):
    node_with_gpus("node01", gpus=2)
    node_with_gpus("node02", gpus=2)
    model = CatalogEntryFactory(name="m", gpus_per_node=2, replicas=2)
    first = Replica.objects.create(model=model, status=ReplicaStatus.PENDING, status_changed_at=timezone.now())
    second = Replica.objects.create(model=model, status=ReplicaStatus.PENDING, status_changed_at=timezone.now())

    stale = scheduling.cluster_snapshot()
    from replicas import placement

    request = placement.PlacementRequest("m", 1, 2)
    same = placement.place(request, stale)  # both workers would choose this
    barrier = threading.Barrier(2)
    outcomes = {}

    def worker(replica):
        try:
            barrier.wait(timeout=10)
            scheduling.placements_persist([(replica, same)])
            outcomes[replica.pk] = "placed"
        except Exception as exc:  # noqa: BLE001 - the loser's error is the point
            outcomes[replica.pk] = type(exc).__name__
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(r,)) for r in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(outcomes.values()) == ["IntegrityError", "placed"], outcomes
    assert GpuAllocation.objects.count() == 2
    # The loser is still pending; the next pass, from a fresh snapshot, places it elsewhere.
    assert scheduling.replicas_schedule_pending() == 1
    nodes = {r.members.get().node.name for r in Replica.objects.filter(status=ReplicaStatus.SCHEDULED)}
    assert nodes == {"node01", "node02"}
