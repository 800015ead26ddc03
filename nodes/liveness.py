"""Where the control plane keeps "when did we last hear from each node".

A heartbeat arrives from every node every few seconds; writing each one to
PostgreSQL costs more CPU than the rest of the request (a ceiling near 870/s on
two cores). In production liveness lives in Redis: one hash of last-seen
times, one hash of per-node generations that services bump when a node's
status or desired state changes, so the agent API can answer a heartbeat from
its own cache with a single Redis round trip.

The embedded default has no Redis: liveness is then the node row itself.
"""

from __future__ import annotations

import logging
import time
from datetime import timezone as dt_timezone
from functools import lru_cache

from django.conf import settings
from django.utils import timezone

logger = logging.getLogger(__name__)

SEEN_KEY = "llmgw:nodes:seen"
GENERATION_KEY = "llmgw:nodes:generation"
LISTENER_KEY = "llmgw:agent-api:alive"


class RedisLiveness:
    caches_nodes = True

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)

    def touch(self, node: str, at: float) -> int:
        """Record a heartbeat; return the node's generation."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(SEEN_KEY, node, repr(at))
        pipe.hget(GENERATION_KEY, node)
        _, generation = pipe.execute()
        return int(generation or 0)

    def seen(self, node: str) -> float | None:
        value = self.client.hget(SEEN_KEY, node)
        return float(value) if value else None

    def seen_all(self) -> dict[str, float]:
        return {k.decode(): float(v) for k, v in self.client.hgetall(SEEN_KEY).items()}

    def forget(self, node: str) -> None:
        self.client.hdel(SEEN_KEY, node)

    def bump(self, node: str) -> None:
        self.client.hincrby(GENERATION_KEY, node, 1)

    def mark_listener_alive(self, at: float) -> None:
        self.client.set(LISTENER_KEY, repr(at), ex=3600)

    def listener_alive_at(self) -> float | None:
        value = self.client.get(LISTENER_KEY)
        return float(value) if value else None


class DatabaseLiveness:
    """Embedded default: small clusters, one SQLite file, no cache to keep."""

    caches_nodes = False

    def touch(self, node: str, at: float) -> int:
        from .models import Node

        Node.objects.filter(name=node).update(last_heartbeat_at=_aware(at))
        return 0

    def seen(self, node: str) -> float | None:
        from .models import Node

        value = Node.objects.filter(name=node).values_list("last_heartbeat_at", flat=True).first()
        return value.timestamp() if value else None

    def seen_all(self) -> dict[str, float]:
        from .models import Node

        return {
            name: seen.timestamp()
            for name, seen in Node.objects.exclude(last_heartbeat_at=None).values_list("name", "last_heartbeat_at")
        }

    def forget(self, node: str) -> None:
        pass

    def bump(self, node: str) -> None:
        pass

    def mark_listener_alive(self, at: float) -> None:
        from .models import ControlPlaneClock

        ControlPlaneClock.objects.update_or_create(pk=1, defaults={"listener_alive_at": _aware(at)})

    def listener_alive_at(self) -> float | None:
        from .models import ControlPlaneClock

        clock = ControlPlaneClock.objects.filter(pk=1).first()
        return clock.listener_alive_at.timestamp() if clock and clock.listener_alive_at else None


def _aware(ts: float):
    return timezone.datetime.fromtimestamp(ts, tz=dt_timezone.utc)


@lru_cache(maxsize=1)
def store() -> RedisLiveness | DatabaseLiveness:
    if settings.LLMGW_REDIS_URL:
        return RedisLiveness(settings.LLMGW_REDIS_URL)
    return DatabaseLiveness()


def now() -> float:
    return time.time()
