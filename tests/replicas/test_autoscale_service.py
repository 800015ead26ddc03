"""The autoscaler's tick against the database: signals in, the count changed
under the locks, an Event naming the values and the rule; a scale-down
stops the replica with the fewest requests in flight (or the one whose node
another model's pending replica waits for), which leaves routing and stops
once they finish."""

from __future__ import annotations

import pytest
from django.utils import timezone

from core.models import Event
from replicas import hooks
from replicas.autoscaling import history, service
from replicas.catalog import AutoscaledModel, CatalogInvalid, catalog_apply, model_scale, model_scale_bounds
from replicas.choices import ReplicaStatus
from replicas.models import CatalogEntry, Replica
from tests.factories import node_with_gpus

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue")]

POLICY = {"min": 1, "max": 6, "target": 4, "up_after": 0, "down_after": 0, "cooldown": 0, "max_step": 2}


@pytest.fixture(autouse=True)
def clean_history():
    store = history.store()
    store.client.delete(history.KEY.format("qwen"), history.DECISIONS_KEY)
    yield
    store.client.delete(history.KEY.format("qwen"), history.DECISIONS_KEY)


@pytest.fixture
def load(monkeypatch):
    current: dict[str, tuple[int, int, float | None]] = {}
    monkeypatch.setattr(hooks, "load_providers", [lambda: dict(current)])
    return current


def _model(replicas: int = 1, policy=None, ready: int | None = None) -> CatalogEntry:
    node_with_gpus("node01")
    catalog_apply(entries=[{"name": "qwen", "engine": "sim", "model": "/m", "replicas": replicas,
                            "autoscale": dict(POLICY, **(policy or {}))}])
    model = CatalogEntry.objects.get(name="qwen")
    for _ in range(model.replicas if ready is None else ready):
        Replica.objects.create(model=model, status=ReplicaStatus.READY, status_changed_at=timezone.now())
    return model


def test_policy_is_validated_by_name():
    with pytest.raises(CatalogInvalid) as exc:
        catalog_apply(entries=[{"name": "qwen", "engine": "sim", "model": "/m",
                                "autoscale": {"min": 3, "max": 2, "targett": 4}}])
    assert "models[0] (qwen): autoscale.targett: unknown key; did you mean target?" in str(exc.value)
    with pytest.raises(CatalogInvalid) as exc:
        catalog_apply(entries=[{"name": "qwen", "engine": "sim", "model": "/m", "autoscale": {"min": 3, "max": 2}}])
    assert "min (3) is above max (2)" in str(exc.value)
    assert not CatalogEntry.objects.exists()


def test_defaults_filled_and_count_kept_within_bounds():
    catalog_apply(entries=[{"name": "qwen", "engine": "sim", "model": "/m", "replicas": 9,
                            "autoscale": {"max": 3}}])
    model = CatalogEntry.objects.get(name="qwen")
    assert model.replicas == 3
    assert model.autoscale["metric"] == "requests" and model.autoscale["target"] == 4.0
    # Re-applying the file does not reset what the autoscaler set.
    CatalogEntry.objects.filter(pk=model.pk).update(replicas=2)
    catalog_apply(entries=[{"name": "qwen", "engine": "sim", "model": "/m", "replicas": 1, "autoscale": {"max": 3}}])
    assert CatalogEntry.objects.get(name="qwen").replicas == 2


def test_scale_by_hand_refused_bounds_set():
    _model(replicas=2)
    with pytest.raises(AutoscaledModel) as exc:
        model_scale(name="qwen", replicas=5)
    assert "qwen is autoscaled (1-6 replicas, now 2)" in str(exc.value) and "--min N --max M" in str(exc.value)
    model = model_scale_bounds(name="qwen", min=3, max=4)
    assert (model.autoscale["min"], model.autoscale["max"], model.replicas) == (3, 4, 3)
    with pytest.raises(CatalogInvalid) as exc:
        model_scale_bounds(name="qwen", min=5)
    assert "min (5) is above max (4)" in str(exc.value)


