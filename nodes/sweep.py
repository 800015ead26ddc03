"""The lost-node sweep: nodes unheard for longer than the grace period are
declared lost, unless the control plane could not hear anyone (``clock``)."""

from __future__ import annotations

import datetime as dt

import redis
from django.conf import settings
from django.utils import timezone

from core.choices import EventSeverity

from . import hooks, liveness
from .choices import LIVE, NodeStatus
from .clock import control_plane_clock_update, control_plane_hold_update, post_outage_grace
from .models import Node
from .services import node_transition


def nodes_sweep_lost(*, now: dt.datetime | None = None) -> list[str]:
    """Mark nodes unheard for longer than the grace period as lost.

    Compare-and-set per node; safe to run concurrently and repeatedly.
    """
    now = now or timezone.now()
    grace = dt.timedelta(seconds=settings.LLMGW_NODE_GRACE)
    # After the control plane's own outage, every node's silence counts from
    # the moment it could hear again, and its agent may be a backoff away.
    after_outage = dt.timedelta(seconds=post_outage_grace())
    heard_since = control_plane_clock_update(now=now)
    if heard_since is None:
        return []
    store = liveness.store()
    try:
        seen = store.seen_all()
    except redis.RedisError:
        return []  # the next sweep's clock update finds Redis away, and holds
    stale_copies = []
    overdue = []
    # Nodes that fell silent together cross the deadline up to a heartbeat
    # apart: count as silent every node past half its grace, so that the first
    # one overdue is not failed over before the others are counted with it.
    silent = 0
    live = 0
    for node in Node.objects.filter(status__in=LIVE).only("id", "name", "status", "last_heartbeat_at", "status_changed_at"):
        live += 1
        last_ts = seen.get(node.name)
        last = timezone.datetime.fromtimestamp(last_ts, tz=dt.timezone.utc) if last_ts else node.last_heartbeat_at
        if last and (node.last_heartbeat_at is None or last - node.last_heartbeat_at > dt.timedelta(seconds=30)):
            node.last_heartbeat_at = last
            stale_copies.append(node)
        quiet = now - max(filter(None, [last, node.status_changed_at]))
        deaf_for = now - heard_since
        if quiet > grace / 2 and deaf_for > after_outage / 2:
            silent += 1
        if quiet > grace and deaf_for > after_outage:
            overdue.append((node, last))
    if stale_copies:
        Node.objects.bulk_update(stale_copies, ["last_heartbeat_at"], batch_size=500)
    if control_plane_hold_update(silent=silent, live=live, now=now):
        return []
    lost = []
    for node, last in overdue:
        # A heartbeat may have landed since seen_all(): look once more.
        try:
            latest = store.seen(node.name)
        except redis.RedisError:
            return lost
        if latest and now.timestamp() - latest <= grace.total_seconds():
            continue
        silent_for = (now - (last or node.status_changed_at)).total_seconds()
        changed = node_transition(
            node_name=node.name,
            to=NodeStatus.LOST,
            expected=node.status,
            reason=f"no heartbeat for {silent_for:.0f}s (grace {grace.total_seconds():.0f}s)",
            severity=EventSeverity.ERROR,
        )
        if changed is not None:
            lost.append(node.name)
            for handler in hooks.node_lost_handlers:
                handler(node_name=node.name)
    return lost
