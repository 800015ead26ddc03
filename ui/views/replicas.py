"""Models and replicas: the catalog, scaling and applying a catalog.yaml."""

from __future__ import annotations

import logging
import shlex
import time

from django.contrib import messages
from django.db.models import Count
from django.http import Http404
from django.shortcuts import redirect, render

from core.models import Event
from gateway.selectors import engine_readings
from replicas import catalog, rollout
from replicas.choices import WANTED, ReplicaStatus
from replicas.envmask import env_masked
from replicas.models import CatalogEntry, Member, Replica
from replicas.revisions import replica_launch

from ..catalog_preview import catalog_parse, catalog_preview, field_errors
from ..cluster import replica_colour
from .access import actor, back, operation, viewer

logger = logging.getLogger(__name__)

UPLOAD_MAX = 1024 * 1024


def _models_context() -> dict:
    counts: dict[int, dict[str, int]] = {}
    for model_id, status, n in Replica.objects.filter(status__in=WANTED).values_list("model_id", "status").annotate(
            n=Count("id")):
        counts.setdefault(model_id, {})[status] = n
    reasons = dict(Replica.objects.filter(status=ReplicaStatus.PENDING).exclude(pending_reason="")
                   .order_by("model_id", "-id").values_list("model_id", "pending_reason"))
    models = []
    for model in CatalogEntry.objects.all():
        c = counts.get(model.pk, {})
        models.append({
            "model": model, "ready": c.get(ReplicaStatus.READY, 0),
            "ready_current": rollout.replicas_by_revision(model)["ready_current"], "pending": c.get(ReplicaStatus.PENDING, 0),
            "starting": c.get(ReplicaStatus.SCHEDULED, 0) + c.get(ReplicaStatus.STARTING, 0),
            "reason": model.never_fits_reason or reasons.get(model.pk, ""),
        })
    replicas = list(
        Replica.objects.exclude(status=ReplicaStatus.STOPPED).select_related("model", "fabric", "revision")
        .prefetch_related("members__node").order_by("model__name", "id")
    )
    for replica in replicas:
        replica.colour = replica_colour(replica.pk)
    return {"models": models, "replicas": replicas}


@viewer("replicas.view_catalogentry", "replicas.view_replica")
def replicas_page(request):
    return render(request, "ui/replicas.html", _models_context())


@viewer("replicas.view_catalogentry", "replicas.view_replica")
def replicas_live(request):
    return render(request, "ui/partials/replicas_live.html", _models_context())


@viewer("replicas.view_replica")
def replica_page(request, replica_id: int):
    replica = Replica.objects.select_related("model", "fabric").filter(pk=replica_id).first()
    if replica is None:
        raise Http404(f"no replica {replica_id}")
    members = list(Member.objects.filter(replica=replica).select_related("node").order_by("rank"))
    for m in members:
        m.command = " ".join(shlex.quote(str(a)) for a in m.argv)
        m.env_text = "\n".join(f"{k}={v}" for k, v in sorted(env_masked(m.env).items()))
    history = Event.objects.filter(subject=f"replica/{replica.pk}").order_by("-created_at", "-id")[:100]
    return render(request, "ui/replica.html", {"replica": replica, "members": members, "events": history,
                                               "engine": _engine_reading(replica.pk),
                                               "launch": replica_launch(replica)})


def _engine_reading(replica_id: int) -> dict | None:
    """The gateways' last reading of the replica's engine metrics, for the page (None: unknown)."""
    try:
        reading = engine_readings(replica_ids=[replica_id]).get(replica_id)
    except Exception:  # Redis away: the page still shows, with the figures unknown
        logger.warning("replica page: engine readings unavailable", exc_info=True)
        return None
    if reading is None or reading.get("error"):
        return {"error": reading.get("error", "") if reading else "", "at": reading.get("at") if reading else None}
    queries, hits = reading.get("prefix_queries"), reading.get("prefix_hits")
    return {
        "waiting": reading.get("waiting"), "running": reading.get("running"),
        "kv_percent": None if reading.get("kv_use") is None else round(reading["kv_use"] * 100, 1),
        "hit_percent": round(hits / queries * 100, 1) if queries and hits is not None else None,
        "age": max(0.0, round(time.time() - reading.get("at", 0.0), 1)),
    }


@operation("replicas.change_catalogentry")
def model_scale(request, name: str):
    try:
        replicas = int(request.POST.get("replicas", ""))
    except ValueError:
        messages.error(request, "replicas: give a whole number, 0 or more")
        return back(request)
    try:
        model = catalog.model_scale(name=name, replicas=replicas, actor=actor(request))
    except catalog.CatalogInvalid as exc:
        messages.error(request, "; ".join(exc.errors))
    else:
        messages.success(request, f"{name} now wants {model.replicas} replica(s).")
    return back(request)


def _catalog_text(request) -> tuple[str, str | None]:
    upload = request.FILES.get("file")
    if upload is not None:
        if upload.size > UPLOAD_MAX:
            return "", f"the file is larger than {UPLOAD_MAX // 1024} KiB"
        try:
            return upload.read().decode("utf-8"), None
        except UnicodeDecodeError:
            return "", "the file is not UTF-8 text"
    return request.POST.get("yaml", ""), None


@viewer("replicas.view_catalogentry")
def catalog_page(request):
    """GET: the form. POST: the preview of what would change (nothing applied)."""
    context = {"text": "", "prune": False, "preview": None, "can_apply": request.user.has_perms(
        ["replicas.change_catalogentry", "replicas.add_catalogentry"])}
    if request.method == "POST":
        text, problem = _catalog_text(request)
        context.update(text=text, prune=bool(request.POST.get("prune")))
        if problem:
            messages.error(request, problem)
        else:
            context["preview"] = catalog_preview(text=text, prune=context["prune"],
                                                 admin=request.user.has_perm("replicas.trust_engine_code"))
    status = 400 if context["preview"] is not None and context["preview"].errors else 200
    return render(request, "ui/catalog.html", context, status=status)


@operation("replicas.change_catalogentry", "replicas.add_catalogentry")
def catalog_apply(request):
    text = request.POST.get("yaml", "")
    prune = bool(request.POST.get("prune"))
    if prune and not request.user.has_perm("replicas.delete_catalogentry"):
        messages.error(request, "pruning removes models: you may not remove models")
        return redirect("ui-catalog")
    entries, errors = catalog_parse(text)
    if entries is None:
        messages.error(request, "; ".join(e.message for e in errors))
        return redirect("ui-catalog")
    try:
        result = catalog.catalog_apply(entries=entries, prune=prune, actor=actor(request),
                                       admin=request.user.has_perm("replicas.trust_engine_code"))
    except catalog.CatalogInvalid as exc:
        preview = catalog_preview(text=text, prune=prune, admin=request.user.has_perm("replicas.trust_engine_code"))
        preview.errors = field_errors(exc)
        return render(request, "ui/catalog.html", {"text": text, "prune": prune, "preview": preview,
                                                   "can_apply": True}, status=400)
    summary = ", ".join(f"{len(v)} {k}" for k, v in result.items() if v) or "nothing to change"
    messages.success(request, f"Catalog applied: {summary}.")
    return redirect("ui-replicas")
