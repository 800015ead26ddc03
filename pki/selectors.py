import logging
import threading
import time

from django.conf import settings
from django.db import DatabaseError

from .models import Certificate

logger = logging.getLogger(__name__)


def cert_list(*, kind: str | None = None):
    rows = Certificate.objects.all()
    if kind:
        rows = rows.filter(kind=kind)
    return rows


class _RevokedSerials:
    """The set of revoked serials, re-read at most once per
    ``LLMGW_REVOCATION_CACHE_SECONDS``: the agent API checks it on every
    request, thousands of times a second, and revocations are rare.

    While the database is away the last copy stands (and is tried again
    every interval); with no copy at all the error reaches the caller, which
    cannot tell a revoked certificate from a good one and must refuse (503)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._serials: frozenset[str] = frozenset()
        self._loaded_at = float("-inf")
        self._known = False  # read at least once
        self._stale = False  # the last reads failed

    def get(self) -> frozenset[str]:
        now = time.monotonic()
        if now - self._loaded_at < settings.LLMGW_REVOCATION_CACHE_SECONDS:
            return self._serials
        # One thread re-reads; with a copy at hand the others do not wait for it
        # (a database that is away can take a connect timeout to say so).
        if not self._lock.acquire(blocking=not self._known):
            return self._serials
        try:
            if now - self._loaded_at >= settings.LLMGW_REVOCATION_CACHE_SECONDS:
                self._reload()
        finally:
            self._lock.release()
        return self._serials

    def _reload(self) -> None:
        try:
            self._serials = frozenset(
                Certificate.objects.filter(revoked_at__isnull=False).values_list("serial", flat=True)
            )
        except DatabaseError as exc:
            if not self._known:
                raise
            if not self._stale:
                logger.warning("cannot re-read revoked certificates (%s); using the last copy", exc)
            self._stale = True
        else:
            if self._stale:
                logger.info("revoked certificates read again: %d", len(self._serials))
            self._known, self._stale = True, False
        self._loaded_at = time.monotonic()

    def fresh(self) -> frozenset[str] | None:
        """The set, if read within ``LLMGW_REVOCATION_CACHE_SECONDS`` (what
        ``get()`` would return without a query); None when ``get()`` would
        read the database first. For the agent API's event loop."""
        if time.monotonic() - self._loaded_at < settings.LLMGW_REVOCATION_CACHE_SECONDS:
            return self._serials
        return None

    def cached(self) -> frozenset[str]:
        """The last set read, without touching the database: for the agent
        API's event loop, which must not wait on a query (a thread of its
        own calls ``get()`` to keep this fresh)."""
        return self._serials

    def invalidate(self) -> None:
        self._loaded_at = float("-inf")


revoked_serials = _RevokedSerials()
