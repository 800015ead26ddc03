"""The control plane's view of itself, one ControlPlaneClock row: since when
it can hear its nodes (never blame a node for the control plane's own
outage), and whether it holds failovers because most nodes fell silent at once."""

from __future__ import annotations

import datetime as dt

import redis
from django.conf import settings
from django.db import transaction

from core.choices import CoreEventKind, EventSeverity
from core.events import event_record

from . import liveness
from .models import ControlPlaneClock


def agent_reconnect_max() -> float:
    """The backoff cap the agents are told: they retry at least this often
    while the control plane is away, so that once it hears again each one
    is back within its grace period."""
    if settings.LLMGW_AGENT_RECONNECT_MAX > 0:
        return settings.LLMGW_AGENT_RECONNECT_MAX
    grace, interval = settings.LLMGW_NODE_GRACE, settings.LLMGW_HEARTBEAT_INTERVAL
    return min(30.0, max(grace - interval, grace / 2))


def post_outage_grace() -> float:
    """How long after the control plane hears again a node may stay silent:
    its agent's next attempt can be up to a backoff cap away, and then it
    needs a heartbeat interval to be heard."""
    return max(settings.LLMGW_NODE_GRACE, agent_reconnect_max() + settings.LLMGW_HEARTBEAT_INTERVAL)


def control_plane_clock_update(*, now: dt.datetime) -> dt.datetime | None:
    """Advance the control plane's own clock of hearing; return the moment from
    which nodes can be blamed for silence, or None if we cannot hear anyone."""
    deaf_after = settings.LLMGW_DEAF_AFTER
    try:
        listener = liveness.store().listener_alive_at()
        why_deaf = f"the agent API has not been running for {deaf_after:.0f}s"
    except redis.RedisError as exc:
        # Heartbeats cannot be recorded: silence in the store is ours, not the nodes'.
        listener = None
        why_deaf = f"Redis, where heartbeats are recorded, is unreachable ({exc})"
    listener_silent = listener is None or now.timestamp() - listener > deaf_after
    with transaction.atomic():
        clock, _ = ControlPlaneClock.objects.select_for_update().get_or_create(pk=1)
        sweep_gap = clock.last_sweep_at is None or (now - clock.last_sweep_at).total_seconds() > deaf_after
        if listener_silent:
            if clock.deaf_since is None:
                clock.deaf_since = now
                event_record(
                    kind=CoreEventKind.CONTROL_PLANE,
                    subject="control-plane",
                    message=f"{why_deaf}; no node will be declared lost until it is back",
                    severity=EventSeverity.WARNING,
                )
            clock.heard_since = None
        elif clock.heard_since is None or clock.deaf_since is not None or sweep_gap:
            if clock.deaf_since is not None:
                why = f" after {(now - clock.deaf_since).total_seconds():.0f}s of deafness"
            elif sweep_gap and clock.last_sweep_at is not None:
                why = f" after {(now - clock.last_sweep_at).total_seconds():.0f}s without a sweep"
            else:
                why = ""
            clock.heard_since = now
            clock.deaf_since = None
            event_record(
                kind=CoreEventKind.CONTROL_PLANE,
                subject="control-plane",
                message=f"hearing nodes again{why}; every node gets a fresh grace period of "
                f"{post_outage_grace():.0f}s from now",
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
                kind=CoreEventKind.CONTROL_PLANE,
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
                kind=CoreEventKind.CONTROL_PLANE,
                subject="control-plane",
                message=f"no longer holding failovers ({silent} of {live} nodes silent)",
            )
        clock.save(update_fields=["holding_since"])
    return holding
