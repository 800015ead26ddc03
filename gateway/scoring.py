"""Which ready replica gets a request: pure functions over plain values.

``Candidate`` is what the gateway knows of one replica at the moment of the
decision: its own requests in flight there, the engine's last readings
(requests running and waiting, KV-cache use; None when unread), how many of
the prompt's prefix blocks the gateway believes the replica holds, and
whether it refused a connection lately. The policies:

- ``least_outstanding``: the fewest requests in flight (today's).
- ``cache_aware``: over the replicas that are not overloaded (SGLang's
  imbalance guard: a replica whose load exceeds the least loaded one's by
  more than ``balance_abs`` requests *and* by a factor ``balance_rel`` is
  not a candidate for its cache), the lowest cost as Dynamo's KV router
  weighs it when every candidate's engine reports its prefill backlog:
  ``prefill_weight x (backlog + the prompt tokens it would prefill there) +
  decode_weight x KV tokens in use``; else llm-d's weighted sum (prefix 3,
  queue 2, KV use 2). No prefix held anywhere: the least loaded.
- ``session``: rendezvous hashing of the session key over the replicas;
  the session's heaviest replica unless it is down or overloaded, then the
  next heaviest.

Each returns the index of the chosen candidate and a reason (``prefix``,
``load``, ``guard``, ``session``, ``rehome``) for the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from .prefix import session_weight


@dataclass(frozen=True)
class Knobs:
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0
    # A replica is overloaded when its load exceeds the least loaded one's by
    # more than balance_abs requests and by more than a factor balance_rel.
    balance_abs: int = 8
    balance_rel: float = 1.5
    # Dynamo's cost (used when every candidate's prefill backlog is known;
    # prefill_weight 0: never): its overlap_score_weight, 1 by default, on
    # the prompt tokens a replica has to prefill, and a weight on the KV
    # tokens its running requests hold.
    prefill_weight: float = 1.0
    decode_weight: float = 0.1


DEFAULT_KNOBS = Knobs()


@dataclass(slots=True)
class Candidate:
    replica_id: int
    inflight: int = 0
    running: int | None = None
    waiting: int | None = None
    kv_use: float | None = None
    matched: int = 0
    down: bool = False
    # This gateway's requests in flight there when the engine was read.
    own_at_read: int = 0
    # Prompt tokens waiting for prefill there (the engine's reading plus what
    # this gateway sent since), None when its engine does not say; the
    # prompt tokens this request would prefill there; its cache in tokens.
    backlog: int | None = None
    uncached: float = 0.0
    cache_tokens: int = 0
    # Prefix blocks the gateway remembers there: among equally loaded
    # replicas a new prefix goes where the memory is smallest (SGLang's
    # router sends a miss to the smallest tree), not always to the lowest id.
    remembered: int = 0

    @property
    def load(self) -> int:
        """Requests on the replica: this gateway's own now (exact, fresh),
        plus the others' as the engine's last reading counted them (its
        running + waiting less what this gateway had there then). A reading
        is a second old: counting it whole would send every request to
        whichever replica looked idle a second ago."""
        if self.running is None and self.waiting is None:
            return self.inflight
        return self.inflight + max(0, (self.running or 0) + (self.waiting or 0) - self.own_at_read)


def overloaded(load: int, least: int, knobs: Knobs) -> bool:
    return load - least > knobs.balance_abs and load > least * knobs.balance_rel


def _usable(candidates: list[Candidate]) -> list[int]:
    """Indices of the replicas not marked down (all of them when every one is)."""
    up = [i for i, c in enumerate(candidates) if not c.down]
    return up or list(range(len(candidates)))


def least_loaded(candidates: list[Candidate], among: list[int] | None = None) -> int:
    """The index with the least load, then the least KV use, then the fewest
    remembered blocks, then the lowest replica id (deterministic)."""
    among = _usable(candidates) if among is None else among
    return min(among, key=lambda i: (candidates[i].load, candidates[i].kv_use or 0.0, candidates[i].remembered,
                                     candidates[i].replica_id))


def cache_aware(candidates: list[Candidate], blocks: int, knobs: Knobs = DEFAULT_KNOBS) -> tuple[int, str]:
    """Index and reason: ``prefix`` when the chosen replica holds the longest
    prefix any replica holds, ``guard`` when a longer holder was passed over
    for being overloaded, ``load`` otherwise (no prefix held, or it lost on load)."""
    usable = _usable(candidates)
    loads = [candidates[i].load for i in usable]
    least, most = min(loads), max(loads)
    fit = [i for i, load in zip(usable, loads) if not overloaded(load, least, knobs)]
    best_match = max(candidates[i].matched for i in usable)
    if best_match == 0 or blocks <= 0:
        return least_loaded(candidates, usable), "load"
    if knobs.prefill_weight > 0 and all(candidates[i].backlog is not None for i in fit):
        best = min(fit, key=lambda i: (prefill_cost(candidates[i], knobs), candidates[i].load,
                                       candidates[i].replica_id))
    else:
        spread = most - least
        best, best_score = fit[0], None
        for i in fit:
            c = candidates[i]
            queue = 1.0 if spread == 0 else 1.0 - (c.load - least) / spread
            kv = 1.0 - c.kv_use if c.kv_use is not None else 0.5
            score = (knobs.prefix_weight * c.matched / blocks + knobs.queue_weight * queue + knobs.kv_weight * kv,
                     -c.replica_id)
            if best_score is None or score > best_score:
                best, best_score = i, score
    if candidates[best].matched == best_match:
        return best, "prefix"
    if any(candidates[i].matched == best_match for i in usable if i not in fit):
        return best, "guard"
    return best, "load"


def prefill_cost(c: Candidate, knobs: Knobs) -> float:
    """Dynamo's ``overlap weight x prefill blocks + decode blocks``, in tokens."""
    decode = (c.kv_use or 0.0) * c.cache_tokens
    return knobs.prefill_weight * ((c.backlog or 0) + c.uncached) + knobs.decode_weight * decode


def session(candidates: list[Candidate], key: int, knobs: Knobs = DEFAULT_KNOBS,
            last: int | None = None) -> tuple[int, str]:
    """Index and reason: ``session`` on the session's home, ``rehome`` when
    the home is down or overloaded and the next heaviest fit one takes it.
    The home is ``last`` (where this gateway sent the session before) while
    it is there, up and not overloaded, so that a replica joining takes no
    running session; otherwise the session's heaviest replica."""
    usable = set(_usable(candidates))
    least = min(candidates[i].load for i in usable)
    if last is not None:
        for i, c in enumerate(candidates):
            if c.replica_id == last and i in usable and not c.down and not overloaded(c.load, least, knobs):
                return i, "session"
    order = sorted(range(len(candidates)), key=lambda i: session_weight(key, candidates[i].replica_id), reverse=True)
    for rank, i in enumerate(order):
        if i in usable and not overloaded(candidates[i].load, least, knobs):
            return i, "session" if rank == 0 and last is None else "rehome"
    return least_loaded(candidates), "rehome"
