"""A gateway process's routing table: which replicas serve which model, and
how busy each is. Held in memory, replaced whole when the database changes;
only the event loop's thread touches it."""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from dataclasses import dataclass

from yarl import URL

from . import scoring
from .limits import Limits
from .metrics import INFLIGHT
from .prefix import PrefixMemory
from .selectors import RoutingSnapshot

LEAST_OUTSTANDING, CACHE_AWARE, SESSION = "least-outstanding", "cache-aware", "session"
# The sessions whose last replica this process remembers (to count re-homes).
SESSIONS_REMEMBERED = 65_536

# A replica that refused a connection gets no requests for this long (unless
# it is the model's last), since the database may take a minute to say that
# its node is gone.
EJECT_SECONDS = 5.0


class Route:
    """One ready replica's leader, with this process's requests in flight on it."""

    __slots__ = ("replica_id", "model", "_base_url", "label", "_inflight", "down_until", "_urls", "engine",
                 "sent_tokens", "prefilled_tokens", "host", "port", "_gauge")

    def __init__(self, replica_id: int, model: str, base_url: str) -> None:
        self.replica_id = replica_id
        self.model = model
        self.base_url = base_url
        self.label = str(replica_id)
        self._gauge = None
        self._inflight = 0
        self.down_until = 0.0
        # The engine's last /metrics reading (gateway.engineload.EngineReading), None until read.
        self.engine = None
        # Prompt tokens (estimated, uncached) this process sent here by cache-aware decisions, ever; and of
        # those, the ones no longer waiting for prefill: their request answered (a stream's first chunk, a
        # whole answer), failed or given up (gateway.proxy).
        self.sent_tokens = 0
        self.prefilled_tokens = 0

    @property
    def base_url(self) -> str:
        return self._base_url

    @base_url.setter
    def base_url(self, base_url: str) -> None:
        # The engine's host and port, for the gateway's client (gateway.upstream), parsed once.
        url = URL(base_url)
        self._base_url, self.host, self.port, self._urls = base_url, url.host, url.port, {}

    @property
    def inflight(self) -> int:
        return self._inflight

    @inflight.setter
    def inflight(self, count: int) -> None:
        # Written through to the metrics file, where the other web processes' scrapes read it (the gauge's
        # child looked up once: labels() costs more than the write).
        self._inflight = count
        gauge = self._gauge
        if gauge is None:
            gauge = self._gauge = INFLIGHT.labels(self.model, self.label)
        gauge.set(count)

    def url(self, path: str) -> URL:
        # Parsed once per route and path, not on every request.
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.base_url + path)
        return url

    def __repr__(self) -> str:
        return f"Route(replica={self.replica_id}, model={self.model}, {self.base_url}, inflight={self.inflight})"


