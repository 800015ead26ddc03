"""Rollouts: a model's running replicas replaced by its new revision.

A change of a catalog entry's launch (``replicas.revisions``) starts one
(``rollout_begin``, from the catalog's transaction). The reconcile steps
every open rollout (``rollouts_step``): the pure ``rollout_plan.rollout_next``
decides, this module persists, in the lock order of docs/architecture.md
(the catalog entry, then its rollout, then replicas). Operators pause,
resume and undo (``rollout_pause``, ``rollout_resume``, ``rollout_undo``).

Weights: a new revision with other weights has them staged on the nodes
its replacements will likely run on before the first replacement starts
(``replicas.rollout_weights``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from core.choices import EventSeverity
from core.events import event_record
from core.exceptions import NotFound
from core.statemachine import StateMachine

from .choices import PLACED, ROLLOUT_OPEN, ROLLOUT_TRANSITIONS, MemberState, ReplicaEventKind, ReplicaStatus, RolloutStatus
from .defrag import MAKING_ROOM
from .enqueue import reconcile_after_commit
from .exceptions import InvalidRolloutTransition
from .models import CatalogEntry, ModelRevision, Replica, Rollout
from .revisions import LAUNCH_FIELDS, revision_current, revision_manifest, revision_previous
from .rollout_plan import Rep, RolloutView, rollout_next
from .rollout_weights import rollout_weights_gate, rollout_weights_release
from .services import replica_transition, replicas_lock

logger = logging.getLogger(__name__)

LOG_LINES = 200


def _log_line(rollout: Rollout, message: str) -> None:
    rollout.log = [*rollout.log, f"{timezone.now():%H:%M:%S} {message}"][-LOG_LINES:]


def _label(rollout: Rollout) -> str:
    return f"{rollout.model.name} revision {rollout.from_revision} -> {rollout.to_revision}"


def _say(rollout: Rollout, message: str, severity: str = EventSeverity.INFO, **data: Any) -> None:
    """A step of the rollout: a line in its log and an Event."""
    _log_line(rollout, message)
    event_record(kind=ReplicaEventKind.ROLLOUT, subject=f"model/{rollout.model.name}",
                 message=f"{_label(rollout)}: {message}", severity=severity,
                 data={"model": rollout.model.name, "from": rollout.from_revision, "to": rollout.to_revision, **data})


class RolloutStates(StateMachine):
    noun = "rollout"
    table = ROLLOUT_TRANSITIONS
    error = InvalidRolloutTransition
    event_kind = ReplicaEventKind.ROLLOUT

    def subject(self, rollout: Rollout) -> str:
        return f"model/{rollout.model.name}"

    def message(self, rollout: Rollout, previous: str, to: str, reason: str) -> str:
        return f"{_label(rollout)}: {to}" + (f": {reason}" if reason else "")

    def data(self, rollout: Rollout, previous: str, to: str) -> dict[str, Any]:
        return {"model": rollout.model.name, "from": previous, "to": to,
                "revisions": [rollout.from_revision, rollout.to_revision]}

    def changing(self, rollout: Rollout, previous: str, to: str) -> list[str]:
        _log_line(rollout, f"{to}" + (f": {rollout.status_reason}" if rollout.status_reason else ""))
        fields = ["log"]
        if to in (RolloutStatus.DONE, RolloutStatus.SUPERSEDED):
            rollout.finished_at = timezone.now()
            fields.append("finished_at")
        if to == RolloutStatus.RUNNING and (previous == RolloutStatus.FAILED or (rollout.staging or {}).get("failed")):
            rollout.staging = {}  # tried again: staged again (at once where the weights are held)
            fields.append("staging")
        return fields

    def changed(self, rollout: Rollout, previous: str, to: str) -> None:
        if to in (RolloutStatus.DONE, RolloutStatus.SUPERSEDED, RolloutStatus.FAILED):
            rollout_weights_release(rollout)


ROLLOUT_STATES = RolloutStates()


def _open_lock(model: CatalogEntry) -> Rollout | None:
    return (Rollout.objects.select_for_update(of=("self",), no_key=True).select_related("model")
            .filter(model=model, status__in=ROLLOUT_OPEN).first())


def rollout_open(model: CatalogEntry) -> Rollout | None:
    return Rollout.objects.filter(model=model, status__in=ROLLOUT_OPEN).first()


def _digests(model: CatalogEntry) -> dict[int, str]:
    return dict(ModelRevision.objects.filter(model=model).values_list("pk", "digest"))


def _is_current(replica: Replica, digests: dict[int, str], digest: str) -> bool:
    # A replica with no revision recorded launches as the entry is now.
    return replica.revision_id is None or digests.get(replica.revision_id) == digest


def revision_for_new_replicas(model: CatalogEntry) -> ModelRevision:
    """What a replica the reconcile makes now runs: the current revision,
    except while a rollout has failed (the old revision keeps serving, and a
    replica lost meanwhile is rebuilt as it was). The entry's row is locked.

    Level-triggered: an entry whose launch fields were changed other than
    through the catalog's services (a Django shell, SQL) gets its revision
    recorded here, at the reconcile's next pass, and rolled out like any."""
    previous = model.revision
    current = revision_current(model)
    if previous and current.number != previous:
        event_record(kind=ReplicaEventKind.MODEL, subject=f"model/{model.name}",
                     message=f"{model.name}: revision {previous} -> {current.number}: its launch was changed outside "
                     "the catalog's services (found by the reconcile)",
                     data={"revision": current.number, "previous": previous})
        rollout_begin(model=model, previous=previous, why="found changed by the reconcile",
                      actor="reconcile")
    rollout = rollout_open(model)
    if rollout is not None and rollout.status == RolloutStatus.FAILED:
        stable = ModelRevision.objects.filter(model=model, number=rollout.from_revision).first()
        if stable is not None:
            return stable
    return current


