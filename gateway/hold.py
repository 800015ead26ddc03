"""Requests held for an autoscaled model that has no ready replica (at zero,
or its replicas still starting): the client gets neither a 404 nor a 503 but
waits while a replica is placed and starts, then goes to it.

Per model, at most ``hold_max`` requests wait, each at most ``hold_wait``
seconds (the model's policy). With Redis the count is the deployment's: every
gateway process takes a held request's place with one atomic Lua script on a
sorted set per model (the places of the whole deployment), and gives it back
when the request leaves the hold; a place a crashed process never gave back
expires after ``hold_wait`` (plus a margin). Without Redis (the embedded
default, one process) the count is this process's. If Redis cannot be
asked, the process's own count decides (logged, and counted in
``llmgw_gateway_hold_errors_total``). Past the count: 429; past the wait:
503; both with ``Retry-After`` and an OpenAI-style error saying that the
model is starting. Streamed requests are held the same way (nothing is
sent before a replica takes them). When a replica is ready the held requests
go in arrival order: one "door" task per model watches the routing table and
releases the waiters first in, first out.

Holding a request asks the autoscaler for a look at once (after publishing
this process's counts, so that the look sees the held request), at most once
a second per model.
"""

from __future__ import annotations

import asyncio
import itertools
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
HOLD_ERRORS = Counter("llmgw_gateway_hold_errors_total",
                      "Requests held within this process's count only because Redis could not be asked.")
# A place a crashed process never gave back frees itself this long after its request's longest wait.
PLACE_MARGIN = 30.0
KEY = "llmgw:hold:{}"

# KEYS: the model's places; ARGV: most held, seconds a place lives, the place's name.
# Redis's clock, not each gateway host's, dates the places.
_TAKE = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', t)
local held = redis.call('ZCARD', KEYS[1])
if held >= tonumber(ARGV[1]) then return {0, held} end
redis.call('ZADD', KEYS[1], t + tonumber(ARGV[2]), ARGV[3])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2])))
return {1, held + 1}
"""


class RedisPlaces:
    """The deployment's held-request places, one sorted set per model in Redis."""

    def __init__(self, url: str, owner: str) -> None:
        import redis.asyncio as aredis

        self.client = aredis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self.owner = owner
        self._names = itertools.count(1)
        self._script = self.client.register_script(_TAKE)
        self._giving: set[asyncio.Task] = set()

    async def take(self, model: str, most: int, wait: float) -> str | None:
        """A place's name, or None when ``most`` are held already (across every process)."""
        name = f"{self.owner}:{next(self._names)}"
        answer = asyncio.ensure_future(self._script(keys=[KEY.format(model)], args=[most, wait + PLACE_MARGIN, name]))
        try:
            taken, _ = await asyncio.shield(answer)
        except asyncio.CancelledError:
            # The client went away while Redis answered: give back the place the script may have taken.
            answer.add_done_callback(lambda f: f.cancelled() or f.exception() or self.give_back(model, name))
            raise
        return name if int(taken) else None

    def give_back(self, model: str, name: str) -> None:
        """In the background: a request leaving the hold (served, timed out, gone) does not wait for Redis."""
        task = asyncio.get_running_loop().create_task(self._give_back(model, name))
        self._giving.add(task)
        task.add_done_callback(self._giving.discard)

    async def _give_back(self, model: str, name: str) -> None:
        try:
            await self.client.zrem(KEY.format(model), name)
        except Exception as exc:  # it expires after its wait anyway
            logger.warning("gateway could not give back a held place of model=%s: %s", model, exc)

    async def close(self) -> None:
        if self._giving:
            await asyncio.gather(*self._giving, return_exceptions=True)
        await self.client.aclose()


class Holds:
    def __init__(self, places: RedisPlaces | None = None) -> None:
        # The deployment's count (Redis); None: this process's alone.
        self.places = places
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
        place = None
        if self.places is not None:
            try:
                place = await self.places.take(model, most, wait)
            except Exception as exc:
                # This process's count alone (checked above): a dead Redis does not refuse every held request.
                HOLD_ERRORS.inc()
                logger.warning("gateway could not count held requests of model=%s in redis (this process's "
                               "count decides): %s", model, exc)
                if len(queue) >= most:  # others of this process came in while Redis was asked
                    HELD.labels(model, "full").inc()
                    return _starting(429, model, f"{most} request(s) already wait for it here", retry=min(wait, 10))
            else:
                if place is None:
                    HELD.labels(model, "full").inc()
                    return _starting(429, model, f"{most} request(s) already wait for it across the gateways",
                                     retry=min(wait, 10))
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
            if place is not None:
                self.places.give_back(model, place)
        HELD.labels(model, "served").inc()
        return None

    async def close(self) -> None:
        if self.places is not None:
            await self.places.close()

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
