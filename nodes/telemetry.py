"""GPU telemetry on the control plane: checked, judged, kept in Redis.

A heartbeat carries a telemetry block at most every telemetry interval
(``agent.protocol.Telemetry``). Readings are not state: they go to Redis, the
latest block per node in one hash and an hour of samples per node in a
capped list, never a database write per reading (the embedded default has
no Redis: there they go to bounded rows, ``nodes.telemetry_rows``). What a
reading changes about a GPU's state (a quarantine) is a row with an Event
(``nodes.gpus``), written only when the verdict differs from what the
database already says; the process keeps each node's quarantines in memory,
valid for the node's liveness version (any service that changes them bumps
it).

The hot path costs a few tens of microseconds per block: a check of the
values against the protocol's bounds (``nodes.validation.LIMITS``, the
same the heartbeat's serializer applies), eight verdicts, one JSON encoding,
and, in the agent API, a place in the next write-behind batch (one Redis
pipeline a few times a second for every node that reported).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Any, Callable

import redis
from django.conf import settings

from agent.protocol import TELEMETRY_SOURCES, GpuReading

from . import liveness
from .choices import GpuFault, GpuHealth
from .gpu_health import HEALTH_CODES, Policy, Verdict, gpu_verdict, reset_shown
from .telemetry_rows import DatabaseTelemetry
from .validation import LIMITS, HeartbeatInvalid

logger = logging.getLogger(__name__)

LATEST_KEY = "llmgw:gpu:latest"
HISTORY_KEY = "llmgw:gpu:history:"
HISTORY_SECONDS = 3600
WRITE_BEHIND = 0.5
# The latest readings per GPU, in this order (a list per GPU keeps the block small).
LATEST_FIELDS = (
    "index", "uuid", "util", "mem_util", "mem_used_mib", "mem_total_mib", "temp_c", "power_w", "power_limit_w",
    "ecc_corrected", "ecc_uncorrected", "pending_retirement", "thermal_throttle", "last_xid", "lost", "error",
    "health", "reason",
)
# A history sample per GPU: [index, util, mem_used_mib, temp_c, power_w, health code].
HISTORY_FIELDS = ("index", "util", "mem_used_mib", "temp_c", "power_w", "health")


def policy() -> Policy:
    return Policy(
        temp_degraded_c=settings.LLMGW_GPU_TEMP_DEGRADED,
        ecc_corrected_storm=settings.LLMGW_GPU_ECC_STORM,
        auto_clear=settings.LLMGW_GPU_AUTO_CLEAR,
    )


# --- the check -------------------------------------------------------------------------

def _rules() -> list[tuple[str, tuple[type, ...], bool, Any, dict[str, Any]]]:
    rules = []
    for f in dataclasses.fields(GpuReading):
        kind = GpuReading.__annotations__[f.name]
        nullable = "None" in kind
        base = (int,) if kind.startswith("int") else (int, float) if kind.startswith("float") else \
            (bool,) if kind.startswith("bool") else (str,) if kind.startswith("str") else (list,)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        rules.append((f.name, base, nullable, default, LIMITS.get(f"GpuReading.{f.name}", {})))
    return rules


_RULES = _rules()


def _bad(where: str, message: str) -> HeartbeatInvalid:
    return HeartbeatInvalid({"telemetry": [f"{where}: {message}"]})


def telemetry_parse(value: Any) -> dict[str, Any] | None:
    """The block as plain values, its defaults filled in; HeartbeatInvalid
    names the first field that breaks the protocol's bounds. Unknown keys are
    ignored (a newer agent). Nothing is stored by this."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("telemetry", "must be a JSON object {source, gpus, note}")
    source = value.get("source")
    if source not in TELEMETRY_SOURCES:
        raise _bad("telemetry.source", f"must be one of {', '.join(TELEMETRY_SOURCES)}")
    note = value.get("note", "")
    if not isinstance(note, str) or len(note) > LIMITS["Telemetry.note"]["max_length"]:
        raise _bad("telemetry.note", f"must be a string of at most {LIMITS['Telemetry.note']['max_length']} characters")
    gpus = value.get("gpus", [])
    if not isinstance(gpus, list) or len(gpus) > LIMITS["Telemetry.gpus"]["max_length"]:
        raise _bad("telemetry.gpus", f"must be a list of at most {LIMITS['Telemetry.gpus']['max_length']} readings")
    readings = []
    seen = set()
    for i, raw in enumerate(gpus):
        if not isinstance(raw, dict):
            raise _bad(f"telemetry.gpus[{i}]", "must be a JSON object")
        reading = {}
        for name, kinds, nullable, default, limits in _RULES:
            v = raw.get(name, default)
            where = f"telemetry.gpus[{i}].{name}"
            if v is dataclasses.MISSING:
                raise _bad(where, "is required")
            if v is None:
                if not nullable:
                    raise _bad(where, "may not be null")
            elif not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
                raise _bad(where, f"expected {kinds[0].__name__}, not {type(v).__name__}")
            elif kinds[0] is list:
                if len(v) > limits.get("max_length", 32) or not all(
                        isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 65535 for x in v):
                    raise _bad(where, "must be a short list of Xid numbers (0-65535)")
            elif kinds[0] is str:
                if len(v) > limits.get("max_length", 255):
                    raise _bad(where, f"at most {limits.get('max_length', 255)} characters")
            elif kinds[0] is not bool:
                if not (limits.get("min_value", 0) <= v <= limits.get("max_value", 2**63 - 1)):
                    raise _bad(where, f"must be between {limits.get('min_value', 0)} and {limits.get('max_value')}")
            reading[name] = v
        if reading["index"] in seen:
            raise _bad(f"telemetry.gpus[{i}].index", f"GPU {reading['index']} is reported twice")
        seen.add(reading["index"])
        readings.append(reading)
    return {"source": source, "note": note, "gpus": readings}