def rollout_begin(*, model: CatalogEntry, previous: int, actor: str = "", why: str = "applied") -> Rollout | None:
    """The entry's launch changed (its revision is now ``model.revision``,
    recorded): supersede an open rollout, point replicas not yet placed at the
    new revision, and start replacing the placed ones. Called with the entry's
    row locked. Returns the new rollout, or None when nothing runs the old one."""
    current = ModelRevision.objects.get(model=model, number=model.revision)
    digests = _digests(model)
    open_ = _open_lock(model)
    # A paused rollout stays paused across changes (as a paused Deployment
    # does): the new one starts paused, and an operator resumes it.
    paused = open_ is not None and open_.status == RolloutStatus.PAUSED
    if open_ is not None:
        open_.model = model
        ROLLOUT_STATES.apply(open_, to=RolloutStatus.SUPERSEDED, reason=f"revision {model.revision} was {why}"
                             + ("; the new rollout starts paused" if paused else ""))
        # What serves meanwhile is still the superseded rollout's old revision.
        previous = open_.from_revision
    replicas = list(Replica.objects.filter(model=model).exclude(status=ReplicaStatus.STOPPED).order_by("pk"))
    stale = [r for r in replicas if not _is_current(r, digests, current.digest)]
    # Not launched yet: they simply launch as the new revision.
    Replica.objects.filter(pk__in=[r.pk for r in stale if r.status == ReplicaStatus.PENDING]).update(revision=current)
    placed = [r for r in stale if r.status in PLACED]
    if not placed:
        return None
    rollout = Rollout.objects.create(model=model, from_revision=previous, to_revision=model.revision,
                                     wanted=model.replicas, actor=actor,
                                     status=RolloutStatus.PAUSED if paused else RolloutStatus.RUNNING)
    rollout.model = model
    changed = [f for f in LAUNCH_FIELDS if (ModelRevision.objects.filter(model=model, number=previous)
                                            .values_list("spec", flat=True).first() or {}).get(f) != current.spec.get(f)]
    _say(rollout, f"started{' paused' if paused else ''}{' by ' + actor if actor else ''} "
         f"({', '.join(changed) or 'launch'} changed): "
         f"{len(placed)} replica(s) to replace, max_surge {model.max_surge}, max_unavailable {model.max_unavailable}"
         + (f"; the rollout it supersedes was paused, so this one is too: 'llmgw ctl rollout resume {model.name}' "
            "carries it on" if paused else ""),
         replicas=len(placed), paused=paused)
    if paused:
        rollout.status_reason = "paused: the rollout it superseded was paused"
        rollout.waiting_for = "paused (the rollout it superseded was): resume to start replacing"
    rollout.save(update_fields=["log", "status_reason", "waiting_for"])
    reconcile_after_commit()
    return rollout


