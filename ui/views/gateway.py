"""API keys and the routing table."""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import render

from gateway import selectors as gateway_selectors
from gateway import services as gateway_services

from .access import actor, back, operation, viewer


def _context() -> dict:
    snapshot = gateway_selectors.routing_snapshot()
    processes = gateway_selectors.gateway_processes()
    routes: dict[str, list[dict]] = {name: [] for name in sorted(snapshot.catalog)}
    for route in snapshot.routes:
        inflight = sum(p.inflight.get(route.replica_id, 0) for p in processes)
        routes.setdefault(route.model, []).append({"replica": route.replica_id, "url": route.base_url,
                                                   "inflight": inflight})
    return {"keys": gateway_selectors.key_list().order_by("name"), "routes": routes, "processes": processes}


@viewer("gateway.view_apikey")
def gateway_page(request):
    return render(request, "ui/gateway.html", _context())


@operation("gateway.add_apikey")
def key_create(request):
    name = request.POST.get("name", "").strip()
    models = [m for m in request.POST.get("models", "").replace(",", " ").split() if m]
    try:
        created = gateway_services.key_create(name=name, models=models, actor=actor(request))
    except ValidationError as exc:
        context = _context()
        context.update(form_error="; ".join(exc.messages), form_name=name, form_models=" ".join(models))
        return render(request, "ui/gateway.html", context, status=400)
    # Rendered, not redirected: the key must not travel through the session.
    context = _context()
    context["created"] = created
    return render(request, "ui/gateway.html", context, status=201)


@operation("gateway.change_apikey")
def key_revoke(request, name: str):
    gateway_services.key_revoke(name=name, actor=actor(request))
    messages.success(request, f"API key {name} is revoked: every gateway refuses it within a second.")
    return back(request)
