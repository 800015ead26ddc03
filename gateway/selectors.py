"""Reads for the gateway: its routing snapshot, keys, in-flight counts, and
the cluster figures of /metrics."""

from __future__ import annotations

import datetime as dt
import logging
import time
import json
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import Count

from agent.protocol import http_url
from nodes.choices import NodeStatus
from nodes.models import Gpu, Node
from nodes.selectors import age_seconds, gpu_health_list, node_last_seen
from replicas.choices import ReplicaStatus
from replicas.models import CachedWeights, CatalogEntry, GpuAllocation, Member, NodeCache, Replica

from . import engineload, inflight
from .engineload import REDIS_KEY as ENGINE_READINGS_KEY
from .autoscale_metrics import autoscale_gauges
from .limits import Limits, limits_of
from .models import ApiKey, KeyUsage
from .queue import batch_limit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouteRow:
    replica_id: int
    model: str
    base_url: str


@dataclass(frozen=True)
class KeyRow:
    id: int
    name: str
    secret_hash: str
    allowed_models: frozenset[str] | None  # None: every model
    limits: Limits | None = None
    expires_at: float | None = None  # unix seconds
    priority: str = "standard"


@dataclass(frozen=True)
class RoutingSnapshot:
    catalog: dict[str, int]  # model name -> created (unix seconds)
    routes: list[RouteRow]
    keys: list[KeyRow]
    # model name -> routing policy (replicas.choices.RoutingPolicy); absent: least-outstanding
    policies: dict[str, str] = field(default_factory=dict)
    # model name -> its catalog 'timeouts' (gateway/timeouts.py), for the models that set any
    timeouts: dict[str, dict] = field(default_factory=dict)
    # model name -> each replica's batch limit, from its catalog args (gateway/queue.py)
    batch_limits: dict[str, int] = field(default_factory=dict)


def routing_version() -> tuple:
    """The routing version: a value that moves whenever anything the routing
    table is made from changes: the replicas (any status change moves it), the
    catalog and the API keys. One query, run by every gateway process a few
    times a second."""
    q = connection.ops.quote_name
    replica, model, key = (q(m._meta.db_table) for m in (Replica, CatalogEntry, ApiKey))
    sql = (
        f"SELECT (SELECT COUNT(*) FROM {replica}), (SELECT MAX(status_changed_at) FROM {replica}),"
        f" (SELECT COUNT(*) FROM {replica} WHERE status = %s), (SELECT SUM(id) FROM {replica} WHERE status = %s),"
        f" (SELECT COUNT(*) FROM {model}), (SELECT MAX(updated_at) FROM {model}),"
        f" (SELECT COUNT(*) FROM {key}), (SELECT MAX(updated_at) FROM {key})"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [ReplicaStatus.READY, ReplicaStatus.READY])
        return tuple(cursor.fetchone())


def routing_snapshot() -> RoutingSnapshot:
    """The catalog, the leader address of every ready replica, and the live keys."""
    catalog, policies, timeouts, batch_limits = {}, {}, {}, {}
    for name, created, routing, removing, model_timeouts, args in CatalogEntry.objects.values_list(
            "name", "created_at", "routing", "removing", "timeouts", "args"):
        policies[name] = routing  # a model being removed still routes to its last replicas as it did
        if model_timeouts:
            timeouts[name] = model_timeouts
        batch_limits[name] = batch_limit(args)
        if not removing:
            catalog[name] = int(created.timestamp())
    routes = []
    members = (
        Member.objects.filter(serves_http=True, replica__status=ReplicaStatus.READY)
        .values_list("replica_id", "replica__model__name", "replica__model__created_at", "node__mgmt_addr", "ports")
        .order_by("replica_id")
    )
    for replica_id, model, created, addr, ports in members:
        port = (ports or {}).get("http")
        if not addr or not port:
            continue
        try:
            # Built from parts: a stored address that is not one (a row from
            # before heartbeats were checked) routes nowhere.
            base_url = http_url(addr, int(port))
        except (TypeError, ValueError) as exc:
            logger.warning("replica=%s not routed: its leader's address is unusable: %s", replica_id, exc)
            continue
        routes.append(RouteRow(replica_id=replica_id, model=model, base_url=base_url))
        catalog.setdefault(model, int(created.timestamp()))
    keys = [_key_row(values) for values in ApiKey.objects.filter(revoked_at__isnull=True).values_list(*_KEY_FIELDS)]
    return RoutingSnapshot(catalog=catalog, routes=routes, keys=keys, policies=policies, timeouts=timeouts,
                           batch_limits=batch_limits)


def key_by_secret_hash(*, secret_hash: str) -> KeyRow | None:
    """A live key by the hash of its secret (a key made since the routing table was loaded)."""
    row = ApiKey.objects.filter(secret_hash=secret_hash, revoked_at__isnull=True).values_list(*_KEY_FIELDS).first()
    return None if row is None else _key_row(row)


_KEY_FIELDS = ("id", "name", "secret_hash", "allowed_models", "rpm", "tpm", "max_concurrent", "daily_tokens",
               "monthly_tokens", "expires_at", "priority")


