"""Who may see and do what: the permission codenames shared with the REST
API and the CLI (a viewer has every view_ permission)."""

from __future__ import annotations

from functools import wraps

from urllib.parse import quote

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseRedirect
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST
from django_htmx.http import HttpResponseClientRedirect

from accounts.actors import actor  # noqa: F401 (the views import it from here)
from core.exceptions import InvalidTransition, NotFound


def viewer(*perms: str):
    """A page: logged in (else the login page) and allowed to read (else 403)."""

    def wrap(view):
        @wraps(view)
        def inner(request, *args, **kwargs):
            if not request.user.is_authenticated and request.htmx:
                # A partial polled after the session ended: the whole page
                # goes to the login, not the login form into a partial.
                return HttpResponseClientRedirect(f"{settings.LOGIN_URL}?next={quote(request.htmx.current_url_abs_path or '/')}")
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            if not request.user.has_perms(perms):
                raise PermissionDenied("you may not see this page")
            return view(request, *args, **kwargs)

        return inner

    return wrap


def back(request, default: str = "/"):
    """Back to the page the form was on (same host only)."""
    target = request.POST.get("next") or request.headers.get("Referer") or default
    if not url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}) or not (
            target.startswith("/") or "://" in target):
        target = default
    # Not redirect(): it would take a bare word for a view's name and fail.
    return HttpResponseRedirect(target)


def operation(*perms: str):
    """An action (POST only): 403 without the permission; a refusal by the
    service (a transition not allowed, a missing row) becomes a message on
    the page it came from, never a 500."""

    def wrap(view):
        @require_POST
        @login_required
        @wraps(view)
        def inner(request, *args, **kwargs):
            if not request.user.has_perms(perms):
                raise PermissionDenied("you may not do this")
            try:
                return view(request, *args, **kwargs)
            except (InvalidTransition, NotFound) as exc:
                messages.error(request, str(exc))
                return back(request)

        return inner

    return wrap