# --- stepping -------------------------------------------------------------------------------


def _stuck(model: CatalogEntry, current_ids: set[int]) -> str:
    """Why a replacement of the new revision fits nowhere, when nothing under
    way can make room ('' otherwise: the rollout waits for room to come)."""
    pending = (Replica.objects.filter(model=model, status=ReplicaStatus.PENDING, pk__in=current_ids)
               .exclude(pending_reason="").exclude(pending_reason__contains=MAKING_ROOM).order_by("pk").first())
    if pending is None:
        return ""
    freeing = (Replica.objects.filter(status__in=[ReplicaStatus.STOPPING, ReplicaStatus.FAILED])
               .filter(members__state__in=[s for s in MemberState.values if s != MemberState.GONE]).exists())
    return "" if freeing else pending.pending_reason


def _where(replica: Replica) -> str:
    if replica.fabric_id:
        return replica.fabric.name
    member = replica.members.select_related("node").first()
    return member.node.name if member else "?"


def rollout_step(*, rollout_id: int) -> None:
    """Advance one open rollout as far as it can go now. Idempotent."""
    model_id = Rollout.objects.filter(pk=rollout_id, status__in=ROLLOUT_OPEN).values_list("model_id", flat=True).first()
    if model_id is None:
        return
    with transaction.atomic():
        model = CatalogEntry.objects.select_for_update(no_key=True).filter(pk=model_id).first()
        rollout = _open_lock(model) if model is not None else None
        if rollout is None or rollout.pk != rollout_id:
            return
        rollout.model = model
        target = ModelRevision.objects.filter(model=model, number=rollout.to_revision).first()
        if target is None or model.revision != rollout.to_revision:
            ROLLOUT_STATES.apply(rollout, to=RolloutStatus.SUPERSEDED,
                                 reason=f"the model is at revision {model.revision} now")
            return
        digests = _digests(model)
        replicas = list(Replica.objects.filter(model=model).exclude(status=ReplicaStatus.STOPPED)
                        .select_related("fabric").order_by("pk"))
        current_ids = {r.pk for r in replicas if _is_current(r, digests, target.digest)}
        failures = Replica.objects.filter(
            model=model, revision__digest=target.digest, created_at__gte=rollout.counting_since,
            ready_at__isnull=True).exclude(failed_reason="")
        failed = list(failures.order_by("-pk").values_list("pk", "failed_reason")[:50])
        view = RolloutView(
            status=rollout.status, wanted=model.replicas, max_surge=model.max_surge,
            max_unavailable=model.max_unavailable, failures=len(failed),
            max_failures=settings.LLMGW_ROLLOUT_MAX_FAILURES,
            replicas=tuple(Rep(r.pk, r.status, r.pk in current_ids, r.draining, r.rolling) for r in replicas),
            stuck=_stuck(model, current_ids),
        )
        step = rollout_next(view)
        if step.status in (RolloutStatus.RUNNING, RolloutStatus.PAUSED):
            # New weights are staged on the likely nodes before any replacement starts.
            gate = rollout_weights_gate(rollout, model, target, lambda message, **data: _say(rollout, message, **data))
            if gate.failed and rollout.status == RolloutStatus.RUNNING:
                rollout.waiting_for = "failed: the old revision serves; resume to try again, or undo"
                ROLLOUT_STATES.apply(rollout, to=RolloutStatus.FAILED, severity=EventSeverity.ERROR,
                                     reason=f"the new weights could not be staged: {gate.failed}; "
                                     "the old replicas keep serving")
                rollout.save(update_fields=["waiting_for"])
                return
            if gate.failed or gate.waiting:
                waiting = gate.waiting or f"staging failed ({gate.failed}); resume to stage them again"
                step = replace(step, mark=(), waiting_for=f"paused; {waiting}" if step.status == RolloutStatus.PAUSED
                               else waiting)
        _apply(rollout, model, step, replicas, failed)


