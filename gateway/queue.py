"""The gateway's queue: when every ready replica of a model is at capacity,
requests wait here instead of piling onto the engines.

A replica's capacity is its engine's batch limit (``--max-num-seqs`` in the
catalog entry's args, vLLM's default otherwise) plus the engine queue allowed
(``LLMGW_GATEWAY_ENGINE_QUEUE``); its load is this process's requests in
flight on it now plus the other gateway processes' share of the engine's
last reading (its running and waiting less what this process had there when
it was read: gateway.engineload, as routing counts it), so that two
processes do not each fill an engine to its batch limit; and it is full
whatever those counts when its engine last said it queues more than
allowed. The engine's whole running count is not used as the load: read once
a second, it is stale by the time a slot frees, and taking it as a floor made
requests wait for the next reading (measured: interactive TTFT p90 38x its
unloaded value); this process's own part of it is taken from its own count,
which is exact. Batch keys fill a replica only up to
``1 - LLMGW_GATEWAY_BATCH_HEADROOM`` of its capacity: the rest is kept for
interactive and standard keys, so that a batch flood never makes them wait.

Waiting requests go in order of priority class (interactive, standard,
batch), then round-robin between keys within a class (one key's burst does
not take every freed slot from the others), then arrival. The queue is
bounded per model and process: past ``LLMGW_GATEWAY_QUEUE_MAX`` waiting, a
429 (for the newest waiter of a lower class, if one waits, whose place the
new request takes; else for the new request); past ``LLMGW_GATEWAY_QUEUE_WAIT`` seconds, a 503; both with
``Retry-After``. A waiting client that goes away leaves the queue.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections import OrderedDict, deque
from dataclasses import dataclass

from prometheus_client import Counter

from .choices import PRIORITY_RANK, ErrorKind, Priority
from .metrics import METRICS_DIR  # noqa: F401 - prometheus_client's multiprocess mode is set up there

QUEUED = Counter("llmgw_gateway_queued_total", "Requests that waited in the gateway's queue for a model at "
                 "capacity, by priority class and outcome (served, full: 429, timeout: 503).",
                 ("model", "priority", "outcome"))

_CLASS_NAMES = {rank: name for name, rank in PRIORITY_RANK.items()}
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default batch limit
POLL = 0.05  # how often a model with waiters looks again (engine readings change without a request ending)
_BATCH_FLAGS = re.compile(r"^--(max-num-seqs|max-running-requests)(?:=(\d+))?$")


def batch_limit(args: list[str] | None) -> int:
    """The engine's batch limit from a catalog entry's args (vLLM/sim ``--max-num-seqs``, SGLang
    ``--max-running-requests``), or vLLM's default."""
    args = list(args or [])
    for i, arg in enumerate(args):
        match = _BATCH_FLAGS.match(str(arg))
        if match:
            value = match.group(2) or (args[i + 1] if i + 1 < len(args) else "")
            if str(value).isdigit() and int(value) > 0:
                return int(value)
    return DEFAULT_MAX_NUM_SEQS


def others_share(running: int | None, waiting: int, own_at_read: int) -> int:
    """The other gateway processes' requests on a replica, as its engine's last reading counted them: what it
    ran and queued less this process's own then (gateway.scoring's Candidate.load does the same for routing).
    Added to this process's own count now, which is exact and fresh: only the others' part is a reading old."""
    return max(0, (running or 0) + waiting - own_at_read)


@dataclass(frozen=True)
class QueueSettings:
    most: int  # waiting per model and process
    wait: float  # seconds
    engine_queue: int  # requests an engine may queue beyond its batch
    batch_headroom: float  # share of capacity batch keys leave free


