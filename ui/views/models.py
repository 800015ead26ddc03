"""A model's page: its shape, its autoscaling policy (and the form that sets
it), the current signals, a chart of replicas against load over the last
hour (SVG drawn here), and its autoscaling Events."""

from __future__ import annotations

import time

from django.contrib import messages
from django.db.models import Count
from django.http import Http404
from django.shortcuts import render
from django.utils.safestring import mark_safe

from core.models import Event
from replicas import catalog
from replicas.autoscaling import history
from replicas.autoscaling.policy import METRICS, Policy, PolicyFields, policy_describe, policy_of
from replicas.choices import WANTED
from replicas.models import CatalogEntry, Replica

from ..autoscale_chart import autoscale_svg
from .access import actor, back, operation, viewer

FORM_FIELDS = [name for name in PolicyFields().fields]


@viewer("replicas.view_catalogentry")
def model_page(request, name: str):
    model = CatalogEntry.objects.filter(name=name).first()
    if model is None:
        raise Http404(f"no model named {name}")
    counts = dict(Replica.objects.filter(model=model, status__in=WANTED).values_list("status")
                  .annotate(n=Count("id")).order_by())
    policy = policy_of(model.autoscale)
    now = time.time()
    samples = history.store().read(model.name, since=now - history.KEEP_SECONDS) if policy else []
    shown = policy or Policy()
    context = {
        "model": model, "counts": counts, "policy": policy,
        "policy_text": policy_describe(policy) if policy else "",
        "latest": samples[-1] if samples else None,
        "chart": mark_safe(autoscale_svg(samples, target=policy.target, now=now)) if policy else "",
        "form": [(f, getattr(shown, f)) for f in FORM_FIELDS], "metrics": METRICS,
        "events": Event.objects.filter(subject=f"model/{model.name}").order_by("-created_at", "-id")[:50],
    }
    return render(request, "ui/model.html", context)


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
