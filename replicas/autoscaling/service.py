"""The autoscaler's tick: gather each autoscaled model's signals, ask
``decide``, keep the sample, and persist a change under the usual locks
(the catalog entry, then its replicas), with an Event naming the signal
values and the rule.

Scaling up raises the model's count; the reconcile creates and places the
replicas. Scaling down picks the replicas to go (``choice``), moves them to
``stopping`` in the same transaction that lowers the count: they leave the
routing table at once and stop once their requests have finished
(``replicas_quiesce``), as a drained original does. Nothing is dropped.
"""

from __future__ import annotations

import logging
import time

from celery import current_app
from django.conf import settings
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from core.events import event_record
from nodes.models import Gpu

from .. import hooks
from ..choices import PLACED, ReplicaEventKind, ReplicaStatus
from ..enqueue import reconcile_after_commit
from ..models import CatalogEntry, GpuAllocation, Member, Replica
from ..services import replica_transition, replicas_lock
from . import history, signals
from .choice import Candidate, scale_down_pick
from .decide import Decision, Sample, Signals, decide
from .policy import Policy, policy_of

logger = logging.getLogger(__name__)


def _window(policy: Policy) -> float:
    return max(policy.up_after, policy.down_after, policy.zero_after, policy.cooldown) + 10.0


def model_signals(model: CatalogEntry, policy: Policy, load: tuple[int, int, float | None], at: float) -> Signals:
    counts = dict(Replica.objects.filter(model=model, draining=False, status__in=[ReplicaStatus.PENDING, *PLACED])
                  .values_list("status").annotate(n=Count("id")).order_by())
    stuck = Replica.objects.filter(model=model, status=ReplicaStatus.PENDING).exclude(pending_reason="").count()
    if model.never_fits_reason:
        stuck = max(stuck, 1)
    waiting = running = kv = None
    if policy.metric != "requests":
        waiting, running, kv = signals.engine_totals(signals.engine_load(signals.leader_urls(model.pk)))
    inflight, held, last = load
    return Signals(at=at, wanted=model.replicas, ready=counts.get(ReplicaStatus.READY, 0), inflight=inflight,
                   held=held, engine_waiting=waiting, engine_running=running, kv_usage=kv, stuck=stuck,
                   last_request_at=last)


def autoscale_tick(*, model_name: str | None = None) -> dict[str, Decision]:
    """One look at every autoscaled model (or one). Returns each decision."""
    models = CatalogEntry.objects.exclude(autoscale=None).filter(removing=False)
    if model_name is not None:
        models = models.filter(name=model_name)
    models = list(models)
    if not models:
        return {}
    loads = hooks.gateway_load()
    store = history.store()
    out = {}
    for model in models:
        try:
            out[model.name] = _model_tick(model, loads, store)
        except Exception:  # one model's trouble (Redis away, an engine) must not stop the others' looks
            logger.exception("autoscale tick failed model=%s; the next tick tries again", model.name)
    return out


def _model_tick(model: CatalogEntry, loads: dict, store) -> Decision:
    """Gather one model's signals, decide, keep the sample, apply a change."""
    policy = policy_of(model.autoscale)
    at = time.time()
    sig = model_signals(model, policy, loads.get(model.name, (0, 0, None)), at)
    window = _window(policy)
    # Read no more than the window holds (a tick every interval, plus the gateways' wake-ups).
    limit = int(window / max(settings.LLMGW_AUTOSCALE_INTERVAL, 0.2)) * 2 + 20
    past = [Sample(**{k: v for k, v in s.items() if k in Sample.__dataclass_fields__})
            for s in store.read(model.name, since=at - window, limit=limit)]
    last = model.autoscaled_at.timestamp() if model.autoscaled_at else None
    decision = decide(policy=policy, signals=sig, history=past, last_change_at=last)
    store.append(model.name, {**decision.sample.to_dict(), "inflight": sig.inflight, "held": sig.held,
                              "engine_waiting": sig.engine_waiting, "kv_usage": sig.kv_usage,
                              "rule": decision.rule, "to": decision.to})
    if decision.changes and model_autoscale_apply(model_id=model.pk, decision=decision, signals=sig,
                                                  policy=policy, seen_at=model.autoscaled_at):
        store.count_decision(model.name, decision.rule)
    return decision


