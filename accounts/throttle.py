"""Failed logins, counted per user name and per client address, and refused
once either count passes its bound within a window (docs/security.md,
"Logins").

Counts live in the ``throttle`` cache: Redis when ``LLMGW_REDIS_URL`` is set
(shared by every web process), else files under the data directory (the
embedded default's processes share one host). A fixed window: the first
failure starts it, the count expires with it.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

from django.conf import settings
from django.core.cache import caches

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str = ""


def client_address(request) -> str:
    """The caller's address. Behind the TLS proxy (an https LLMGW_PUBLIC_URL)
    that is the last X-Forwarded-For entry, the one the proxy itself added;
    the entries before it are the client's word."""
    if request is None:
        return ""
    remote = request.META.get("REMOTE_ADDR", "")
    if getattr(settings, "SECURE_PROXY_SSL_HEADER", None):
        forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
        if forwarded:
            return forwarded.split(",")[-1].strip()
    return remote


def _key(kind: str, value: str) -> str:
    # Hashed: a user name may hold anything, cache keys may not.
    return f"llmgw:login-failures:{kind}:{hashlib.sha256(value.encode()).hexdigest()[:32]}"


def _count(key: str) -> int:
    return int(caches["throttle"].get(key) or 0)


def login_verdict(*, username: str, address: str) -> Verdict:
    """Whether a login for ``username`` from ``address`` may be tried now (a pure read)."""
    per_user, per_address = settings.LLMGW_LOGIN_FAILURES_PER_USER, settings.LLMGW_LOGIN_FAILURES_PER_ADDRESS
    if username and _count(_key("user", username.lower())) >= per_user:
        return Verdict(False, f"{per_user} failed logins for this user")
    if address and _count(_key("address", address)) >= per_address:
        return Verdict(False, f"{per_address} failed logins from this address")
    return Verdict(True)


def login_failure_record(*, username: str, address: str) -> int:
    """Count one failed login; returns the user's count in this window."""
    cache = caches["throttle"]
    window = settings.LLMGW_LOGIN_WINDOW
    counts = []
    for kind, value in (("user", username.lower()), ("address", address)):
        if not value:
            counts.append(0)
            continue
        key = _key(kind, value)
        cache.add(key, 0, timeout=window)  # starts the window; a no-op inside one
        try:
            counts.append(cache.incr(key))
        except ValueError:  # expired between add and incr
            cache.set(key, 1, timeout=window)
            counts.append(1)
    logger.warning("login failed user=%r client=%s failures_for_user=%d failures_from_client=%d",
                   username, address or "?", counts[0], counts[1])
    return counts[0]


def login_success_record(*, username: str) -> None:
    caches["throttle"].delete(_key("user", username.lower()))
