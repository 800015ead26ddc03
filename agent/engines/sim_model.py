"""The simulated engine's performance model: a batch limit, a prefix KV cache
and the time each request takes, as plain arithmetic over a clock.

What it models, as vLLM does it (its V1 scheduler with prefix caching):

- At most ``max_num_seqs`` requests run at once; the others wait in a FIFO
  queue. The head of the queue is admitted when a slot is free and the KV
  cache can hold the request's blocks; nothing behind it jumps the queue.
- The KV cache holds ``num_gpu_blocks`` blocks of ``block_size`` tokens. A
  full block of a prompt is known by the hash of its tokens chained with the
  hash of the block before it, so the same text gives the same blocks and a
  block stands for the whole prefix up to it. A request admitted takes the
  longest run of its leading blocks already cached (sharing them with every
  request that holds them), and fresh blocks for the rest of its prompt and
  for its output. Once its prompt is computed, its full prompt blocks become
  cached. A finished request releases its blocks; cached blocks nobody holds
  stay cached, and are evicted least recently used first (the last blocks of
  a prompt before its first ones, as vLLM's free queue does) when fresh
  blocks are needed. As in vLLM, the last prompt token is always computed: a
  prompt entirely cached still counts its last block as a miss.
- Prefill is one lane per engine: a request's uncached prompt tokens take
  ``prefill_time_per_token`` each, after the prefills admitted before it. Its
  time to first token is the queue wait + the wait for the lane + its own
  prefill + ``prefill_overhead``. Each later token takes one decode step of
  ``decode_step_base + decode_step_per_seq x running``.

Nothing here sleeps or draws a random number: ``SimEngine`` is driven by the
times its caller passes (the HTTP layer passes the monotonic clock and does
the sleeping), so tests replay it exactly.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence

# An 8B model (Llama-3.1-8B, bf16) on one 80 GB GPU: 128 KiB of KV per token;
# 0.9 x 80 GB less 16 GB of weights and some activations leaves ~52 GB, about
# 400,000 tokens: 25,000 blocks of 16.
DEFAULT_NUM_GPU_BLOCKS = 25_000


@dataclass(frozen=True)
class SimParams:
    max_num_seqs: int = 256
    block_size: int = 16
    num_gpu_blocks: int = DEFAULT_NUM_GPU_BLOCKS
    max_model_len: int = 32_768
    enable_prefix_caching: bool = True
    prefill_overhead: float = 0.015  # seconds per request, outside the prefill lane
    prefill_time_per_token: float = 0.0001  # seconds per uncached prompt token (10,000 tokens/s)
    decode_step_base: float = 0.010  # seconds per decode step with one request running
    decode_step_per_seq: float = 0.0001  # seconds added to each step per running request

    def problems(self) -> list[str]:
        """What makes these parameters unusable, as messages naming the flag."""
        found = []
        for name in ("max_num_seqs", "block_size", "num_gpu_blocks", "max_model_len"):
            if getattr(self, name) < 1:
                found.append(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("prefill_overhead", "prefill_time_per_token", "decode_step_base", "decode_step_per_seq"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                found.append(f"--{name.replace('_', '-')} must be a finite number of seconds >= 0")
        if not found and self.num_gpu_blocks * self.block_size < self.max_model_len:
            found.append(
                f"--max-model-len {self.max_model_len} is more than the KV cache holds "
                f"({self.num_gpu_blocks} blocks x {self.block_size} tokens = {self.num_gpu_blocks * self.block_size}); "
                "lower --max-model-len or raise --num-gpu-blocks-override"
            )
        return found

    def decode_step(self, running: int) -> float:
        return self.decode_step_base + self.decode_step_per_seq * running


def block_hashes(tokens: Sequence[str], block_size: int) -> list[bytes]:
    """The chained hashes of the full blocks of ``tokens`` (a partial last block has none)."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update("\0".join(tokens[start:start + block_size]).encode())
        parent = digest.digest()
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Blocks by content hash with reference counts, an LRU of the unreferenced
    ones, and a count of private blocks (partial, output, not yet computed)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.refs: dict[bytes, int] = {}  # every cached block -> requests holding it
        self.free: OrderedDict[bytes, None] = OrderedDict()  # cached, unreferenced; first = evicted first
        self.private = 0
        self.evictions = 0

    @property
    def used(self) -> int:
        """Blocks some request holds (vLLM's KV-cache usage counts these)."""
        return self.private + len(self.refs) - len(self.free)

    def usage(self) -> float:
        return self.used / self.capacity

    def hit_length(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.refs:
                break
            n += 1
        return n

    def can_take(self, hit: Sequence[bytes], fresh: int) -> bool:
        """Whether ``fresh`` new blocks fit besides the ``hit`` blocks taken from the cache."""
        revived = sum(1 for h in hit if h in self.free)  # free now, held once taken
        return fresh <= self.capacity - self.used - revived

    def take(self, hit: Sequence[bytes], fresh: int) -> None:
        for h in hit:
            self._hold(h)
        overflow = self.private + fresh + len(self.refs) - self.capacity
        for _ in range(max(0, overflow)):
            evicted, _ = self.free.popitem(last=False)
            del self.refs[evicted]
            self.evictions += 1
        self.private += fresh

    def publish(self, hashes: Sequence[bytes]) -> None:
        """Private blocks just computed become cached (or share the copy
        another request cached meanwhile, releasing theirs)."""
        for h in hashes:
            if h in self.refs:
                self._hold(h)
            else:
                self.refs[h] = 1
            self.private -= 1

    def release(self, hashes: Sequence[bytes], private: int) -> None:
        for h in reversed(hashes):  # the tail of a prompt is evicted before its head
            self.refs[h] -= 1
            if self.refs[h] == 0:
                self.free[h] = None
        self.private -= private

    def _hold(self, h: bytes) -> None:
        if self.refs[h] == 0:
            del self.free[h]
        self.refs[h] += 1


class RequestTooLarge(ValueError):
    pass


@dataclass(eq=False)
class Ticket:
    """One request through the engine; times are the caller's clock."""

    arrival: float
    prompt_tokens: int
    output_tokens: int
    hashes: list[bytes]  # its full prompt blocks
    blocks: int  # what it holds while running: prompt and output
    cached_tokens: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    held: list[bytes] = field(default_factory=list)  # cached blocks it holds
    private: int = 0
    computed: bool = False
    finished: bool = False
    admitted: threading.Event = field(default_factory=threading.Event)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def queue_time(self) -> float | None:
        return None if self.admitted_at is None else self.admitted_at - self.arrival


class SimEngine:
    """The scheduler and its counters. Thread-safe: every method takes the lock."""

    def __init__(self, params: SimParams) -> None:
        problems = params.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.params = params
        self.cache = PrefixCache(params.num_gpu_blocks)
        self.waiting: deque[Ticket] = deque()
        self.running = 0
        self.prefill_free_at = 0.0
        self.lock = threading.Lock()
        # vLLM's counters, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_total = 0

    # -- what the HTTP layer calls --------------------------------------------------

    def submit(self, tokens: Sequence[str], output_tokens: int, now: float) -> Ticket:
        """Queue a request; it may be admitted at once (``ticket.admitted`` is set)."""
        p = self.params
        blocks = -(-(len(tokens) + output_tokens) // p.block_size)
        if blocks > p.num_gpu_blocks:
            raise RequestTooLarge(
                f"the request needs {blocks} KV blocks ({len(tokens)} prompt + {output_tokens} output tokens) "
                f"and the cache holds {p.num_gpu_blocks}"
            )
        hashes = block_hashes(tokens, p.block_size) if p.enable_prefix_caching else []
        ticket = Ticket(arrival=now, prompt_tokens=len(tokens), output_tokens=output_tokens, hashes=hashes,
                        blocks=blocks)
        with self.lock:
            self.waiting.append(ticket)
            self._schedule(now)
        return ticket

    def computed(self, ticket: Ticket) -> None:
        """The request's prompt is computed (its first token is out): its blocks become cached."""
        with self.lock:
            if ticket.computed or ticket.admitted_at is None:
                return
            ticket.computed = True
            fresh = ticket.hashes[len(ticket.held):]
            self.cache.publish(fresh)
            ticket.held.extend(fresh)
            ticket.private -= len(fresh)

    def finish(self, ticket: Ticket, now: float, generated: int | None = None, ok: bool = True) -> None:
        """The request is done, or aborted (``ok`` false: its client went away):
        release it and admit who can run."""
        with self.lock:
            if ticket.finished:
                return
            ticket.finished = True
            if ticket.admitted_at is None:
                self.waiting.remove(ticket)
                return
            self.cache.release(ticket.held, ticket.private)
            ticket.held, ticket.private = [], 0
            self.running -= 1
            self.finished_total += ok
            self.generation_tokens_total += ticket.output_tokens if generated is None else generated
            self._schedule(now)

    def decode_step(self) -> float:
        return self.params.decode_step(self.running)

    def snapshot(self, now: float | None = None) -> dict[str, float]:
        """The counters and gauges; with ``now``, also ``prefill_backlog``:
        the prompt tokens still to prefill, those of the admitted requests
        the lane has not reached or finished and those of the waiting ones
        (less what the cache would give them if they were admitted now)."""
        with self.lock:
            state = {
                "running": self.running,
                "waiting": len(self.waiting),
                "kv_cache_usage": self.cache.usage(),
                "prefix_queries": self.prefix_queries,
                "prefix_hits": self.prefix_hits,
                "prompt_tokens": self.prompt_tokens_total,
                "generation_tokens": self.generation_tokens_total,
                "finished": self.finished_total,
                "evictions": self.cache.evictions,
            }
            if now is not None:
                state["prefill_backlog"] = self._prefill_backlog(now)
            return state

    def _prefill_backlog(self, now: float) -> int:
        p = self.params
        lane = 0
        if p.prefill_time_per_token > 0:
            lane = round(max(0.0, self.prefill_free_at - now) / p.prefill_time_per_token)
        return lane + sum(t.prompt_tokens - len(self._hit(t)) * p.block_size for t in self.waiting)

    def _hit(self, ticket: Ticket) -> list[bytes]:
        """The ticket's leading prompt blocks the cache holds now (the last token is always computed)."""
        reusable = ticket.hashes[:(ticket.prompt_tokens - 1) // self.params.block_size]
        return reusable[:self.cache.hit_length(reusable)]

    # -- the scheduler ----------------------------------------------------------------

    def _schedule(self, now: float) -> None:
        p = self.params
        while self.waiting and self.running < p.max_num_seqs:
            ticket = self.waiting[0]
            hit = self._hit(ticket)
            fresh = ticket.blocks - len(hit)
            if not self.cache.can_take(hit, fresh):
                return  # first come, first served: nobody overtakes the head
            self.waiting.popleft()
            self.cache.take(hit, fresh)
            ticket.held, ticket.private = list(hit), fresh
            ticket.cached_tokens = len(hit) * p.block_size
            uncached = ticket.prompt_tokens - ticket.cached_tokens
            start = max(now, self.prefill_free_at)
            self.prefill_free_at = start + uncached * p.prefill_time_per_token
            ticket.admitted_at = now
            ticket.first_token_at = self.prefill_free_at + p.prefill_overhead
            self.running += 1
            self.prefix_queries += ticket.prompt_tokens
            self.prefix_hits += ticket.cached_tokens
            self.prompt_tokens_total += ticket.prompt_tokens
            ticket.admitted.set()
