"""GPU telemetry in the database: the embedded default's store (no Redis).

``llmgw up`` runs the agent API and the web process as separate processes,
so readings kept in the agent API's memory would never reach the pages,
``ctl gpus`` or /metrics. Without Redis they go to bounded rows instead:

- ``GpuReadings``: one row per node, its latest block. A node's row is
  written at most every ``LATEST_EVERY`` seconds by each agent API process
  (the agent may send a block every second), and at once when a GPU's
  health changed, since that is what the pages must not show late.
- ``GpuSample``: one row per node and history step, in a ring of an hour's
  slots: a new sample overwrites the one an hour older (one UPDATE; an
  INSERT only while the first hour fills), so the table never grows past
  nodes × slots and needs no sweep.

A node's readings cost one short write every few seconds and a sample every
``LLMGW_GPU_HISTORY_STEP``: no more than liveness already writes per
heartbeat on the embedded default. Readers (the web process) see them as
soon as they are committed.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from django.conf import settings
from django.db import DatabaseError, IntegrityError, transaction

from core import outages

from .models import GpuReadings, GpuSample

logger = logging.getLogger(__name__)

# Seconds between two writes of a node's latest block when no GPU's health changed.
# Pages call readings older than two minutes unknown (nodes.selectors.STALE_READINGS).
LATEST_EVERY = 5.0
HEALTH = 16  # a GPU's health in a latest block's list (telemetry.LATEST_FIELDS)


class DatabaseTelemetry:
    """Latest blocks and an hour of samples in bounded rows; see the module's text."""

    def __init__(self, history_seconds: float) -> None:
        self.history_seconds = history_seconds
        # node -> (when this process last wrote its latest block, the GPUs' health then)
        self._written: dict[str, tuple[float, list[str]]] = {}

    @property
    def slots(self) -> int:
        return max(1, int(self.history_seconds / settings.LLMGW_GPU_HISTORY_STEP))

    def put(self, node: str, latest: str, sample: str | None) -> None:
        now = time.monotonic()
        health = [g[HEALTH] for g in json.loads(latest)["gpus"]]
        written = self._written.get(node)
        fresh = written is not None and now - written[0] < LATEST_EVERY and written[1] == health
        if fresh and sample is None:
            return
        if not outages.database_dependency.worth_trying():
            return  # readings are telemetry: the next ones replace them
        try:
            with transaction.atomic():
                if not fresh:
                    _upsert(GpuReadings.objects.filter(node_id=node), dict(block=latest),
                            lambda: GpuReadings(node_id=node, block=latest))
                if sample is not None:
                    at = json.loads(sample)[0]
                    slot = int(at // settings.LLMGW_GPU_HISTORY_STEP) % self.slots
                    _upsert(GpuSample.objects.filter(node_id=node, slot=slot), dict(at=at, sample=sample),
                            lambda: GpuSample(node_id=node, slot=slot, at=at, sample=sample))
        except DatabaseError as exc:
            outages.dependency_failed(exc)
            logger.warning("GPU telemetry not written to the database node=%s: %s", node, exc)
            return
        if not fresh:
            self._written[node] = (now, health)

    def flush(self) -> None:
        pass

    def latest(self, node: str | None = None) -> dict[str, dict[str, Any]]:
        rows = GpuReadings.objects.all() if node is None else GpuReadings.objects.filter(node_id=node)
        return {name: json.loads(block) for name, block in rows.values_list("node_id", "block")}

    def history(self, node: str) -> list[list[Any]]:
        since = time.time() - self.history_seconds
        rows = GpuSample.objects.filter(node_id=node, at__gte=since).order_by("at").values_list("sample", flat=True)
        return [json.loads(s) for s in rows]

    def forget(self, node: str) -> None:
        self._written.pop(node, None)
        GpuReadings.objects.filter(node_id=node).delete()
        GpuSample.objects.filter(node_id=node).delete()


def _upsert(rows, values: dict[str, Any], new) -> None:
    """UPDATE the row, or INSERT it the first time; two agent API processes
    inserting the same row at once leave one (the other's readings are as new)."""
    if rows.update(**values):
        return
    try:
        with transaction.atomic():
            new().save(force_insert=True)
    except IntegrityError:
        rows.update(**values)
