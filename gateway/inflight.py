"""Where each gateway process publishes what it is doing, so that a drain in
another process can wait until no request is in flight on a replica.

Every process writes one record a few times a second: the replicas in its
routing table and its requests in flight on each. A record older than
``STALE_AFTER`` belongs to a process that has gone. Production keeps the
records in one Redis hash; the embedded default, which has no Redis, in the
``GatewayProcess`` table.

With Redis, the same round trip that writes a process's record reads the
others' back and divides each replica's batch share between the processes
(``RedisInflight.exchange``), for the gateway's queue (gateway.queue). The
table is not read that often: without Redis, the queue counts the others
from the engines' readings instead.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from dataclasses import dataclass
from functools import lru_cache

import redis
from django.conf import settings
from django.utils import timezone

from .models import GatewayProcess

HASH_KEY = "llmgw:gateway:processes"
STALE_AFTER = 3.0
# Records this old are deleted by the gateway's prune (gateway.services).
FORGET_AFTER = 60.0


@dataclass(frozen=True)
class ProcessRecord:
    name: str
    at: float
    routes: frozenset[int]
    inflight: dict[int, int]


@dataclass(frozen=True)
class Shares:
    """What one exchange gave a process (see ``EXCHANGE``)."""

    ceilings: dict[int, int]  # replica id -> most requests this process may have there while it admits batch ones
    held: dict[int, int]  # replica id -> the other live processes' requests there, or batch slots they hold if more


# The batch share of each replica is divided between the gateway processes
# atomically, here, on each one's sync. A process's ceiling on a replica
# (the most requests it may have there, of every class, while it admits a
# batch one) is its requests there plus its batch waiters, within the share
# less what the other live processes hold (the larger of their requests there
# and their ceilings, as their records say). While another process wants more
# than it holds, none gets a ceiling above an even share (rounded up). A
# ceiling may be below the requests a process has: it admits no batch request
# until they end below it, which gives the others their part, and the slot
# an interactive request leaves is not batch's to take. A process uses a
# ceiling once its record holds it, and keeps to the requests it has while the
# exchange is under way (gateway.queue), so the ceilings in force never add
# up past the share.
EXCHANGE = """
local name, now, stale = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local wants = cjson.decode(ARGV[5])
local held, hungry, live = {}, {}, 1  -- live: the processes, this one included
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= name then
    local ok, other = pcall(cjson.decode, all[i + 1])
    if ok and type(other) == 'table' and tonumber(other.at) and now - tonumber(other.at) <= stale then
      live = live + 1
      local inflight, holds, want = other.inflight or {}, other.held or {}, other.want or {}
      for id, n in pairs(inflight) do
        held[id] = (held[id] or 0) + math.max(n, holds[id] or 0)
      end
      for id, h in pairs(holds) do
        if inflight[id] == nil then held[id] = (held[id] or 0) + h end
      end
      for id, w in pairs(want) do
        if w > (holds[id] or 0) then hungry[id] = true end
      end
    end
  end
end
local ceilings, holds, want = {}, {}, {}
for id, w in pairs(wants) do
  local share, own, wanted = w[1], w[2], w[3]
  local ceiling = math.max(0, math.min(share - (held[id] or 0), wanted))
  if hungry[id] then ceiling = math.min(ceiling, math.ceil(share / live)) end
  ceilings[id] = ceiling
  -- Only what is not nothing goes into the record, so that an idle process's stays small.
  if math.max(ceiling, own) > 0 then holds[id] = math.max(ceiling, own) end
  if wanted > 0 then want[id] = wanted end
end
local record = string.sub(ARGV[4], 1, -2)
if next(holds) ~= nil then record = record .. ', "held": ' .. cjson.encode(holds) end
if next(want) ~= nil then record = record .. ', "want": ' .. cjson.encode(want) end
redis.call('HSET', KEYS[1], name, record .. '}')
return cjson.encode({ceilings = ceilings, held = held})
"""


class RedisInflight:
    def __init__(self, url: str, key: str = HASH_KEY) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self.key = key
        self._exchange = self.client.register_script(EXCHANGE)

    def publish(self, *, name: str, routes: list[int], inflight: dict[int, int]) -> None:
        self.client.hset(self.key, name, _value(routes, inflight))

    def exchange(self, *, name: str, routes: list[int], inflight: dict[int, int],
                 wants: dict[int, tuple[int, int, int]]) -> Shares:
        """Write this process's record, with the batch ceilings the other live processes' records leave it on
        each replica of ``wants`` (replica id -> (its batch share, this process's requests there, and the
        requests it would have there)), and read theirs: one script, so that no two processes reserve the same
        free slots."""
        found = json.loads(self._exchange(keys=[self.key], args=[
            name, time.time(), STALE_AFTER, _value(routes, inflight),
            json.dumps({replica_id: list(want) for replica_id, want in wants.items()})]))
        return Shares(ceilings={int(k): int(v) for k, v in (found["ceilings"] or {}).items()},
                      held={int(k): int(v) for k, v in (found["held"] or {}).items()})

    def forget(self, name: str) -> None:
        self.client.hdel(self.key, name)

    def _read(self) -> tuple[list[ProcessRecord], list[bytes]]:
        """The readable records, and the names of the unreadable ones."""
        records, unreadable = [], []
        for name, raw in self.client.hgetall(self.key).items():
            try:
                value = json.loads(raw)
                records.append(ProcessRecord(
                    name=name.decode(), at=float(value["at"]), routes=frozenset(value["routes"]),
                    inflight={int(k): int(v) for k, v in value["inflight"].items()},
                ))
            except (ValueError, KeyError, TypeError):
                unreadable.append(name)
        return records, unreadable

    def records(self) -> list[ProcessRecord]:
        return self._read()[0]

    def prune(self) -> int:
        records, gone = self._read()
        now = time.time()
        gone += [r.name for r in records if now - r.at > FORGET_AFTER]
        return self.client.hdel(self.key, *gone) if gone else 0


def _value(routes: list[int], inflight: dict[int, int]) -> str:
    return json.dumps({"at": time.time(), "routes": routes, "inflight": inflight})


class DatabaseInflight:
    def publish(self, *, name: str, routes: list[int], inflight: dict[int, int]) -> None:
        GatewayProcess.objects.update_or_create(
            name=name, defaults={"seen_at": timezone.now(), "routes": routes, "inflight": inflight}
        )

    def forget(self, name: str) -> None:
        GatewayProcess.objects.filter(name=name).delete()

    def prune(self) -> int:
        cutoff = timezone.now() - dt.timedelta(seconds=FORGET_AFTER)
        return GatewayProcess.objects.filter(seen_at__lt=cutoff).delete()[0]

    def records(self) -> list[ProcessRecord]:
        return [
            ProcessRecord(
                name=row.name, at=row.seen_at.timestamp(), routes=frozenset(row.routes),
                inflight={int(k): int(v) for k, v in row.inflight.items()},
            )
            for row in GatewayProcess.objects.all()
        ]


@lru_cache(maxsize=1)
def store() -> RedisInflight | DatabaseInflight:
    if settings.LLMGW_REDIS_URL:
        return RedisInflight(settings.LLMGW_REDIS_URL)
    return DatabaseInflight()


def live_records() -> list[ProcessRecord]:
    now = time.time()
    return [r for r in store().records() if now - r.at <= STALE_AFTER]
