import threading
import time

from django.conf import settings

from .models import Certificate


def cert_list(*, kind: str | None = None):
    rows = Certificate.objects.all()
    if kind:
        rows = rows.filter(kind=kind)
    return rows


class _RevokedSerials:
    """The set of revoked serials, re-read at most once per
    ``LLMGW_REVOCATION_CACHE_SECONDS``: the agent API checks it on every
    request, thousands of times a second, and revocations are rare."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._serials: frozenset[str] = frozenset()
        self._loaded_at = float("-inf")

    def get(self) -> frozenset[str]:
        now = time.monotonic()
        if now - self._loaded_at < settings.LLMGW_REVOCATION_CACHE_SECONDS:
            return self._serials
        with self._lock:
            if now - self._loaded_at >= settings.LLMGW_REVOCATION_CACHE_SECONDS:
                self._serials = frozenset(
                    Certificate.objects.filter(revoked_at__isnull=False).values_list("serial", flat=True)
                )
                self._loaded_at = time.monotonic()
        return self._serials

    def cached(self) -> frozenset[str]:
        """The last set read, without touching the database: for the agent
        API's event loop, which must not wait on a query (a thread of its
        own calls ``get()`` to keep this fresh)."""
        return self._serials

    def invalidate(self) -> None:
        self._loaded_at = float("-inf")


revoked_serials = _RevokedSerials()