def test_load_up_scales_up_with_an_event_naming_the_values(load):
    _model(replicas=1)
    load["qwen"] = (14, 3, None)
    decision = service.autoscale_tick()["qwen"]
    assert (decision.rule, decision.to) == ("up", 3)  # ceil(17 / 4) = 5, at most 2 per step
    assert CatalogEntry.objects.get(name="qwen").replicas == 3
    event = Event.objects.filter(kind="autoscale").get()
    assert "qwen: 1 -> 3 replicas: 14 request(s) in flight and 3 held over 1 ready replica(s)" in event.message
    assert "target 4 per replica" in event.message and "rule: up" in event.message
    assert event.data["inflight"] == 14 and event.data["held"] == 3 and event.data["rule"] == "up"
    assert history.store().decisions()[("qwen", "up")] == 1


def test_scale_down_stops_the_replica_with_fewest_in_flight(load, monkeypatch):
    model = _model(replicas=3)
    busy = {r.pk: n for r, n in zip(Replica.objects.filter(model=model).order_by("pk"), (5, 0, 2))}
    monkeypatch.setattr(hooks, "inflight_providers", [lambda replica_id: busy[replica_id]])
    load["qwen"] = (3, 0, None)
    decision = service.autoscale_tick()["qwen"]
    assert (decision.rule, decision.to) == ("down", 1)
    stopping = set(Replica.objects.filter(status=ReplicaStatus.STOPPING).values_list("pk", flat=True))
    idle = sorted(busy, key=busy.get)[:2]
    assert stopping == set(idle)
    assert CatalogEntry.objects.get(name="qwen").replicas == 1


def test_cooldown_holds_the_next_change(load):
    _model(replicas=1, policy={"cooldown": 60})
    load["qwen"] = (40, 0, None)
    assert service.autoscale_tick()["qwen"].to == 3
    assert service.autoscale_tick()["qwen"].rule == "cooldown"
    assert CatalogEntry.objects.get(name="qwen").replicas == 3


def test_a_model_that_fits_nowhere_asks_for_no_more(load):
    model = _model(replicas=1)
    Replica.objects.create(model=model, status=ReplicaStatus.PENDING, status_changed_at=timezone.now(),
                           pending_reason="no node has 1 free GPU")
    load["qwen"] = (40, 0, None)
    decision = service.autoscale_tick()["qwen"]
    assert decision.rule == "capacity" and not decision.changes


def test_two_models_wanting_the_same_gpus_pile_up_nothing_and_do_not_flap(load):
    from replicas import reconcile

    node_with_gpus("node01", gpus=3)
    policy = dict(POLICY, max=6, max_step=2)
    catalog_apply(entries=[{"name": name, "engine": "sim", "model": "/m", "replicas": 1, "autoscale": policy}
                           for name in ("alpha", "beta")])
    reconcile.replicas_reconcile()
    load.update(alpha=(40, 0, None), beta=(40, 0, None))
    seen: dict[str, list[int]] = {"alpha": [], "beta": []}
    try:
        for _ in range(8):
            service.autoscale_tick()
            reconcile.replicas_reconcile()
            for name in seen:
                seen[name].append(CatalogEntry.objects.get(name=name).replicas)
    finally:
        history.store().client.delete(*(history.KEY.format(n) for n in seen))
    placed = Replica.objects.exclude(status__in=[ReplicaStatus.PENDING, ReplicaStatus.STOPPED]).count()
    assert placed == 3  # every GPU used
    for name, counts in seen.items():
        # One step up at most (max_step 2), then nothing more while a replica waits for GPUs.
        assert counts == sorted(counts) and counts[-1] <= 3, (name, counts)
        assert len(set(counts[2:])) == 1, (name, counts)
    pending = Replica.objects.filter(status=ReplicaStatus.PENDING)
    assert pending.exists() and all(r.pending_reason for r in pending)
    assert Event.objects.filter(kind="autoscale").count() <= 2


