"""A node's certificate over its life: the node renews it over its current
identity; an Event warns about one close to expiry that nothing renewed.
(pki signs and stores certificates; what the cluster is told about them,
Events, is nodes' part.)"""

from __future__ import annotations

import datetime as dt
import logging

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from pki.choices import CertificateKind
from pki.models import Certificate
from pki.selectors import revoked_serials
from pki.services import PkiError
from pki.signing import Signed, _same_key, cert_sign_node, csr_load, node_cert_lifetime

from .choices import EventKind, EventSeverity
from .events import event_record
from .models import Event

logger = logging.getLogger(__name__)


class RenewalTooSoon(PkiError):
    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def renewal_wait(*, issued_at: dt.datetime, not_after: dt.datetime, now: dt.datetime, interval: float) -> float:
    """Seconds until a certificate issued then may be renewed (0: now).

    Agents renew at two thirds of the lifetime; a certificate renewed again
    and again within moments is a stolen key making certificates, or a
    broken agent. So a certificate may be renewed once it is ``interval``
    seconds old, or once it has lived half its lifetime, whichever comes
    first: a short-lived or expiring certificate is never held back."""
    lifetime = (not_after - issued_at).total_seconds()
    allowed_at = issued_at + dt.timedelta(seconds=max(0.0, min(interval, lifetime / 2)))
    return max(0.0, (allowed_at - now).total_seconds())


def cert_renew_node(*, node_id: str, csr_pem: bytes | str, current_serial: str) -> Signed:
    """The next certificate of a node that proved itself with its current one
    (the agent API checked the CN and that it is not revoked). The request
    must carry a fresh key; the current serial is superseded (refused from
    now on)."""
    csr = csr_load(csr_pem)
    with transaction.atomic():
        current = Certificate.objects.select_for_update().filter(serial=current_serial).first()
        if current is None or current.common_name != node_id or current.revoked_at is not None:
            raise PkiError(f"certificate {current_serial} is not a live certificate of {node_id}")
        wait = renewal_wait(issued_at=current.issued_at, not_after=current.not_after, now=timezone.now(),
                            interval=settings.LLMGW_CERT_RENEW_INTERVAL)
        if wait > 0:
            raise RenewalTooSoon(f"certificate {current_serial} was issued {timezone.now() - current.issued_at} ago; "
                                 f"it may be renewed in {wait:.0f}s", retry_after=max(1, int(wait + 0.999)))
        if _same_key(current, csr.public_key()):
            raise PkiError("the request reuses the current key: make a fresh one for each certificate")
        signed = cert_sign_node(node_id=node_id, csr_pem=csr_pem, lifetime=node_cert_lifetime())
        current.revoked_at = timezone.now()
        current.revocation_reason = f"superseded by {signed.row.serial}"
        current.save(update_fields=["revoked_at", "revocation_reason"])
        event_record(kind=EventKind.CONTROL_PLANE, subject=f"node/{node_id}",
                     message=f"certificate of {node_id} renewed by the node: serial {current_serial} superseded by "
                             f"{signed.row.serial}, valid until {signed.row.not_after:%Y-%m-%d %H:%M:%S} UTC")
    revoked_serials.invalidate()
    logger.info("pki node certificate renewed node=%s old=%s new=%s", node_id, current_serial, signed.row.serial)
    return signed


def certs_warn_expiring(*, now: dt.datetime | None = None) -> list[str]:
    """One warning Event per live node certificate that expires within
    LLMGW_CERT_WARN_DAYS while no later certificate of the node exists.
    Returns the serials warned about this time."""
    now = now or timezone.now()
    horizon = now + dt.timedelta(days=settings.LLMGW_CERT_WARN_DAYS)
    live = Certificate.objects.filter(kind=CertificateKind.CLIENT, revoked_at=None)
    warned = []
    for row in live.filter(not_after__gt=now, not_after__lte=horizon):
        if live.filter(common_name=row.common_name, not_after__gt=row.not_after).exists():
            continue
        if Event.objects.filter(subject=f"node/{row.common_name}", data__expiring_serial=row.serial).exists():
            continue
        event_record(
            kind=EventKind.CONTROL_PLANE, severity=EventSeverity.WARNING, subject=f"node/{row.common_name}",
            message=(f"the certificate of {row.common_name} (serial {row.serial}) expires at "
                     f"{row.not_after:%Y-%m-%d %H:%M} UTC and nothing has renewed it: its agent renews at two "
                     "thirds of the lifetime, so check that the agent runs and reaches the agent API; "
                     "otherwise re-onboard the node (llmgw ctl onboard NODE --reinstall)"),
            data={"expiring_serial": row.serial},
        )
        warned.append(row.serial)
    return warned
