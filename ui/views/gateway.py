"""API keys and the routing table."""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import render
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.safestring import mark_safe

from gateway import selectors as gateway_selectors
from gateway import services as gateway_services
from gateway.choices import Priority

from ..usage_chart import usage_svg

from .access import actor, back, operation, viewer


def _defaults_text() -> str:
    """The deployment's defaults for a new key (LLMGW_KEYS_DEFAULT_*), in the words of the keys' table."""
    parts = [f"{value} {unit}" for value, unit in (
        (settings.LLMGW_KEYS_DEFAULT_RPM, "req/min"), (settings.LLMGW_KEYS_DEFAULT_TPM, "tokens/min"),
        (settings.LLMGW_KEYS_DEFAULT_MAX_CONCURRENT, "at once"),
        (settings.LLMGW_KEYS_DEFAULT_DAILY_TOKENS, "tokens/day"),
        (settings.LLMGW_KEYS_DEFAULT_MONTHLY_TOKENS, "tokens/month")) if value] or ["no limits"]
    if settings.LLMGW_KEYS_DEFAULT_EXPIRES_DAYS:
        parts.append(f"expires after {settings.LLMGW_KEYS_DEFAULT_EXPIRES_DAYS} days")
    return ", ".join([*parts, f"priority {settings.LLMGW_KEYS_DEFAULT_PRIORITY}"])


def _context(request=None) -> dict:
    snapshot = gateway_selectors.routing_snapshot()
    processes = gateway_selectors.gateway_processes()
    routes: dict[str, list[dict]] = {name: [] for name in sorted(snapshot.catalog)}
    for route in snapshot.routes:
        inflight = sum(p.inflight.get(route.replica_id, 0) for p in processes)
        routes.setdefault(route.model, []).append({"replica": route.replica_id, "url": route.base_url,
                                                   "inflight": inflight})
    usage_key = (request.GET.get("usage_key") or "").strip() if request is not None else ""
    rows = gateway_selectors.key_usage(key=usage_key or None, hours=24)
    totals: dict[tuple[str, str], list[int]] = {}
    for row in rows:
        total = totals.setdefault((row["key__name"], row["model"]), [0, 0, 0])
        total[0] += row["requests"]
        total[1] += row["prompt_tokens"]
        total[2] += row["completion_tokens"]
    chart = usage_svg(rows, now=timezone.now(), label=f"key {usage_key}" if usage_key else "every key")
    return {"keys": gateway_selectors.key_list().order_by("name"), "routes": routes, "processes": processes,
            "usage_chart": mark_safe(chart), "usage_key": usage_key,
            "usage_totals": [(k, m, *v) for (k, m), v in sorted(totals.items())],
            "priorities": Priority.choices, "key_defaults": _defaults_text()}


@viewer("gateway.view_apikey")
def gateway_page(request):
    return render(request, "ui/gateway.html", _context(request))


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


_LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent", "daily_tokens", "monthly_tokens")


@operation("gateway.change_apikey")
def key_update(request, name: str):
    """The limits form of one key: an empty field removes that limit (or the expiry)."""
    changes: dict = {}
    problems = []
    for field in _LIMIT_FIELDS:
        value = request.POST.get(field, "").strip().replace(",", "").replace("_", "")
        if not value:
            changes[field] = None
        elif value.isdigit() and int(value) > 0:
            changes[field] = int(value)
        else:
            problems.append(f"{field}: a positive whole number, or empty for no limit (got {value!r})")
    expires = request.POST.get("expires_at", "").strip()
    if expires:
        parsed = parse_datetime(expires if len(expires) > 10 else expires + "T00:00")
        if parsed is None:
            problems.append(f"expires: a date and time such as 2027-01-31 00:00 (got {expires!r})")
        else:
            changes["expires_at"] = parsed if timezone.is_aware(parsed) else parsed.replace(tzinfo=dt.timezone.utc)
    else:
        changes["expires_at"] = None
    changes["priority"] = request.POST.get("priority", "standard")
    if not problems:
        try:
            gateway_services.key_update(name=name, actor=actor(request), **changes)
        except ValidationError as exc:
            problems.extend(exc.messages)
    if problems:
        messages.error(request, f"API key {name} not changed: " + "; ".join(problems))
    else:
        messages.success(request, f"API key {name} updated: every gateway applies it within a second.")
    return back(request, "/gateway/")