def test_scale_down_gives_up_the_replica_whose_node_a_pending_replica_waits_for(load, monkeypatch, settings):
    """Through the services: qwen has a replica on node01 (idle) and one on node02 (busy); big needs node02's
    two GPUs and waits. The scale-down stops node02's replica (not the idle one), it stops once its requests
    have finished, and big is placed where it was."""
    from nodes.services import node_cordon, node_uncordon
    from replicas import reconcile, services

    from .test_services import _placement, _report

    settings.LLMGW_ROUTING_SETTLE = 0
    nodes = {"node01": node_with_gpus("node01", gpus=1, addr="127.0.1.1"),
             "node02": node_with_gpus("node02", gpus=2, addr="127.0.1.2")}

    def converge():
        for node in nodes.values():
            node.refresh_from_db()
            _report(node)

    # qwen's first replica on node01 (node02 cordoned while it is placed), its second on node02.
    node_cordon(node_name="node02")
    catalog_apply(entries=[{"name": "qwen", "engine": "sim", "model": "/m", "replicas": 1, "autoscale": POLICY}])
    reconcile.replicas_reconcile()
    node_uncordon(node_name="node02")
    CatalogEntry.objects.filter(name="qwen").update(replicas=2)
    reconcile.replicas_reconcile()
    converge()
    converge()
    placed = {r.pk: set(_placement(r)) for r in Replica.objects.filter(model__name="qwen", status=ReplicaStatus.READY)}
    assert sorted(map(sorted, placed.values())) == [["node01"], ["node02"]], placed
    on_node01 = next(pk for pk, where in placed.items() if where == {"node01"})
    on_node02 = next(pk for pk, where in placed.items() if where == {"node02"})
    # big wants both of node02's GPUs: it waits, and says why.
    catalog_apply(entries=[{"name": "qwen", "engine": "sim", "model": "/m", "replicas": 1, "autoscale": POLICY},
                           {"name": "big", "engine": "sim", "model": "/m", "replicas": 1, "gpus_per_node": 2}])
    reconcile.replicas_reconcile()
    big = Replica.objects.get(model__name="big")
    assert big.status == ReplicaStatus.PENDING and big.pending_reason

    # node02's replica is the busier: fewest-in-flight alone would stop node01's.
    busy = {on_node01: 0, on_node02: 3}
    monkeypatch.setattr(hooks, "inflight_providers", [lambda replica_id: busy.get(replica_id, 0)])
    load["qwen"] = (3, 0, None)
    decision = service.autoscale_tick()["qwen"]
    assert (decision.rule, decision.to) == ("down", 1)
    assert Replica.objects.get(pk=on_node02).status == ReplicaStatus.STOPPING
    assert Replica.objects.get(pk=on_node01).status == ReplicaStatus.READY
    event = Event.objects.filter(kind="autoscale").get()
    assert event.data["stopping"] == [on_node02]
    assert Event.objects.filter(subject=f"replica/{on_node02}",
                                message__contains="its GPUs let a pending replica fit").exists()

    # It stops once its requests have finished, not before; then big takes node02.
    services.replicas_quiesce()
    assert Replica.objects.get(pk=on_node02).quiesced is False
    busy[on_node02] = 0
    services.replicas_quiesce()
    assert Replica.objects.get(pk=on_node02).quiesced is True
    # Its agent stops it: node02 reports no engine of it any more.
    gone = Replica.objects.get(pk=on_node02)
    _report(nodes["node02"], **{m.member_id: (None, False) for m in gone.members.all()})
    assert Replica.objects.get(pk=on_node02).status == ReplicaStatus.STOPPED
    reconcile.replicas_reconcile()
    converge()
    converge()
    big.refresh_from_db()
    assert big.status == ReplicaStatus.READY and set(_placement(big)) == {"node02"}
    assert Replica.objects.get(pk=on_node01).status == ReplicaStatus.READY