def _key_row(values) -> KeyRow:
    pk, name, digest, allowed, rpm, tpm, concurrent, daily, monthly, expires, priority = values
    return KeyRow(id=pk, name=name, secret_hash=digest, allowed_models=frozenset(allowed) if allowed else None,
                  limits=limits_of(rpm, tpm, concurrent, daily, monthly),
                  expires_at=expires.timestamp() if expires else None, priority=priority)


def replica_inflight(replica_id: int) -> int:
    """Requests in flight on a replica, summed over every live gateway process.

    A process whose routing table still holds the replica counts as one more:
    it may send a request there at any moment. So 0 means that no gateway
    sends the replica anything now, nor will.
    """
    total = 0
    for record in inflight.live_records():
        total += record.inflight.get(replica_id, 0)
        if replica_id in record.routes:
            total += 1
    return total


def engine_readings(*, replica_ids: list[int]) -> dict[int, dict[str, Any]]:
    """The gateways' last reading of each replica's engine metrics (gateway.engineload),
    by replica id; a replica not read lately is absent. Read from Redis, where
    the gateway processes publish them; without Redis, from this process's
    gateway when it has read them."""
    if not replica_ids:
        return {}
    found: dict[int, dict[str, Any]] = {}
    if settings.LLMGW_REDIS_URL:
        client = inflight.store().client
        for replica_id, raw in zip(replica_ids, client.hmget(ENGINE_READINGS_KEY, [str(i) for i in replica_ids])):
            if raw is None:
                continue
            try:
                found[replica_id] = json.loads(raw)
            except ValueError:
                continue
        return found
    for replica_id in replica_ids:
        reading = engineload.LATEST.get(replica_id)
        if reading is not None:
            found[replica_id] = json.loads(reading.to_json())
    return found


def gateway_processes() -> list[inflight.ProcessRecord]:
    return inflight.live_records()


def key_list():
    return ApiKey.objects.all()


USAGE_HOURS_MAX = 93 * 24


def key_usage(*, key: str | None = None, model: str | None = None, hours: int = 24) -> list[dict[str, Any]]:
    """Hourly usage rows of the last ``hours`` hours (the current one included), oldest first."""
    now = time.time()
    since = dt.datetime.fromtimestamp((int(now // 3600) - hours + 1) * 3600, tz=dt.timezone.utc)
    rows = KeyUsage.objects.filter(hour__gte=since)
    if key:
        rows = rows.filter(key__name=key)
    if model:
        rows = rows.filter(model=model)
    return list(rows.order_by("hour", "key__name", "model").values(
        "key__name", "model", "hour", "requests", "prompt_tokens", "completion_tokens"))


def _gpu_states(status: str, allocated: int, total: int) -> tuple[int, int, int]:
    unallocated = total - allocated
    return (allocated, 0, unallocated) if status == NodeStatus.LOST else (allocated, unallocated, 0)


def cluster_gauges() -> dict[str, Any]:
    """Replicas by model and status, nodes by status, heartbeat ages, GPUs."""
    replicas = {(m, s): n for m, s, n in
                Replica.objects.values_list("model__name", "status").annotate(n=Count("id")).order_by()}
    nodes = list(Node.objects.only("name", "status", "last_heartbeat_at"))
    node_states = {s: 0 for s in NodeStatus.values}
    for node in nodes:
        node_states[node.status] = node_states.get(node.status, 0) + 1
    seen = node_last_seen(nodes)
    gpus = dict(Gpu.objects.filter(missing_since=None).values_list("node__name").annotate(n=Count("id")).order_by())
    allocated = dict(GpuAllocation.objects.values_list("node__name").annotate(n=Count("id")).order_by())
    return {
        "at": time.time(),
        "replica_statuses": ReplicaStatus.values,
        "replicas": replicas,
        "nodes": node_states,
        "node_heartbeat_age": {n.name: age_seconds(seen.get(n.name)) for n in nodes},
        # (allocated, free, unavailable): a lost node's GPUs are not free, whatever it held.
        "gpus": {n.name: _gpu_states(n.status, allocated.get(n.name, 0), gpus.get(n.name, 0)) for n in nodes},
        "autoscale": autoscale_gauges(),
        # Each GPU's health and latest readings (nodes.selectors.gpu_health_list).
        "gpu_health": gpu_health_list(),
        **_weights_gauges(),
    }


def _weights_gauges() -> dict[str, Any]:
    """Per node: bytes of verified weights held, revisions being fetched, free cache space."""
    cached: dict[str, int] = {}
    fetching: dict[str, int] = {}
    for node, size, complete in CachedWeights.objects.values_list("node__name", "bytes", "complete"):
        if complete:
            cached[node] = cached.get(node, 0) + size
        else:
            fetching[node] = fetching.get(node, 0) + 1
    free = dict(NodeCache.objects.values_list("node__name", "free_bytes"))
    return {"weights_cached": cached, "weights_fetching": fetching, "weights_free": free}
