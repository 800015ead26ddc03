"""The gateway's queue: when every ready replica of a model is at capacity,
requests wait here instead of piling onto the engines.

A replica's capacity is its engine's batch limit (``--max-num-seqs`` in the
catalog entry's args, vLLM's default otherwise) plus the engine queue allowed
(``LLMGW_GATEWAY_ENGINE_QUEUE``); its load is this process's requests in
flight on it now, which is exact, plus the other gateway processes'. Batch
keys fill a replica only up to ``1 - LLMGW_GATEWAY_BATCH_HEADROOM`` of its
capacity (its batch share): the rest is kept for interactive and standard
keys, so that a batch flood never makes them wait.

The other processes are counted from the records every process writes on
each sync (``LLMGW_GATEWAY_SYNC_INTERVAL``, 0.2 s), in one Redis round trip
that also reads theirs back (gateway.inflight.EXCHANGE; nothing per
request). That round trip divides each replica's batch share between the
processes: each gets a ceiling, the most requests it may have there while it
admits batch ones, from the slots the others neither use nor hold, and never
more than an even share while another one wants more. The ceilings in force
never add up past the share, so two processes cannot both let batch waiters
into the same freed slots. Counting the others' in-flight counts alone did
not do that: each process's own count is fresh and the others' a sync old,
so after a burst both took the same free slots (measured: 23 requests on an
engine of 20). Interactive and standard requests see every slot that the
others neither use nor hold.

Without Redis, or while no exchange has answered for ``OTHERS_FOR``, the
others' part is taken from the engine's last reading instead (its running
and waiting less what this process had there when it was read, as routing
counts it), up to a scrape interval (1 s) old: enough for one process, which
is what the embedded default runs; through two, both processes let batch
waiters in at once and overfilled the engine (interactive TTFT p90 5-79x its
unloaded value at twice the batch share). The engine's whole running count
is never taken as the load: stale by the time a slot frees, it made requests
wait for the next reading (38x through one process).

A replica whose engine last said it queues more than
``LLMGW_GATEWAY_ENGINE_QUEUE`` takes no more batch requests until a reading
says otherwise. That queue comes from load the counts miss (clients that
bypass the gateway, an engine that runs fewer than its batch limit because
its KV cache is full); batch requests would only lengthen it. Interactive and
standard requests still go: the counts bound them to the capacity, and held
here they would wait for the next reading (a second) to learn that the
engine's queue has drained, where in the engine they wait only for the few
requests ahead of them. (Applied to every class, the rule kept interactive
requests here for seconds while long batch streams drained an overfilled
engine.)

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
import time
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
OTHERS_FOR = 1.0  # seconds an exchange's answer (ceilings, the others' counts) is counted on
_BATCH = PRIORITY_RANK[Priority.BATCH]
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

    def batch_waiting(self) -> int:
        return sum(map(len, self.classes[_BATCH].values()))

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
        # The last exchange's answer (Redis only: ``wants``, ``shares``, gateway.inflight.EXCHANGE).
        self.held: dict[int, int] = {}  # replica id -> their requests there, or the batch slots they hold if more
        self.ceilings: dict[int, int] = {}  # replica id -> the most this process may have there to admit batch
        self.others_until = 0.0  # monotonic: counted on until then, the engines' readings after
        # Called when a batch request waits on this process's ceiling alone (one set while it wanted less, which
        # an exchange would raise): the runtime exchanges soon instead of at its next sync (gateway.runtime).
        self.nudge = None

    # --- room ----------------------------------------------------------------------------

    def wants(self, table, inflight: dict[int, int]) -> dict[int, tuple[int, int, int]]:
        """Before an exchange (gateway.inflight.EXCHANGE), for each ready replica: its batch share, this process's
        requests there (in flight, and its waiters woken for the model but not yet sent) and the requests it
        would have there (those and its batch waiters). Until the answer, batch keeps to what this process has
        now: a ceiling the exchange lowers is the others' to take as soon as it is written."""
        wants = {}
        for model, routes in table.by_model.items():
            queue = self.models.get(model)
            granted = queue.granted if queue is not None else 0
            demand = queue.batch_waiting() if queue is not None else 0
            share = self._batch_share(model)
            for route in routes:
                own = inflight.get(route.replica_id, 0) + granted
                wants[route.replica_id] = (share, own, own + demand)
        self.ceilings = {replica_id: min(ceiling, wants[replica_id][1]) if replica_id in wants else 0
                         for replica_id, ceiling in self.ceilings.items()}
        return wants

    def shares(self, shares) -> None:
        """An exchange's answer (gateway.inflight.Shares)."""
        self.ceilings, self.held = shares.ceilings, shares.held
        self.others_until = time.monotonic() + OTHERS_FOR

    def _batch_share(self, model: str) -> int:
        capacity = self.capacity.get(model, DEFAULT_MAX_NUM_SEQS) + self.settings.engine_queue
        return max(1, math.floor(capacity * (1 - self.settings.batch_headroom)))

    def _room(self, gw, model: str, rank: int) -> int:
        """Free slots on the model's ready replicas for a request of this class."""
        routes = gw.table.by_model.get(model)
        if not routes:
            return 1  # nothing to wait for here: forwarding answers it (no replica) at once
        batch = rank == _BATCH
        if batch:
            capacity = self._batch_share(model)
        else:
            capacity = self.capacity.get(model, DEFAULT_MAX_NUM_SEQS) + self.settings.engine_queue
        engine_queue = self.settings.engine_queue
        recorded = time.monotonic() < self.others_until
        free = 0
        for route in routes:
            own = route._inflight
            reading = route.engine
            fresh = reading is not None and reading.fresh
            if batch and fresh and (reading.waiting or 0) > engine_queue:
                continue  # the engine queues more than allowed: no more batch there
            ceiling = self.ceilings.get(route.replica_id) if batch and recorded else None
            if ceiling is not None:
                room = ceiling - own
            elif recorded and not batch:
                room = capacity - own - self.held.get(route.replica_id, 0)
            else:
                room = capacity - own
                if fresh:
                    room -= others_share(reading.running, reading.waiting or 0, reading.own_at_read)
            if room > 0:
                free += room
        queue = self.models.get(model)
        return free - (queue.granted if queue is not None else 0)

    def _ceiling_bound(self, gw, model: str) -> bool:
        """Whether an exchange would give this process more batch room on a ready replica of the model: its
        ceiling there (set when it wanted less: an idle process's is 0) is below both what it now wants (its
        requests there and its batch waiters) and the share the others leave."""
        if time.monotonic() >= self.others_until:
            return False  # no ceilings in force: the engines' readings count
        queue = self.models.get(model)
        demand = queue.batch_waiting() + queue.granted if queue is not None else 0
        share = self._batch_share(model)
        for route in gw.table.by_model.get(model, ()):
            ceiling = self.ceilings.get(route.replica_id)
            if ceiling is not None and ceiling < min(route._inflight + demand,
                                                     share - self.held.get(route.replica_id, 0)):
                return True
        return False

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
        if rank == _BATCH and not waiter.granted and self.nudge is not None and self._ceiling_bound(gw, model):
            self.nudge()
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