def _apply(rollout: Rollout, model: CatalogEntry, step, replicas: list[Replica], failed: list[tuple[int, str]]) -> None:
    by_id = {r.pk: r for r in replicas}
    # Every row this step changes, locked first in ascending pk (the lock
    # order): they are then changed in the plan's order.
    replicas_lock({*step.release, *step.stop_new, *step.mark, *step.stop})
    if step.release:
        Replica.objects.filter(pk__in=step.release).update(draining=False, rolling=False)
    for pk in step.stop_new:
        replica = by_id[pk]
        to = ReplicaStatus.STOPPED if replica.status == ReplicaStatus.PENDING else ReplicaStatus.STOPPING
        replica_transition(replica_id=pk, to=to, expected=replica.status,
                           reason=f"rollout to revision {rollout.to_revision} failed")
    if step.mark:
        Replica.objects.filter(pk__in=step.mark).update(draining=True, rolling=True)
        for pk in step.mark:
            _say(rollout, f"replacing replica {pk}", replica=pk)
    if step.stop:
        fresh = [r for r in replicas if r.pk not in step.stop and r.status == ReplicaStatus.READY and not r.draining
                 and r.ready_at is not None]
        fresh.sort(key=lambda r: r.ready_at, reverse=True)
        for index, pk in enumerate(step.stop):
            original = by_id[pk]
            early = index < step.unavailable
            why = ("stopped before its replacement is ready: no room to surge (max_unavailable "
                   f"{model.max_unavailable})") if early else "its replacement is ready"
            if replica_transition(replica_id=pk, to=ReplicaStatus.STOPPING, expected=PLACED,
                                  reason=f"replaced by revision {rollout.to_revision}: {why}") is None:
                continue
            done = len(step.stop) - 1 - index
            replacement = fresh[index] if index < len(fresh) and not early else None
            ready = f"replica {replacement.pk} ready on {_where(replacement)}, " if replacement else ""
            _say(rollout, f"{ready}replica {pk} stopping{' (no room to surge)' if early else ''} "
                 f"({step.updated} of {model.replicas})",
                 severity=EventSeverity.WARNING if early else EventSeverity.INFO, replica=pk,
                 replacement=replacement.pk if replacement else None, remaining=done)
    before = (rollout.failures, rollout.updated, rollout.wanted, rollout.waiting_for, len(rollout.log))
    rollout.failures = len(failed)
    rollout.updated = step.updated
    rollout.wanted = model.replicas
    rollout.waiting_for = step.waiting_for
    if step.status != rollout.status:
        reason = step.reason
        if step.status == RolloutStatus.FAILED and failed:
            reason += f"; the last: replica {failed[0][0]}: {failed[0][1]}"
        ROLLOUT_STATES.apply(rollout, to=step.status, reason=reason,
                             severity=EventSeverity.ERROR if step.status == RolloutStatus.FAILED else EventSeverity.INFO)
        if step.status == RolloutStatus.DONE:
            rollout.waiting_for = ""
    if before != (rollout.failures, rollout.updated, rollout.wanted, rollout.waiting_for, len(rollout.log)) or (
            step.mark or step.stop or step.release):
        # A rollout that waits (or has failed) writes nothing at every pass.
        rollout.save(update_fields=["failures", "updated", "wanted", "waiting_for", "log"])
    if step.mark or step.release:
        reconcile_after_commit()


def rollouts_step() -> None:
    for rollout_id in list(Rollout.objects.filter(status__in=ROLLOUT_OPEN).values_list("pk", flat=True)):
        rollout_step(rollout_id=rollout_id)


# --- operators ------------------------------------------------------------------------------


def _model_lock(name: str) -> CatalogEntry:
    model = CatalogEntry.objects.select_for_update(no_key=True).filter(name=name).first()
    if model is None:
        raise NotFound(f"no model named {name!r} in the catalog; 'llmgw ctl models' lists them")
    return model


