"""The control plane's view of itself, one ControlPlaneClock row: since when
it can hear its nodes (never blame a node for the control plane's own
outage), and whether it holds failovers because most nodes fell silent at once."""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.db import transaction

from . import liveness
from .choices import EventKind, EventSeverity
from .events import event_record
from .models import ControlPlaneClock


def control_plane_clock_update(*, now: dt.datetime) -> dt.datetime | None:
    """Advance the control plane's own clock of hearing; return the moment from
    which nodes can be blamed for silence, or None if we cannot hear anyone."""
    deaf_after = settings.LLMGW_DEAF_AFTER
    listener = liveness.store().listener_alive_at()
    listener_silent = listener is None or now.timestamp() - listener > deaf_after
    with transaction.atomic():
        clock, _ = ControlPlaneClock.objects.select_for_update().get_or_create(pk=1)
        sweep_gap = clock.last_sweep_at is None or (now - clock.last_sweep_at).total_seconds() > deaf_after
        if listener_silent:
            if clock.deaf_since is None:
                clock.deaf_since = now
                event_record(
                    kind=EventKind.CONTROL_PLANE,
                    subject="control-plane",
                    message="the agent API has not been running for "
                    f"{deaf_after:.0f}s; no node will be declared lost until it is back",
                    severity=EventSeverity.WARNING,
                )
            clock.heard_since = None
        elif clock.heard_since is None or clock.deaf_since is not None or sweep_gap:
            clock.heard_since = now
            clock.deaf_since = None
            event_record(
                kind=EventKind.CONTROL_PLANE,
                subject="control-plane",
                message="hearing nodes again; every node gets a fresh grace period of "
                f"{settings.LLMGW_NODE_GRACE:.0f}s from now",
            )
        clock.last_sweep_at = now
        clock.save()
    return clock.heard_since


def control_plane_hold_update(*, silent: int, live: int, now: dt.datetime) -> bool:
    """Most nodes going silent at the same moment is more likely our own
    network than a mass death: hold failovers and say so loudly (Kubernetes
    stops evicting when a whole zone looks unhealthy, for the same reason)."""
    fraction = settings.LLMGW_MASS_SILENCE_FRACTION
    holding = 0 < fraction < 1 and silent >= 2 and silent > fraction * live
    with transaction.atomic():
        clock = ControlPlaneClock.objects.select_for_update().get(pk=1)
        if holding and clock.holding_since is None:
            clock.holding_since = now
            event_record(
                kind=EventKind.CONTROL_PLANE,
                subject="control-plane",
                message=f"{silent} of {live} nodes went silent at once: suspecting the control plane's "
                "own network rather than the nodes, so no node is declared lost and no replica is "
                "failed over. Check the network between the control plane and the nodes; if the "
                "nodes really are down, set LLMGW_MASS_SILENCE_FRACTION=1 to let failover proceed",
                severity=EventSeverity.ERROR,
            )
        elif not holding and clock.holding_since is not None:
            clock.holding_since = None
            event_record(
                kind=EventKind.CONTROL_PLANE,
                subject="control-plane",
                message=f"no longer holding failovers ({silent} of {live} nodes silent)",
            )
        clock.save(update_fields=["holding_since"])
    return holding
