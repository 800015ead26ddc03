"""Requests held for an autoscaled model that has no ready replica (at zero,
or its replicas still starting): the client gets neither a 404 nor a 503 but
waits while a replica is placed and starts, then goes to it.

Per model and process, at most ``hold_max`` requests wait, each at most
``hold_wait`` seconds (the model's policy). Past the count: 429; past the
wait: 503; both with ``Retry-After`` and an OpenAI-style error saying that
the model is starting. Streamed requests are held the same way (nothing is
sent before a replica takes them). When a replica is ready the held requests
go in arrival order: one "door" task per model watches the routing table and
releases the waiters first in, first out.

Holding a request asks the autoscaler for a look at once (after publishing
this process's counts, so that the look sees the held request), at most once
a second per model.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque

from django.http import HttpResponse
from prometheus_client import Counter

from replicas.autoscaling.service import autoscale_wake_request

from .choices import ErrorKind
from .errors import openai_error
from .metrics import METRICS_DIR  # noqa: F401 - prometheus_client's multiprocess mode is set up there

logger = logging.getLogger(__name__)

DOOR_POLL = 0.05
WAKE_EVERY = 1.0
HELD = Counter("llmgw_gateway_held_total", "Requests held for a model without a ready replica, by outcome "
               "(served, full: refused with 429, timeout: refused with 503).", ("model", "outcome"))


class Holds:
    def __init__(self) -> None:
        # model -> (most held, longest wait): the autoscaled models (load_report refreshes it).
        self.policies: dict[str, tuple[int, float]] = {}
        self.queues: dict[str, deque[asyncio.Future]] = {}
        self._doors: dict[str, asyncio.Task] = {}
        self._woken: dict[str, float] = {}

    def holds(self, model: str) -> bool:
        return model in self.policies

    def counts(self) -> dict[str, int]:
        return {model: len(queue) for model, queue in self.queues.items() if queue}

    async def hold(self, gw, model: str) -> HttpResponse | None:
        """Wait for a ready replica of ``model``; None when there is one, else the refusal."""
        most, wait = self.policies[model]
        queue = self.queues.setdefault(model, deque())
        if len(queue) >= most:
            HELD.labels(model, "full").inc()
            return _starting(429, model, f"{most} request(s) already wait for it here", retry=min(wait, 10))
        loop = asyncio.get_running_loop()
        turn = loop.create_future()
        queue.append(turn)
        self._wake(gw, model, loop)
        door = self._doors.get(model)
        if door is None or door.done():
            self._doors[model] = loop.create_task(self._door(gw, model), name=f"gateway-hold-{model}")
        try:
            async with asyncio.timeout(wait):
                await turn
        except TimeoutError:
            if turn.done() and not turn.cancelled():
                HELD.labels(model, "served").inc()  # let go in the very turn its wait ran out: it goes
                return None
            HELD.labels(model, "timeout").inc()
            return _starting(503, model, f"no replica was ready within {wait:g}s", retry=min(wait, 10))
        finally:
            if turn in queue:
                queue.remove(turn)
        HELD.labels(model, "served").inc()
        return None

    async def _door(self, gw, model: str) -> None:
        queue = self.queues[model]
        while queue:
            if gw.table.by_model.get(model):
                while queue:
                    turn = queue.popleft()
                    if not turn.done():
                        turn.set_result(True)
                break
            await asyncio.sleep(DOOR_POLL)

    def _wake(self, gw, model: str, loop: asyncio.AbstractEventLoop) -> None:
        now = time.monotonic()
        if now - self._woken.get(model, 0.0) < WAKE_EVERY:
            return
        self._woken[model] = now
        models = gw.load.counts(gw)

        def publish_and_ask() -> None:
            try:
                gw.load.publish(gw.name, models)
                autoscale_wake_request(model=model)
            except Exception as exc:  # the periodic tick comes anyway
                logger.warning("gateway could not ask the autoscaler about model=%s: %s", model, exc)

        loop.run_in_executor(gw._db, publish_and_ask)


def _starting(status: int, model: str, why: str, *, retry: float) -> HttpResponse:
    seconds = max(1, math.ceil(retry))
    return openai_error(status, f"Model `{model}` is starting (no replica is ready yet; one is being placed and "
                        f"started): {why}. Retry after {seconds}s.", ErrorKind.MODEL_STARTING,
                        headers={"Retry-After": str(seconds)})