def rollout_latest(*, name: str) -> tuple[CatalogEntry, Rollout | None]:
    model = CatalogEntry.objects.filter(name=name).first()
    if model is None:
        raise NotFound(f"no model named {name!r} in the catalog; 'llmgw ctl models' lists them")
    return model, Rollout.objects.filter(model=model).select_related("model").first()


def _change(name: str, *, to: str, allowed: set[str], verb: str, actor: str) -> Rollout:
    with transaction.atomic():
        model = _model_lock(name)
        rollout = _open_lock(model)
        if rollout is None or rollout.status not in allowed:
            state = f"its last rollout is {rollout.status}" if rollout else "it has no rollout under way"
            last = Rollout.objects.filter(model=model).first()
            if rollout is None and last is not None:
                state = f"its last rollout (revision {last.from_revision} -> {last.to_revision}) is {last.status}"
            raise InvalidRolloutTransition(f"cannot {verb} the rollout of {name}: {state}")
        rollout.model = model
        if to == RolloutStatus.RUNNING and rollout.status == RolloutStatus.FAILED:
            rollout.counting_since = timezone.now()
            rollout.save(update_fields=["counting_since"])
        ROLLOUT_STATES.apply(rollout, to=to, reason=f"{verb}d by {actor or 'an operator'}")
        reconcile_after_commit()
    return rollout


def rollout_pause(*, name: str, actor: str = "") -> Rollout:
    return _change(name, to=RolloutStatus.PAUSED, allowed={RolloutStatus.RUNNING}, verb="pause", actor=actor)


def rollout_resume(*, name: str, actor: str = "") -> Rollout:
    """Carry on a paused rollout, or try a failed one again with a fresh failure budget."""
    return _change(name, to=RolloutStatus.RUNNING, allowed={RolloutStatus.PAUSED, RolloutStatus.FAILED},
                   verb="resume", actor=actor)


def rollout_undo(*, name: str, actor: str = "") -> tuple[CatalogEntry, Rollout | None]:
    """Back to the previous revision: the entry's launch fields become that
    revision's again (a new revision number, as kubectl's undo does), rolled
    out like any change. Refused while a rollout is paused, as kubectl
    refuses to roll back a paused Deployment: resume it first."""
    with transaction.atomic():
        model = _model_lock(name)
        open_ = _open_lock(model)
        if open_ is not None and open_.status == RolloutStatus.PAUSED:
            raise InvalidRolloutTransition(
                f"cannot undo the rollout of {name} while it is paused (revision {open_.from_revision} -> "
                f"{open_.to_revision}): resume it first ('llmgw ctl rollout resume {name}'), then undo")
        previous = revision_previous(model)
        if previous is None:
            raise InvalidRolloutTransition(
                f"{name} has no previous revision to return to (it is at revision {model.revision})")
        was = model.revision
        if previous.spec.get("source") and previous.spec.get("source") != model.source and not previous.manifest:
            raise InvalidRolloutTransition(
                f"revision {previous.number} of {name} was recorded before weights manifests were kept with "
                "revisions: apply the catalog with its source instead")
        for field, value in previous.spec.items():
            if field in LAUNCH_FIELDS:
                setattr(model, field, value)
        # Its weights as they were resolved then (no source read again).
        model.manifest = revision_manifest(previous, model)
        model.save()
        revision_current(model)
        event_record(kind=ReplicaEventKind.MODEL, subject=f"model/{name}",
                     message=f"{name}: undo by {actor or 'an operator'}: revision {was} -> {model.revision} "
                     f"(as revision {previous.number})", data={"actor": actor} if actor else None)
        rollout = rollout_begin(model=model, previous=was, actor=actor, why=f"undone to revision {previous.number}")
        reconcile_after_commit()
    return model, rollout


def replicas_by_revision(model: CatalogEntry) -> dict[str, int]:
    """Ready replicas on the current revision, and all ready ones."""
    current = ModelRevision.objects.filter(model=model, number=model.revision).values_list("digest", flat=True).first()
    ready = Replica.objects.filter(model=model, status=ReplicaStatus.READY)
    on_current = ready.filter(Q(revision__digest=current) | Q(revision__isnull=True)).count() if current else ready.count()
    return {"ready": ready.count(), "ready_current": on_current}