# --- what the database says, per node, cached for the node's liveness version --------------

@dataclasses.dataclass(frozen=True)
class GpuState:
    gpu_id: int
    quarantined: bool
    fault: str
    last_xid: int | None
    baseline: int


_states: dict[str, tuple[Any, dict[int, GpuState]]] = {}
_corrected: dict[tuple[str, int], int] = {}
_history_at: dict[str, float] = {}


def node_gpu_states(node_name: str) -> dict[int, GpuState]:
    from .models import Gpu

    rows = Gpu.objects.filter(node__name=node_name, missing_since=None).values_list(
        "index", "id", "quarantined_at", "quarantine_kind", "last_xid", "ecc_uncorrected_baseline")
    return {index: GpuState(gpu_id, at is not None, kind, xid, baseline)
            for index, gpu_id, at, kind, xid, baseline in rows}


def _states_of(node_name: str) -> dict[int, GpuState]:
    store = liveness.store()
    version = store.version(node_name) if store.caches_nodes else None
    cached = _states.get(node_name)
    if version is not None and cached is not None and cached[0] == version:
        return cached[1]
    states = node_gpu_states(node_name)
    if version is not None:
        _states[node_name] = (version, states)
    return states


def forget_node(node_name: str) -> None:
    """This process's copy of the node's GPU states is stale (other processes
    learn it from the liveness bump the service makes on commit)."""
    _states.pop(node_name, None)


def forget_cache() -> None:
    _states.clear()
    _corrected.clear()
    _history_at.clear()


# --- receiving a block -----------------------------------------------------------------------

def telemetry_keep(*, node_name: str, block: dict[str, Any], persist: Callable[..., None]) -> None:
    """Judge each GPU, act on what changed its state (``persist``:
    ``nodes.gpus.gpus_judged``), keep the readings.

    A quarantine (or an application Xid, or a clear by the reset rule) goes to
    the database before the heartbeat is answered: should that fail, the
    agent gets a 503 and sends the same Xids again."""
    states = _states_of(node_name)
    pol = policy()
    rows = []
    quarantine, app_xids, cleared = {}, {}, []
    for r in block["gpus"]:
        index = r["index"]
        state = states.get(index)
        key = (node_name, index)
        verdict = gpu_verdict(r, baseline=state.baseline if state else 0,
                              previous_corrected=_corrected.get(key), policy=pol)
        if r["ecc_corrected"] is not None:
            _corrected[key] = r["ecc_corrected"]
        health = verdict.health
        reason = verdict.reason
        if state is not None:
            if state.quarantined:
                if reset_shown(fault=state.fault, xid=state.last_xid, reading=r, policy=pol) and not r["xids"]:
                    cleared.append(index)
                else:
                    health = GpuHealth.QUARANTINED
                    reason = reason if verdict.health == GpuHealth.QUARANTINED else "quarantined"
            elif verdict.health == GpuHealth.QUARANTINED:
                quarantine[index] = verdict
            if verdict.application_xids:
                app_xids[index] = verdict.application_xids
        rows.append([r["index"], r["uuid"], r["util"], r["mem_util"], r["mem_used_mib"], r["mem_total_mib"],
                     r["temp_c"], r["power_w"], r["power_limit_w"], r["ecc_corrected"], r["ecc_uncorrected"],
                     r["pending_retirement"], r["thermal_throttle"], r["last_xid"], r["lost"], r["error"],
                     health, reason])
    if block["source"] != "nvidia-smi":
        # Fail closed: a GPU the node has that NVML does not list cannot be vouched for.
        listed = {r["index"] for r in block["gpus"]}
        for index, state in states.items():
            if index not in listed and not state.quarantined:
                quarantine[index] = Verdict(GpuHealth.QUARANTINED, "NVML does not list this GPU", GpuFault.NVML)
    if quarantine or app_xids or cleared:
        persist(node_name=node_name, quarantine=quarantine, application_xids=app_xids,
                                 cleared_by_rule=cleared, readings={r["index"]: r for r in block["gpus"]})
        forget_node(node_name)
    now = time.time()
    latest = json.dumps({"at": round(now, 1), "source": block["source"], "note": block["note"], "gpus": rows},
                        separators=(",", ":"))
    sample = None
    if now - _history_at.get(node_name, 0.0) >= settings.LLMGW_GPU_HISTORY_STEP:
        _history_at[node_name] = now
        sample = json.dumps([round(now), [[g[0], g[2], g[4], g[6], g[7], HEALTH_CODES[g[16]]] for g in rows]],
                            separators=(",", ":"))
    store().put(node_name, latest, sample)


