"""The heartbeat's hot path.

Most heartbeats say nothing new: same inventory, same engines, same desired
state. Those are answered from a per-process cache, and the liveness store
records them (in the agent API, written behind without a round trip; see
``liveness.HeartbeatFeed``) and says whether the node's cached state is still
current. Anything new (a changed inventory or engine, a status or
desired-state change, a node we have not cached) goes to the database, and
is validated before anything about it is recorded, liveness included: a
malformed heartbeat stores nothing. A well-formed one is never refused for
what its inventory says about other rows (a GPU another node holds, a GPU
gone while allocated: see ``nodes.inventory``); if the database still refuses
it, the node's liveness is recorded all the same.

When the database is away, a node this process has answered before is
answered from that copy (its liveness still goes to Redis; what it brought
that is new waits, since the agent repeats it in every heartbeat); a node it
has not is refused with 503. When Redis is away nothing cached can be
trusted: every heartbeat goes to the database, and its time waits in memory.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import DatabaseError, OperationalError

from core import outages

from . import hooks, liveness, selectors
from .clock import agent_reconnect_max
from .choices import NodeStatus
from .exceptions import InventoryRejected
from .inventory import node_heartbeat_apply
from .gpus import gpus_judged
from .models import Node
from .telemetry import telemetry_keep, telemetry_parse
from .validation import heartbeat_clean

INVENTORY_FIELDS = ("agent_version", "mgmt_addr", "mgmt_interface", "fabrics", "gpus", "hcas", "discovery_errors")
_NEEDS_APPLY = (NodeStatus.REGISTERED, NodeStatus.LOST)


@dataclass(frozen=True)
class _Known:
    version: Any  # the liveness store's cache version of the node when this was read
    status: str
    inventory_hash: str
    engines_hash: str
    desired: dict[str, Any]
    weights_hash: str = ""


_known: dict[str, _Known] = {}
# The last heartbeat body (bytes) each node's cached state was last matched
# with, and that state: a byte-identical body has the same hashes.
_matched: dict[str, tuple[bytes, _Known]] = {}
# The encoded reply of each cached state (the agent API's quick lane).
_encoded: dict[str, tuple[_Known, bytes]] = {}


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, separators=(",", ":"), default=str).encode()).hexdigest()


def inventory_hash(payload: dict[str, Any]) -> str:
    return _digest([payload.get(k) for k in INVENTORY_FIELDS])


def engines_hash(engines: Any) -> str:
    # The log tail is stored when something else changes, not a reason to write.
    if not isinstance(engines, list):
        return _digest(engines)
    return _digest(
        [
            [e.get(k) for k in ("member", "replica", "rank", "state", "pid", "exit_code", "healthy", "restarts")]
            if isinstance(e, dict)
            else e
            for e in engines
        ]
    )


def weights_hash(payload: dict[str, Any]) -> str:
    """What of the weights report is worth a write: which revisions, complete
    or not, errors, and bytes and free space to the percent (so a download
    writes its progress about a hundred times, not at every heartbeat)."""
    report = payload.get("weights")
    try:
        budget = report["budget_bytes"] or 1
        models = [[m["model"], m["revision"], m["complete"], m["error"],
                   int(100 * m["bytes"] / m["total"]) if m["total"] else m["bytes"]] for m in report["models"]]
        return _digest([int(100 * report["free_bytes"] / budget), report["downloads"] > 0, models])
    except (TypeError, KeyError, ValueError, ZeroDivisionError, AttributeError):
        return _digest(report)  # absent, or malformed: validation says which


def node_heartbeat_unchanged(*, node_name: str, body: bytes, encode: Callable[[dict[str, Any]], bytes]) -> bytes | None:
    """For the agent API's quick lane (``agentapi.quick``), which answers in
    its event loop: the encoded reply (``encode(reply)``) to a heartbeat that
    brings no news, its liveness recorded behind as ``node_heartbeat`` would;
    or None, having recorded nothing, for anything that ``node_heartbeat``
    must see: a body that is not a JSON object, a telemetry block (judging it
    may write), a node not cached here or whose cached state is stale, the
    liveness feed not subscribed (Redis away), a change. Never any I/O.

    A body byte-identical to the last one matched against the node's cached
    state is not decoded or hashed again.
    """
    store = liveness.store()
    feed = getattr(store, "feed", None)
    known = _known.get(node_name)
    if known is None or feed is None or not feed.live:
        return None
    matched = _matched.get(node_name)
    if matched is None or matched[1] is not known or matched[0] != body:
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        if not isinstance(payload, dict) or payload.get("telemetry") is not None:
            return None
        if (inventory_hash(payload) != known.inventory_hash
                or engines_hash(payload.get("engines", [])) != known.engines_hash
                or weights_hash(payload) != known.weights_hash):
            return None
        _matched[node_name] = (body, known)
    if feed.version(node_name) != known.version:
        return None
    feed.later(node_name, time.time())
    encoded = _encoded.get(node_name)
    if encoded is None or encoded[0] is not known:
        encoded = (known, encode(_reply(node_name, known)))
        _encoded[node_name] = encoded
    return encoded[1]


def _reply(node_name: str, known: _Known) -> dict[str, Any]:
    return {
        "node": node_name,
        "status": known.status,
        "heartbeat_interval": settings.LLMGW_HEARTBEAT_INTERVAL,
        "reconnect_max": agent_reconnect_max(),
        "desired": known.desired,
    }


def node_heartbeat(*, node_name: str, payload: dict[str, Any]) -> dict[str, Any]:
    # Checked first, like the rest of a heartbeat: a malformed block stores nothing.
    block = telemetry_parse(payload.get("telemetry"))
    reply = _node_heartbeat(node_name=node_name, payload=payload)
    if block is not None:
        telemetry_keep(node_name=node_name, block=block, persist=gpus_judged)
    return reply


def _node_heartbeat(*, node_name: str, payload: dict[str, Any]) -> dict[str, Any]:
    store = liveness.store()
    inv_hash = inventory_hash(payload)
    eng_hash = engines_hash(payload.get("engines", []))
    w_hash = weights_hash(payload)
    known = _known.get(node_name) if store.caches_nodes else None
    recorded = False
    if (known is not None and known.inventory_hash == inv_hash and known.engines_hash == eng_hash
            and known.weights_hash == w_hash):
        # The heartbeat we validated and stored last time: only liveness is news.
        version = store.heard(node_name, time.time())
        if version is not None and version == known.version:
            return _reply(node_name, known)
        recorded = True
    else:
        # Read before the row, so that a change made meanwhile shows as a new version.
        version = store.version(node_name)
    if not outages.database_dependency.worth_trying():
        if known is not None:
            return _reply_without_database(node_name, known, recorded)
        if not recorded:
            store.record(node_name, time.time())
        raise OperationalError(f"the database is unreachable ({outages.database_dependency.cause})")
    try:
        known = _from_database(node_name, payload, inv_hash, eng_hash, version, recorded,
                               w_hash=w_hash, previous_w_hash=known.weights_hash if known is not None else None)
    except DatabaseError as exc:
        if outages.dependency_failed(exc) is None:
            raise
        if known is None:
            if not recorded:
                store.record(node_name, time.time())
            raise
        return _reply_without_database(node_name, known, recorded)
    return _reply(node_name, known)


def _reply_without_database(node_name: str, known: _Known, recorded: bool) -> dict[str, Any]:
    """The database is away: answer from the last copy this process holds."""
    if not recorded:
        liveness.store().record(node_name, time.time())
    return _reply(node_name, known)


def _from_database(
    node_name: str, payload: dict[str, Any], inv_hash: str, eng_hash: str, version: Any, recorded: bool,
    *, w_hash: str = "", previous_w_hash: str | None = None,
) -> _Known:
    store = liveness.store()
    row = (
        Node.objects.filter(name=node_name)
        .values("status", "inventory_hash", "engines", "desired_version")
        .first()
    )
    registered = row is None
    if (
        row is None
        or row["status"] in _NEEDS_APPLY
        or row["inventory_hash"] != inv_hash
        or engines_hash(row["engines"]) != eng_hash
    ):
        data = heartbeat_clean(payload)
        try:
            node = node_heartbeat_apply(
                node_name=node_name,
                inventory={k: data[k] for k in INVENTORY_FIELDS},
                inventory_hash=inv_hash,
                engines=[dict(e) for e in data["engines"]],
            )
        except InventoryRejected:
            # A well-formed heartbeat from a registered node proves the node is
            # alive, whatever the database made of its inventory.
            if row is not None and not recorded:
                store.record(node_name, time.time())
            raise
        row = {"status": node.status, "desired_version": node.desired_version}
    if w_hash != previous_w_hash and hooks.weights_report_handlers:
        # The node's weights cache changed (or this process has not heard it
        # yet): the apps that place by it hear it before the answer is read,
        # so that a replica whose weights just arrived is in this answer.
        report = heartbeat_clean(payload).get("weights")
        for handler in hooks.weights_report_handlers:
            handler(node_name=node_name, report=report)
    if not recorded:
        store.record(node_name, time.time())
    if registered and row["desired_version"] == 0:
        # Just registered and never told anything: whatever gives a node
        # members bumps its version with them (else no long-poll would learn
        # of them), so at version 0 there are none to read.
        desired = {"version": 0, "members": []}
    else:
        desired = selectors.node_desired_state(node_name=node_name, version=row["desired_version"])
    known = _Known(
        version=version,
        status=row["status"],
        inventory_hash=inv_hash,
        engines_hash=eng_hash,
        desired=desired,
        weights_hash=w_hash,
    )
    _known[node_name] = known
    return known


def forget_cache() -> None:
    _known.clear()
    _matched.clear()
    _encoded.clear()
