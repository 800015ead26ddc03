"""A model's page: its shape and revision, its rollout (steered here by
operators), its replicas; its autoscaling policy (and the form that sets it),
the current signals, a chart of replicas against load over the last hour
(SVG drawn here), and its Events."""

from __future__ import annotations

import time

from django.contrib import messages
from django.db.models import Count
from django.http import Http404
from django.shortcuts import render
from django.utils.safestring import mark_safe

from core.models import Event
from replicas import catalog, rollout
from replicas.autoscaling import history
from replicas.autoscaling.policy import METRICS, Policy, PolicyFields, policy_describe, policy_of
from replicas.choices import WANTED
from replicas.choices import ReplicaStatus
from replicas.models import CatalogEntry, Replica, Rollout

from ..autoscale_chart import autoscale_svg
from .access import actor, back, operation, viewer

FORM_FIELDS = [name for name in PolicyFields().fields]


def _model_context(name: str) -> dict:
    """What the live part of the page shows: revision, rollout, replicas, Events."""
    model = CatalogEntry.objects.filter(name=name).first()
    if model is None:
        raise Http404(f"no model named {name}")
    replicas = list(Replica.objects.filter(model=model).exclude(status=ReplicaStatus.STOPPED)
                    .select_related("revision", "fabric").prefetch_related("members__node").order_by("id"))
    return {"model": model, "counts": rollout.replicas_by_revision(model), "replicas": replicas,
            "rollout": Rollout.objects.filter(model=model).first(),
            "events": Event.objects.filter(subject=f"model/{model.name}").order_by("-created_at", "-id")[:50]}


@viewer("replicas.view_catalogentry", "replicas.view_replica")
def model_page(request, name: str):
    context = _model_context(name)
    model = context["model"]
    policy = policy_of(model.autoscale)
    now = time.time()
    samples = history.store().read(model.name, since=now - history.KEEP_SECONDS) if policy else []
    shown = policy or Policy()
    context.update({
        "status_counts": dict(Replica.objects.filter(model=model, status__in=WANTED).values_list("status")
                              .annotate(n=Count("id")).order_by()),
        "policy": policy,
        "policy_text": policy_describe(policy) if policy else "",
        "latest": samples[-1] if samples else None,
        "chart": mark_safe(autoscale_svg(samples, target=policy.target, now=now)) if policy else "",
        "form": [(f, getattr(shown, f)) for f in FORM_FIELDS], "metrics": METRICS,
    })
    return render(request, "ui/model.html", context)


@viewer("replicas.view_catalogentry", "replicas.view_replica")
def model_live(request, name: str):
    return render(request, "ui/partials/model_live.html", _model_context(name))


ROLLOUT_VERBS = {"pause": rollout.rollout_pause, "resume": rollout.rollout_resume}


@operation("replicas.change_catalogentry")
def model_rollout(request, name: str, verb: str):
    if verb == "undo":
        model, started = rollout.rollout_undo(name=name, actor=actor(request))
        messages.success(request, f"{name} is back to its previous launch as revision {model.revision}"
                         + ("; rolling it out." if started else "; its replicas already run it."))
    elif verb in ROLLOUT_VERBS:
        changed = ROLLOUT_VERBS[verb](name=name, actor=actor(request))
        messages.success(request, f"The rollout of {name} is {changed.status}.")
    else:
        raise Http404(f"no rollout action {verb!r}")
    return back(request)


@operation("replicas.change_catalogentry")
def model_autoscale(request, name: str):
    if request.POST.get("remove"):
        policy = None
    else:
        policy = {f: request.POST[f].strip() for f in FORM_FIELDS if request.POST.get(f, "").strip() != ""}
    try:
        model = catalog.model_autoscale_set(name=name, policy=policy, actor=actor(request))
    except catalog.CatalogInvalid as exc:
        messages.error(request, "; ".join(exc.errors))
    else:
        messages.success(request, f"{name}: " + (policy_describe(policy_of(model.autoscale)) if model.autoscale
                                                 else f"a fixed count of {model.replicas}") + ".")
    return back(request)