# --- the store ---------------------------------------------------------------------------------

class RedisTelemetry:
    """Latest blocks in one hash, each node's samples in a capped list."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self._pending: dict[str, tuple[str, list[str]]] = {}
        self._lock = threading.Lock()
        self._writer: threading.Thread | None = None

    @property
    def samples(self) -> int:
        return max(1, int(HISTORY_SECONDS / settings.LLMGW_GPU_HISTORY_STEP))

    def put(self, node: str, latest: str, sample: str | None) -> None:
        if getattr(liveness.store(), "feed", None) is None:
            self._write({node: (latest, [sample] if sample else [])})  # not the agent API: write now
            return
        with self._lock:
            _, samples = self._pending.get(node, ("", []))
            self._pending[node] = (latest, samples + [sample] if sample else samples)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_behind, name="gpu-telemetry", daemon=True)
                self._writer.start()

    def flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, {}
        if batch:
            self._write(batch)

    def _write_behind(self) -> None:
        while True:
            time.sleep(WRITE_BEHIND)
            try:
                self.flush()
            except redis.RedisError as exc:  # readings are telemetry: the next ones replace them
                logger.warning("GPU telemetry not written to Redis: %s", exc)

    def _write(self, batch: dict[str, tuple[str, list[str]]]) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(LATEST_KEY, mapping={node: latest for node, (latest, _) in batch.items()})
        for node, (_, samples) in batch.items():
            if samples:
                key = HISTORY_KEY + node
                pipe.rpush(key, *samples)
                pipe.ltrim(key, -self.samples, -1)
                pipe.expire(key, HISTORY_SECONDS + 600)
        pipe.execute()

    def latest(self, node: str | None = None) -> dict[str, dict[str, Any]]:
        if node is not None:
            raw = self.client.hget(LATEST_KEY, node)
            return {node: json.loads(raw)} if raw else {}
        return {k.decode(): json.loads(v) for k, v in self.client.hgetall(LATEST_KEY).items()}

    def history(self, node: str) -> list[list[Any]]:
        return [json.loads(s) for s in self.client.lrange(HISTORY_KEY + node, 0, -1)]

    def forget(self, node: str) -> None:
        self.client.hdel(LATEST_KEY, node)
        self.client.delete(HISTORY_KEY + node)


_store: RedisTelemetry | DatabaseTelemetry | None = None
_store_lock = threading.Lock()


def store() -> RedisTelemetry | DatabaseTelemetry:
    """Redis where liveness is in Redis (production), else bounded rows in
    the database, which every process of the embedded default reads."""
    global _store
    if _store is None:
        with _store_lock:
            if _store is None:
                _store = (RedisTelemetry(settings.LLMGW_REDIS_URL) if settings.LLMGW_REDIS_URL
                          else DatabaseTelemetry(HISTORY_SECONDS))
    return _store


def _store_clear() -> None:
    global _store
    with _store_lock:
        _store = None


store.cache_clear = _store_clear


def readings_of(latest: dict[str, Any]) -> list[dict[str, Any]]:
    """A node's latest block, one dict per GPU (LATEST_FIELDS)."""
    return [dict(zip(LATEST_FIELDS, g)) for g in latest.get("gpus", [])]