class Refusal(Exception):
    def __init__(self, status: int, kind: str, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.retry_after = status, kind, message, retry_after


class _Waiter:
    __slots__ = ("future", "key_id", "rank", "granted")

    def __init__(self, future: asyncio.Future, key_id: int, rank: int) -> None:
        self.future, self.key_id, self.rank = future, key_id, rank
        self.granted = False  # woken with a slot: counted in _ModelQueue.granted until it goes or leaves


class _ModelQueue:
    """Waiters of one model: per class, keys in round-robin order, each key's waiters in arrival order."""

    def __init__(self) -> None:
        self.classes: list[OrderedDict[int, deque[_Waiter]]] = [OrderedDict() for _ in PRIORITY_RANK]
        self.count = 0
        self.granted = 0  # woken, not yet forwarded (their slot is spoken for)
        self.door: asyncio.Task | None = None

    def push(self, waiter: _Waiter) -> None:
        self.classes[waiter.rank].setdefault(waiter.key_id, deque()).append(waiter)
        self.count += 1

    def remove(self, waiter: _Waiter) -> None:
        keys = self.classes[waiter.rank]
        queue = keys.get(waiter.key_id)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self.count -= 1
            if not queue:
                del keys[waiter.key_id]

    def ahead(self, rank: int) -> bool:
        """Whether requests of this class or a higher one wait."""
        return self.count > 0 and any(self.classes[r] for r in range(rank + 1))

    def evict(self, rank: int) -> _Waiter | None:
        """The newest waiter of the lowest class below ``rank`` (from the key with the most waiting), taken out."""
        for lower in range(len(self.classes) - 1, rank, -1):
            keys = self.classes[lower]
            if keys:
                key_id = max(keys, key=lambda k: len(keys[k]))
                waiter = keys[key_id].pop()
                self.count -= 1
                if not keys[key_id]:
                    del keys[key_id]
                return waiter
        return None

    def first_rank(self) -> int | None:
        for rank, keys in enumerate(self.classes):
            if keys:
                return rank
        return None

    def pop(self, rank: int) -> _Waiter:
        """The next waiter of a class: the first key's oldest, that key then going to the back."""
        keys = self.classes[rank]
        key_id, queue = next(iter(keys.items()))
        waiter = queue.popleft()
        self.count -= 1
        if queue:
            keys.move_to_end(key_id)
        else:
            del keys[key_id]
        return waiter


class GatewayQueue:
    def __init__(self, settings: QueueSettings) -> None:
        self.settings = settings
        self.models: dict[str, _ModelQueue] = {}
        self.capacity: dict[str, int] = {}  # model -> each replica's batch limit

    # --- room ----------------------------------------------------------------------------

    def _room(self, gw, model: str, rank: int) -> int:
        """Free slots on the model's ready replicas for a request of this class."""
        routes = gw.table.by_model.get(model)
        if not routes:
            return 1  # nothing to wait for here: forwarding answers it (no replica) at once
        capacity = self.capacity.get(model, DEFAULT_MAX_NUM_SEQS) + self.settings.engine_queue
        if rank == PRIORITY_RANK[Priority.BATCH]:
            capacity = max(1, math.floor(capacity * (1 - self.settings.batch_headroom)))
        free = 0
        engine_queue = self.settings.engine_queue
        for route in routes:
            load = route._inflight
            reading = route.engine
            if reading is not None and reading.fresh:
                waiting = reading.waiting or 0
                if waiting > engine_queue:
                    continue  # the engine queues more than allowed: full
                load += others_share(reading.running, waiting, reading.own_at_read)
            if load < capacity:
                free += capacity - load
        queue = self.models.get(model)
        return free - (queue.granted if queue is not None else 0)

    # --- the way in -------------------------------------------------------------------------

    async def enter(self, gw, model: str, key_id: int, priority: str) -> bool:
        """Return once the request may go to a replica: False at once (nothing waited), True after a wait;
        Refusal when the queue is full or the wait too long."""
        rank = PRIORITY_RANK.get(priority, 1)
        queue = self.models.get(model)
        # No one of this class or above waits and there is room: go (a batch queue never delays a chat).
        if (queue is None or not queue.ahead(rank)) and self._room(gw, model, rank) > 0:
            return False
        if queue is None:
            queue = self.models[model] = _ModelQueue()
        settings = self.settings
        if queue.count >= settings.most:
            # Full: a request of a higher class takes the place of the newest of the lowest class waiting.
            evicted = queue.evict(rank)
            refusal = Refusal(429, ErrorKind.QUEUE_FULL, f"Model `{model}` is at capacity on every replica and "
                              f"{settings.most} request(s) already wait for it here; retry shortly.",
                              retry_after=max(1, math.ceil(min(settings.wait, 5))))
            if evicted is None:
                QUEUED.labels(model, priority, "full").inc()
                raise refusal
            QUEUED.labels(model, _CLASS_NAMES[evicted.rank], "full").inc()
            if not evicted.future.done():  # (a waiter whose client left this turn has a cancelled one)
                evicted.future.set_exception(refusal)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), key_id, rank)
        queue.push(waiter)
        if queue.door is None or queue.door.done():
            queue.door = loop.create_task(self._door(gw, model), name=f"gateway-queue-{model}")
        self.dispatch(gw, model)
        try:
            async with asyncio.timeout(settings.wait):
                await waiter.future
        except TimeoutError:
            if waiter.granted:
                # Woken in the very turn its wait ran out: the slot is this request's; go.
                queue.granted -= 1
                QUEUED.labels(model, priority, "served").inc()
                return True
            queue.remove(waiter)
            QUEUED.labels(model, priority, "timeout").inc()
            raise Refusal(503, ErrorKind.QUEUE_FULL, f"Model `{model}` stayed at capacity on every replica for "
                          f"{settings.wait:g}s while this request waited; retry later.",
                          retry_after=max(1, math.ceil(min(settings.wait, 10)))) from None
        except asyncio.CancelledError:
            if waiter.granted:
                queue.granted -= 1  # woken but gone: its slot goes to the next
                self.dispatch(gw, model)
            else:
                queue.remove(waiter)
            raise
        queue.granted -= 1
        QUEUED.labels(model, priority, "served").inc()
        return True

    # --- the way out -------------------------------------------------------------------------

    def dispatch(self, gw, model: str) -> None:
        """Wake as many waiters, in order, as there are free slots for them."""
        queue = self.models.get(model)
        if queue is None or not queue.count:
            return
        while queue.count:
            rank = queue.first_rank()
            if self._room(gw, model, rank) <= 0:
                # A class that finds no room holds back the classes after it: batch never overtakes.
                return
            waiter = queue.pop(rank)
            if waiter.future.done():
                continue
            queue.granted += 1
            waiter.granted = True
            waiter.future.set_result(True)

    async def _door(self, gw, model: str) -> None:
        queue = self.models[model]
        while queue.count:
            await asyncio.sleep(POLL)
            self.dispatch(gw, model)

    def waiting(self) -> dict[str, int]:
        return {model: queue.count for model, queue in self.models.items() if queue.count}
