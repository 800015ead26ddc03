"""Who may keep a connection open: checked once, right after the handshake.

The views check every request's certificate (CN against the URL, revocation),
but only once the whole request has arrived. A connection is refused earlier,
before any request byte is read, when its certificate

- is revoked (from the revoked-serials cache the views use, never a database
  query in the event loop: a thread keeps the cache fresh), or
- already holds ``LLMGW_AGENT_CONNECTIONS_PER_CERT`` connections in this
  worker process (an agent needs two: heartbeats and the desired-state
  long-poll; a few more cover reconnects the server has not noticed yet).

Both are logged with the certificate's CN and serial.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from django.db import close_old_connections

from pki.authn import PeerIdentity, identity_from_der

from .background import release_database_connection

logger = logging.getLogger(__name__)


class PeerGate:
    def __init__(self, *, per_cert: int, revoked: Callable[[], frozenset[str]]) -> None:
        self.per_cert = per_cert
        self._revoked = revoked
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}

    def admit(self, der: bytes | None, *, peer: str) -> PeerIdentity | None:
        """The certificate's identity, with a connection slot taken; None if refused."""
        if not der:
            return None
        identity = identity_from_der(der)
        if identity.serial in self._revoked():
            logger.warning(
                "agent-api refused connection from %s: revoked certificate cn=%s serial=%s",
                peer, identity.common_name, identity.serial,
            )
            return None
        with self._lock:
            held = self._open.get(identity.serial, 0)
            if held >= self.per_cert:
                refused = True
            else:
                refused = False
                self._open[identity.serial] = held + 1
        if refused:
            logger.warning(
                "agent-api refused connection from %s: certificate cn=%s serial=%s already holds %d "
                "connections (LLMGW_AGENT_CONNECTIONS_PER_CERT)",
                peer, identity.common_name, identity.serial, held,
            )
            return None
        return identity

    def release(self, serial: str) -> None:
        with self._lock:
            held = self._open.get(serial, 0) - 1
            if held > 0:
                self._open[serial] = held
            else:
                self._open.pop(serial, None)

    def held(self, serial: str) -> int:
        return self._open.get(serial, 0)


def keep_fresh(refresh: Callable[[], object], every: float) -> None:
    """Re-read the revoked serials in this thread, so that the event loop only
    ever reads the copy in memory."""
    failing = False
    while True:
        try:
            refresh()
            if failing:
                logger.info("agent-api can read revoked certificates again")
            failing = False
        except Exception as exc:  # noqa: BLE001 - keep the last copy, and keep trying
            if not failing:
                logger.warning("agent-api cannot read revoked certificates (keeping the last copy): %s", exc)
            failing = True
            close_old_connections()
        release_database_connection()
        time.sleep(every)
