"""Where each gateway process publishes what it is doing, so that a drain in
another process can wait until no request is in flight on a replica.

Every process writes one record a few times a second: the replicas in its
routing table and its requests in flight on each. A record older than
``STALE_AFTER`` belongs to a process that has gone. Production keeps the
records in one Redis hash; the embedded default, which has no Redis, in the
``GatewayProcess`` table.
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


class RedisInflight:
    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)

    def publish(self, *, name: str, routes: list[int], inflight: dict[int, int]) -> None:
        value = json.dumps({"at": time.time(), "routes": routes, "inflight": inflight})
        self.client.hset(HASH_KEY, name, value)

    def forget(self, name: str) -> None:
        self.client.hdel(HASH_KEY, name)

    def _read(self) -> tuple[list[ProcessRecord], list[bytes]]:
        """The readable records, and the names of the unreadable ones."""
        records, unreadable = [], []
        for name, raw in self.client.hgetall(HASH_KEY).items():
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
        return self.client.hdel(HASH_KEY, *gone) if gone else 0


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
