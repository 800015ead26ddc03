"""Events about nodes that another app's action causes."""

from __future__ import annotations

from core.choices import CoreEventKind, EventSeverity
from core.events import event_record
from core.models import Event

from .models import Node


def cert_revoked_record(*, certificate, actor: str = "", reason: str = "") -> Event:
    """A revoked certificate as an Event (registered on pki's revocation hook)."""
    node = Node.objects.filter(name=certificate.common_name).first() if certificate.kind == "client" else None
    return event_record(
        kind=CoreEventKind.CONTROL_PLANE, subject=f"certificate/{certificate.serial}", severity=EventSeverity.WARNING,
        node=node, data={"actor": actor} if actor else None,
        message=f"{certificate.kind} certificate {certificate.serial} of {certificate.common_name} revoked by "
                f"{actor or 'an operator'}" + (f": {reason}" if reason else ""),
    )
