"""The cache-aware prefix memory shared between gateway processes, in Redis.

Each process routes on its own ``PrefixMemory`` (gateway.prefix), in memory,
and nothing on a request's path waits for Redis. What a process records is
also put in an outbox; a background task of the process, every
``LLMGW_ROUTING_SHARE_INTERVAL``, on a thread of its own:

- writes the outbox in one pipeline: per (model, replica) a sorted set of
  block hashes whose score is when they were last sent there (a prompt's
  first block the newest, as the local memory touches them), trimmed to the
  replica's cache in blocks (the newest kept) and expiring a while after its
  last write (a replica gone is forgotten);
- reads back, in one pipeline, what every process wrote since its last read
  for the replicas of its cache-aware models, and the event loop touches
  those blocks in its own memory in the order they were sent.

So two processes that alternate a group's requests see each other's
placements within about one interval (a request sent in between may still
land elsewhere: the views are approximate, as they are between the engines
and any one process). A process's own writes come back too and are touched
again, which changes nothing but their order by a few microseconds.

SGLang's router keeps one tree per router process; llm-d's precise scorer
reads the engines' KV events into a shared index. This is the approximate
scorer's memory made common, at one pipelined write and one read per
interval per process, whatever the request rate.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

KEY = "llmgw:gateway:prefix:{model}:{replica}"
# A replica's set lives this long after its last write.
TTL_SECONDS = 600
# Scores: milliseconds since this epoch x SLOTS, plus the block's rank in one
# flush, exact in a double for centuries.
EPOCH = 1_700_000_000.0
SLOTS = 100_000
# Each read also takes back this much before the last score it saw: a
# process whose flush began earlier may commit after another's read.
OVERLAP_MS = 500
# At most this many prompts wait in the outbox (the oldest go first: the
# newer placements matter more), so a Redis outage costs memory it bounds.
OUTBOX_MAX = 10_000


@dataclass(frozen=True, slots=True)
class Sent:
    model: str
    replica_id: int
    blocks: tuple[int, ...]
    capacity: int


def key(model: str, replica_id: int) -> str:
    return KEY.format(model=model, replica=replica_id)


class PrefixShare:
    """The outbox and the read positions of one process. ``note`` is called
    on the event loop; ``flush`` and ``read`` on the share thread."""

    def __init__(self, client) -> None:
        self.client = client
        self.outbox: list[Sent] = []
        self.last_score: dict[str, float] = {}  # key -> highest score read
        self.written = 0
        self.read_blocks = 0

    def note(self, model: str, replica_id: int, blocks: tuple[int, ...], capacity: int) -> None:
        outbox = self.outbox
        outbox.append(Sent(model, replica_id, blocks, capacity))
        if len(outbox) > OUTBOX_MAX:
            del outbox[:len(outbox) - OUTBOX_MAX]

    def flush(self) -> int:
        """Write what was noted since the last flush; the number of blocks written."""
        sent, self.outbox = self.outbox, []  # one swap: the loop appends to the new list
        if not sent:
            return 0
        base = int((time.time() - EPOCH) * 1000) * SLOTS
        pipe = self.client.pipeline(transaction=False)
        capacity: dict[str, int] = {}
        rank = 0
        for item in sent:
            name = key(item.model, item.replica_id)
            mapping = {}
            # Touched last block first: the first block gets the highest score.
            for block in reversed(item.blocks):
                rank += 1
                mapping[str(block)] = base + min(rank, SLOTS - 1)
            pipe.zadd(name, mapping)
            capacity[name] = item.capacity
        for name, most in capacity.items():
            pipe.zremrangebyrank(name, 0, -most - 1)
            pipe.expire(name, TTL_SECONDS)
        pipe.execute()
        self.written += rank
        return rank

    def read(self, wanted: list[tuple[str, int]]) -> list[tuple[str, int, tuple[int, ...]]]:
        """What was written for each (model, replica) since the last read:
        (model, replica, blocks oldest first), for the loop to touch in that order."""
        if not wanted:
            return []
        pipe = self.client.pipeline(transaction=False)
        names = []
        for model, replica_id in wanted:
            name = key(model, replica_id)
            names.append(name)
            since = self.last_score.get(name)
            low = "-inf" if since is None else f"({since - OVERLAP_MS * SLOTS}"
            pipe.zrangebyscore(name, low, "+inf", withscores=True)
        found = []
        for (model, replica_id), name, entries in zip(wanted, names, pipe.execute()):
            if not entries:
                continue
            self.last_score[name] = max(self.last_score.get(name, 0.0), entries[-1][1])
            blocks = tuple(int(member) for member, _ in entries)
            self.read_blocks += len(blocks)
            found.append((model, replica_id, blocks))
        for name in set(self.last_score) - set(names):
            del self.last_score[name]
        return found