@dataclass(frozen=True)
class Key:
    id: int
    name: str
    allowed_models: frozenset[str] | None
    # Tenancy (gateway/limits.py, gateway/queue.py): None: no limits / never expires.
    limits: Limits | None = None
    expires_at: float | None = None
    priority: str = "standard"

    def allows(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models


@dataclass(frozen=True, slots=True)
class Hints:
    """What a request says that a policy may route on: its prompt's prefix
    blocks (cache-aware) and its session key's hash (session)."""

    blocks: tuple[int, ...] = ()
    session: int | None = None
    chars: int = 0  # the length of the prompt text the blocks were cut from


NO_HINTS = Hints()


def key_of(row) -> Key:
    """The gateway's view of a key row (selectors.KeyRow)."""
    return Key(row.id, row.name, row.allowed_models, row.limits, row.expires_at, row.priority)


class RoutingTable:
    def __init__(self, knobs: scoring.Knobs = scoring.DEFAULT_KNOBS, *, block_chars: int = 512,
                 chars_per_token: float = 4.0, cache_tokens: int = 262_144) -> None:
        self.knobs = knobs
        self.block_chars = block_chars
        self.chars_per_token = chars_per_token
        # A replica's cache when its engine does not say (vllm:cache_config_info).
        self.cache_tokens = cache_tokens
        self.policies: dict[str, str] = {}
        self.memories: dict[str, PrefixMemory] = {}
        self.sessions: OrderedDict[tuple[str, int], int] = OrderedDict()
        # (model, reason) -> decisions, read by the metrics.
        self.decisions: dict[tuple[str, str], int] = {}
        self.catalog: dict[str, int] = {}
        self.by_model: dict[str, list[Route]] = {}
        self.keys: dict[str, Key] = {}
        # The prompt tokens the last pick counted into its replica's Route.sent_tokens (read by the caller in
        # the same turn: gateway.proxy counts them prefilled when the request is answered).
        self.last_sent = 0
        # Where recorded prefixes go for the other gateway processes (gateway.prefixshare.PrefixShare), if anywhere.
        self.share = None
        # Every route this process knows, including ones that left the table
        # while requests were still in flight on them.
        self.routes: dict[int, Route] = {}

    def apply(self, snapshot: RoutingSnapshot) -> None:
        by_model: dict[str, list[Route]] = {}
        current: dict[int, Route] = {}
        for row in snapshot.routes:
            route = self.routes.get(row.replica_id)
            if route is None:
                route = Route(row.replica_id, row.model, row.base_url)
            else:
                # The same object: requests in flight on it decrement its count.
                if route.base_url != row.base_url:
                    route.base_url = row.base_url
                if route.model != row.model:
                    route.model, route._gauge = row.model, None
            current[row.replica_id] = route
            by_model.setdefault(row.model, []).append(route)
        # Keep the departed routes that still carry requests, so that their
        # counts stay visible to a drain until those requests end.
        for replica_id, route in self.routes.items():
            if replica_id not in current and route.inflight > 0:
                current[replica_id] = route
        self.routes = current
        self.by_model = by_model
        self.catalog = dict(snapshot.catalog)
        self.policies = dict(snapshot.policies)
        routed = {row.replica_id for row in snapshot.routes}
        for model, memory in list(self.memories.items()):
            if self.policies.get(model) != CACHE_AWARE:
                del self.memories[model]
                continue
            for replica_id in memory.replicas():
                if replica_id not in routed:
                    memory.forget(replica_id)
        self.keys = {k.secret_hash: key_of(k) for k in snapshot.keys}

    def routed_ids(self) -> list[int]:
        return sorted(r.replica_id for routes in self.by_model.values() for r in routes)

    def inflight_counts(self) -> dict[int, int]:
        return {r.replica_id: r.inflight for r in self.routes.values() if r.inflight}

    def ready_models(self) -> list[str]:
        return sorted(self.by_model)

    def policy(self, model: str) -> str:
        return self.policies.get(model, LEAST_OUTSTANDING)

    def pick(self, model: str, exclude: Route | None = None, hints: Hints = NO_HINTS) -> Route | None:
        """The replica of ``model`` that its routing policy chooses, passing
        over one that refused a connection lately while another is there."""
        self.last_sent = 0
        routes = self.by_model.get(model)
        if not routes:
            return None
        if len(routes) == 1:
            route = routes[0]
            if route is exclude:
                return None
            if hints.blocks:
                self._remember(model, route, hints.blocks)
            return route
        policy = self.policies.get(model)
        if policy == CACHE_AWARE and hints.blocks:
            # (A prompt shorter than one block has no prefix to find: least-outstanding, ties at random.)
            return self._pick_scored(model, routes, exclude, hints, cache=True)
        if policy == SESSION and hints.session is not None:
            return self._pick_scored(model, routes, exclude, hints, cache=False)
        return self._least_outstanding(routes, exclude)

    def _pick_scored(self, model: str, routes: list[Route], exclude: Route | None, hints: Hints,
                     cache: bool) -> Route | None:
        now = time.monotonic()
        if exclude is not None:
            routes = [r for r in routes if r is not exclude]
            if not routes:
                return None
        memory = self.memories.get(model) if cache else None
        matches = memory.matches(hints.blocks, [r.replica_id for r in routes]) if memory and hints.blocks else {}
        if cache and not matches:
            # No replica holds any of it: this process's fewest in flight (with several
            # gateway processes, the engines' second-old counts made them all pick the
            # same replica: TTFT p90 1.5x least-outstanding's, in bench/routing_sim.py),
            # then the smallest memory (SGLang sends a miss to its smallest tree: new
            # prefixes spread evenly over the caches; at random, some replicas got twice
            # their share and thrashed), then at random.
            route = self._least_outstanding(routes, None, memory)
            self.last_sent = int(hints.chars / self.chars_per_token)
            route.sent_tokens += self.last_sent
            self._remember(model, route, hints.blocks)
            count = (model, "load")
            self.decisions[count] = self.decisions.get(count, 0) + 1
            return route
        candidates = []
        chars_per_token = self.chars_per_token
        for route in routes:
            reading = route.engine
            matched = matches.get(route.replica_id, 0)
            backlog = None
            cache_tokens = self.cache_tokens
            if reading is not None and reading.fresh:
                running, waiting, kv, own = reading.running, reading.waiting, reading.kv_use, reading.own_at_read
                if reading.backlog is not None:
                    # What this process sent there since the reading and is not yet answered.
                    backlog = max(0, reading.backlog + route.sent_tokens - reading.sent_at_read
                                  - (route.prefilled_tokens - reading.prefilled_at_read))
                cache_tokens = reading.cache_tokens or cache_tokens
            else:
                running = waiting = kv = None
                own = 0
            uncached = max(0, hints.chars - matched * self.block_chars) / chars_per_token if cache else 0.0
            candidates.append(scoring.Candidate(route.replica_id, route._inflight, running, waiting, kv,
                                                matched, route.down_until > now, own, backlog, uncached,
                                                cache_tokens, memory.size(route.replica_id) if memory else 0))
        if cache:
            index, reason = scoring.cache_aware(candidates, len(hints.blocks), self.knobs)
        else:
            index, reason = scoring.session(candidates, hints.session, self.knobs,
                                            last=self.sessions.get((model, hints.session)))
        route = routes[index]
        if cache:
            self.last_sent = int(candidates[index].uncached)
            route.sent_tokens += self.last_sent
            if hints.blocks:
                self._remember(model, route, hints.blocks)
        else:
            key = (model, hints.session)
            last = self.sessions.get(key)
            if last != route.replica_id:
                # A session seen before that lands elsewhere moved; a new one is at home.
                reason = "rehome" if last is not None else "session"
                self.sessions[key] = route.replica_id
                if len(self.sessions) > SESSIONS_REMEMBERED:
                    self.sessions.popitem(last=False)
            else:
                reason = "session"
                self.sessions.move_to_end(key)
        count = (model, reason)
        self.decisions[count] = self.decisions.get(count, 0) + 1
        return route

    def _remember(self, model: str, route: Route, blocks: tuple[int, ...]) -> None:
        if self.policies.get(model) != CACHE_AWARE:
            return
        memory = self.memories.get(model)
        if memory is None:
            memory = self.memories[model] = PrefixMemory()
        capacity = self._capacity(route)
        memory.record(route.replica_id, blocks, capacity)
        if self.share is not None:
            self.share.note(model, route.replica_id, blocks, capacity)

    def _capacity(self, route: Route) -> int:
        """The replica's cache in blocks of the prefix memory."""
        reading = route.engine
        tokens = reading.cache_tokens if reading is not None and reading.cache_tokens else self.cache_tokens
        return int(tokens * self.chars_per_token) // self.block_chars

    def shared_wanted(self) -> list[tuple[str, int]]:
        """The (model, replica) pairs whose shared prefix memory this process reads back."""
        return [(model, route.replica_id) for model, routes in self.by_model.items()
                if self.policies.get(model) == CACHE_AWARE and len(routes) > 1 for route in routes]

    def apply_shared(self, found: list[tuple[str, int, tuple[int, ...]]]) -> int:
        """Touch what other processes sent (blocks oldest first) in this process's memory; the blocks touched."""
        touched = 0
        for model, replica_id, blocks in found:
            route = self.routes.get(replica_id)
            if route is None or route.model != model or self.policies.get(model) != CACHE_AWARE:
                continue
            memory = self.memories.get(model)
            if memory is None:
                memory = self.memories[model] = PrefixMemory()
            memory.record(replica_id, blocks[::-1], self._capacity(route))  # record touches its last first
            touched += len(blocks)
        return touched

    def _least_outstanding(self, routes: list[Route], exclude: Route | None,
                           memory: PrefixMemory | None = None) -> Route | None:
        """The fewest requests in flight, then (with a memory) the fewest
        prefix blocks remembered there, ties broken at random."""
        now = time.monotonic()
        best: list[Route] = []
        best_score = None
        for route in routes:
            if route is exclude:
                continue
            score = (route.down_until > now, route.inflight, memory.size(route.replica_id) if memory else 0)
            if best_score is None or score < best_score:
                best, best_score = [route], score
            elif score == best_score:
                best.append(route)
        if not best:
            return None
        return best[0] if len(best) == 1 else random.choice(best)

    def mark_down(self, route: Route) -> None:
        route.down_until = time.monotonic() + EJECT_SECONDS
