"""The one authentication backend: Django's, behind the login throttle."""

from __future__ import annotations

import logging

from django.contrib.auth.backends import ModelBackend
from django.core.exceptions import PermissionDenied

from .throttle import client_address, login_failure_record, login_success_record, login_verdict

logger = logging.getLogger(__name__)


class ThrottledModelBackend(ModelBackend):
    """Every password login (the pages, the Django admin, anything calling
    ``authenticate``) passes here. Refused while throttled, even with the
    right password: otherwise guessing would simply go on."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        name = username if username is not None else kwargs.get("username", "")
        address = client_address(request)
        verdict = login_verdict(username=name or "", address=address)
        if not verdict.allowed:
            logger.warning("login refused (throttled: %s) user=%r client=%s", verdict.reason, name, address or "?")
            # Stops Django from trying any other backend; the form says only
            # that the login failed.
            raise PermissionDenied(verdict.reason)
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is None:
            login_failure_record(username=name or "", address=address)
            return None
        login_success_record(username=name or "")
        return user
