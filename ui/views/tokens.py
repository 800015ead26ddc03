"""Operator tokens: a user's own (admins: everyone's), made and revoked here."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import render
from django.views.decorators.http import require_POST

from accounts import selectors as account_selectors
from accounts import services as account_services
from accounts.services import TOKEN_DEFAULT_DAYS, TOKEN_MAX_DAYS
from core.exceptions import NotFound

from .access import actor, back


def _context(request) -> dict:
    everyone = request.user.has_perm("accounts.delete_operatortoken")
    rows = account_selectors.token_list(user=request.user, everyone=everyone).order_by("user__username", "created_at")
    return {"tokens": rows, "everyone": everyone, "default_days": TOKEN_DEFAULT_DAYS, "max_days": TOKEN_MAX_DAYS}


@login_required
def tokens_page(request):
    return render(request, "ui/tokens.html", _context(request))


@require_POST
@login_required
def token_create(request):
    name = request.POST.get("name", "").strip()[:64]
    try:
        days = float(request.POST.get("days") or TOKEN_DEFAULT_DAYS)
        created = account_services.token_create(user=request.user, name=name, days=days, actor=actor(request))
    except (ValueError, ValidationError) as exc:
        context = _context(request)
        text = "; ".join(exc.messages) if isinstance(exc, ValidationError) else "days: a number of days"
        context.update(form_error=text, form_name=name)
        return render(request, "ui/tokens.html", context, status=400)
    # Rendered, not redirected: the token must not travel through the session.
    context = _context(request)
    context["created"] = created
    return render(request, "ui/tokens.html", context, status=201)


@require_POST
@login_required
def token_revoke(request, prefix: str):
    try:
        account_services.token_revoke(prefix=prefix, user=request.user, actor=actor(request))
    except NotFound as exc:
        messages.error(request, str(exc))
        return back(request, "/tokens/")
    messages.success(request, f"operator token {prefix} is revoked.")
    return back(request, "/tokens/")