def _nodes_wanted_for_pending(model_id: int) -> dict[int, int]:
    """{node id: GPUs a single-node pending replica of another model needs more
    than the node has free}: the nodes where freeing a replica lets it fit."""
    needs = sorted(set(Replica.objects.filter(status=ReplicaStatus.PENDING, model__nodes=1)
                       .exclude(model_id=model_id).exclude(pending_reason="")
                       .values_list("model__gpus_per_node", flat=True)))
    if not needs:
        return {}
    gpus = dict(Gpu.objects.filter(missing_since=None).values_list("node_id").annotate(n=Count("id")).order_by())
    used = dict(GpuAllocation.objects.values_list("node_id").annotate(n=Count("id")).order_by())
    short = {}
    for node_id, total in gpus.items():
        free = total - used.get(node_id, 0)
        missing = [need - free for need in needs if free < need <= total]
        if missing:
            short[node_id] = min(missing)
    return short


def _candidates(model_id: int) -> list[Candidate]:
    rows = Replica.objects.filter(model_id=model_id, draining=False, status__in=[ReplicaStatus.PENDING, *PLACED])
    short = _nodes_wanted_for_pending(model_id)
    held = {}
    if short:
        for replica_id, node_id, gpus in Member.objects.filter(replica__in=rows).values_list(
                "replica_id", "node_id", "gpus"):
            held.setdefault(replica_id, []).append((node_id, len(gpus or [])))
    out = []
    for r in rows:
        ready = r.status == ReplicaStatus.READY
        helps = any(node in short and count >= short[node] for node, count in held.get(r.pk, []))
        out.append(Candidate(r.pk, r.status, hooks.replica_inflight(replica_id=r.pk) if ready else 0,
                             wanted_for_pending=ready and helps))
    return out


def model_autoscale_apply(*, model_id: int, decision: Decision, signals: Signals, policy: Policy,
                          seen_at) -> bool:
    """Persist one decision, unless the model changed since it was read (another
    tick, an operator): then the next tick decides afresh. Returns whether it was applied."""
    # Read before any lock: in-flight counts come from the gateways' records.
    going = scale_down_pick(_candidates(model_id), signals.wanted - decision.to) if decision.to < signals.wanted else []
    with transaction.atomic():
        model = CatalogEntry.objects.select_for_update(no_key=True).filter(pk=model_id).first()
        if model is None or model.replicas != signals.wanted or model.autoscaled_at != seen_at or not model.autoscale:
            return False
        replicas_lock(c.replica_id for c in going)  # ascending pk, then stopped in the picked order
        for candidate in going:
            to = ReplicaStatus.STOPPED if candidate.status == ReplicaStatus.PENDING else ReplicaStatus.STOPPING
            replica_transition(replica_id=candidate.replica_id, to=to, expected=candidate.status,
                               reason=f"{model.name} scaled down by its autoscaler "
                               f"({candidate.inflight} request(s) in flight on it: it stops once they finish"
                               + ("; its GPUs let a pending replica fit" if candidate.wanted_for_pending else "")
                               + ")")
        model.replicas = decision.to
        model.autoscaled_at = timezone.now()
        model.save(update_fields=["replicas", "autoscaled_at"])
        event_record(
            kind=ReplicaEventKind.AUTOSCALE, subject=f"model/{model.name}",
            message=f"{model.name}: {decision.reason} (rule: {decision.rule})",
            data={"model": model.name, "from": signals.wanted, "to": decision.to, "rule": decision.rule,
                  "inflight": signals.inflight, "held": signals.held, "ready": signals.ready,
                  "engine_waiting": signals.engine_waiting, "kv_usage": signals.kv_usage,
                  "load": decision.sample.load, "recommended": decision.sample.recommended,
                  "metric": policy.metric, "target": policy.target,
                  "stopping": [c.replica_id for c in going]},
        )
        reconcile_after_commit()
    logger.info("autoscale model=%s %s rule=%s", model.name, decision.reason, decision.rule)
    return True


def autoscale_wake_request(*, model: str) -> None:
    """Ask for a tick of one model at once (a gateway holds requests for it).
    Sent by name, as replicas.enqueue sends the reconcile."""
    current_app.send_task("replicas.tasks.replicas_autoscale", kwargs={"model": model})
