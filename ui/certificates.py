"""A node's client certificates as the node page shows them: each one's
state, and when the agent renews the live one. Pure: rows in, facts out.

The agent asks for its next certificate at two thirds of the current one's
lifetime (agent/identity.py renewal_due); the control plane then marks the
old one "superseded by SERIAL" (nodes/certificates.py cert_renew_node)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

SUPERSEDED = "superseded by "
VALID, SUPERSEDED_STATE, REVOKED, EXPIRED = "valid", "superseded", "revoked", "expired"


@dataclass(frozen=True)
class CertState:
    serial: str
    not_before: dt.datetime
    not_after: dt.datetime
    state: str  # valid, superseded, revoked, expired
    detail: str  # "by 3f2a" (superseded), the revocation's reason, ""
    revoked_at: dt.datetime | None
    live: bool  # the one the agent should be using


@dataclass(frozen=True)
class Renewal:
    serial: str
    renew_at: dt.datetime
    overdue: bool


def renew_at(not_before: dt.datetime, not_after: dt.datetime) -> dt.datetime:
    return not_before + (not_after - not_before) * 2 / 3


def _state(cert, now: dt.datetime) -> tuple[str, str]:
    if cert.revoked_at is not None:
        reason = cert.revocation_reason or ""
        if reason.startswith(SUPERSEDED):
            return SUPERSEDED_STATE, "by " + reason[len(SUPERSEDED):]
        return REVOKED, reason
    if cert.not_after <= now:
        return EXPIRED, ""
    return VALID, ""


def cert_states(certs, *, now: dt.datetime) -> tuple[list[CertState], Renewal | None]:
    """Each certificate's state, newest first as given, and the renewal of
    the live one (the valid one that ends last): None when none is valid.
    Renewal is overdue past two thirds of its lifetime while no certificate
    of the node is newer than it."""
    certs = list(certs)
    states = [_state(c, now) for c in certs]
    valid = [c for c, (state, _) in zip(certs, states) if state == VALID]
    live = max(valid, key=lambda c: (c.not_after, c.not_before), default=None)
    rows = [CertState(c.serial, c.not_before, c.not_after, state, detail, c.revoked_at, c is live)
            for c, (state, detail) in zip(certs, states)]
    if live is None:
        return rows, None
    due = renew_at(live.not_before, live.not_after)
    newer = any(c.not_before > live.not_before for c in certs if c is not live)
    return rows, Renewal(live.serial, due, overdue=now >= due and not newer)
