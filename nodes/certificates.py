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

from core.choices import CoreEventKind, EventSeverity
from core.events import event_record
from core.models import Event
from pki.choices import CertificateKind
from pki.models import Certificate
from pki.signing import Signed, cert_renew

logger = logging.getLogger(__name__)


def cert_renew_node(*, node_id: str, csr_pem: bytes | str, current_serial: str) -> Signed:
    """pki's renewal (``pki.signing.cert_renew``: a fresh key, the current
    serial superseded) and the Event that tells the cluster, in one
    transaction."""
    with transaction.atomic():
        signed = cert_renew(node_id=node_id, csr_pem=csr_pem, current_serial=current_serial)
        event_record(kind=CoreEventKind.CONTROL_PLANE, subject=f"node/{node_id}",
                     message=f"certificate of {node_id} renewed by the node: serial {current_serial} superseded by "
                             f"{signed.row.serial}, valid until {signed.row.not_after:%Y-%m-%d %H:%M:%S} UTC")
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
            kind=CoreEventKind.CONTROL_PLANE, severity=EventSeverity.WARNING, subject=f"node/{row.common_name}",
            message=(f"the certificate of {row.common_name} (serial {row.serial}) expires at "
                     f"{row.not_after:%Y-%m-%d %H:%M} UTC and nothing has renewed it: its agent renews at two "
                     "thirds of the lifetime, so check that the agent runs and reaches the agent API; "
                     "otherwise re-onboard the node (llmgw ctl onboard NODE --reinstall)"),
            data={"expiring_serial": row.serial},
        )
        warned.append(row.serial)
    return warned
