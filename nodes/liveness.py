"""Where the control plane keeps "when did we last hear from each node".

A heartbeat arrives from every node every few seconds; writing each one to
PostgreSQL costs more CPU than the rest of the request (a ceiling near 870/s on
two cores). In production liveness lives in Redis: one hash of last-seen
times, one hash of per-node generations that services bump when a node's
status or desired state changes.

While Redis is away, heartbeats are still answered (from the database) and
their times kept in the feed, written when Redis is back; the agent API then
stops marking itself alive, so that the sweep knows it cannot hear anyone and
blames no node for it (``clock``).

Even one Redis round trip per heartbeat is a fifth of the agent API's CPU on
a loaded machine (about 0.2 ms of system calls), so the agent API's processes
keep a ``HeartbeatFeed``: heartbeats that bring no news are written behind,
a few times a second, in one command; and each bump is also published, so
the process learns at once which nodes' cached state went stale without
asking Redis on every heartbeat. Whenever the feed is not subscribed (start,
Redis restart), the heartbeat path falls back to one round trip per request.

The embedded default has no Redis: liveness is then the node row itself.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timezone as dt_timezone

import redis
from django.conf import settings
from django.utils import timezone

from core import outages

from .models import ControlPlaneClock, Node

logger = logging.getLogger(__name__)

SEEN_KEY = "llmgw:nodes:seen"
GENERATION_KEY = "llmgw:nodes:generation"
GENERATION_CHANNEL = "llmgw:nodes:generation"
LISTENER_KEY = "llmgw:agent-api:alive"
# How long a heartbeat that brought no news may wait to be written. The
# sweep's grace period is a minute; a fifth of a second changes nothing.
WRITE_BEHIND = 0.2


class HeartbeatFeed:
    """The agent API's side of Redis liveness, one per process.

    ``later`` keeps a heartbeat's time until the next write, a few times a
    second, of every pending one in one HSET. ``version`` is what the
    heartbeat cache compares: it changes when a bump for the node is
    published, and for every node when the subscription is (re)made, since
    bumps may have been missed while it was not.
    """

    def __init__(self, client) -> None:
        self.client = client
        self.live = False
        self.epoch = 0
        self._changes: dict[str, int] = {}
        self._pending: dict[str, float] = {}
        self._lock = threading.Lock()
        self.writes_failing = False

    def start(self) -> "HeartbeatFeed":
        threading.Thread(target=self._listen, name="liveness-feed", daemon=True).start()
        threading.Thread(target=self._write_behind, name="liveness-write", daemon=True).start()
        return self

    def version(self, node: str) -> tuple[int, int]:
        return (self.epoch, self._changes.get(node, 0))

    def later(self, node: str, at: float) -> None:
        with self._lock:
            self._pending[node] = at

    def drop(self, node: str) -> None:
        with self._lock:
            self._pending.pop(node, None)

    def _listen(self) -> None:
        failing = False
        while True:
            pubsub = self.client.pubsub()
            try:
                pubsub.subscribe(channel_scoped(self.client, GENERATION_CHANNEL))
                while True:
                    # get_message polls: a blocking read would hit the client's socket timeout.
                    message = pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    if message["type"] == "message":
                        for node in channel_nodes(message["data"]):
                            self._changes[node] = self._changes.get(node, 0) + 1
                    elif message["type"] == "subscribe":
                        # Every bump from now on is heard; any before may have been missed.
                        self.epoch += 1
                        self.live = True
                        if failing:
                            logger.info("liveness feed subscribed again")
                        failing = False
            except Exception as exc:  # noqa: BLE001 - keep listening whatever Redis does
                if not failing:
                    logger.warning("liveness feed lost Redis (%s); heartbeats ask Redis until it is back", exc)
                failing = True
            finally:
                self.live = False
                self.epoch += 1
                try:
                    pubsub.close()
                except Exception:  # noqa: BLE001
                    pass
            time.sleep(1.0)

    def _write_behind(self) -> None:
        failing = False
        while True:
            time.sleep(WRITE_BEHIND)
            with self._lock:
                batch, self._pending = self._pending, {}
            if not batch:
                if failing:
                    try:  # nothing to write, but the listener mark waits for us to know
                        self.client.ping()
                        failing = self.writes_failing = False
                    except Exception:  # noqa: BLE001
                        time.sleep(outages.TRY_EVERY)
                continue
            try:
                self.client.hset(SEEN_KEY, mapping={node: repr(at) for node, at in batch.items()})
                if failing:
                    logger.info("liveness writes reach Redis again (%d nodes' heartbeats written)", len(batch))
                failing = self.writes_failing = False
            except Exception as exc:  # noqa: BLE001 - keep what we heard and try again
                with self._lock:
                    for node, at in batch.items():
                        if self._pending.get(node, 0.0) < at:
                            self._pending[node] = at
                if not failing:
                    logger.warning("cannot write %d heartbeats to Redis: %s; retrying", len(batch), exc)
                    outages.dependency_failed(exc)
                failing = self.writes_failing = True


def channel_nodes(data: bytes) -> list[str]:
    """The node names a bump's message carries, one per line (a node name is
    a hostname: no line breaks)."""
    return data.decode().split("\n")


def channel_scoped(client: redis.Redis, channel: str) -> str:
    """Pub/sub channels are server-wide, not per database: a channel names
    its database, so that two deployments (or test runs) sharing one Redis
    server do not wake each other."""
    return f"{channel}:db{client.connection_pool.connection_kwargs.get('db', 0)}"


class RedisLiveness:
    caches_nodes = True

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self.feed: HeartbeatFeed | None = None

    def serve_heartbeats(self) -> None:
        """This process answers heartbeats (the agent API): start its feed."""
        if self.feed is None:
            self.feed = HeartbeatFeed(self.client).start()
            outages.database_watch_start()

    def touch(self, node: str, at: float) -> int:
        """Record a heartbeat; return the node's generation. One round trip."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(SEEN_KEY, node, repr(at))
        pipe.hget(GENERATION_KEY, node)
        _, generation = pipe.execute()
        return int(generation or 0)

    def heard(self, node: str, at: float):
        """Record a heartbeat that brought no news; return the node's cache
        version, or None if Redis is away (the time is kept for later)."""
        feed = self.feed
        if feed is not None and feed.live:
            feed.later(node, at)
            return feed.version(node)
        if feed is not None and not outages.redis_dependency.worth_trying():
            feed.later(node, at)
            return None
        try:
            return self.touch(node, at)
        except redis.RedisError as exc:
            return self._unreachable(exc, node, at)

    def version(self, node: str):
        """The node's cache version, recording nothing: read it before the
        database, so that a change made meanwhile invalidates what is cached.
        None if Redis is away: nothing cached can then be trusted."""
        feed = self.feed
        if feed is not None and feed.live:
            return feed.version(node)
        if feed is not None and not outages.redis_dependency.worth_trying():
            return None
        try:
            return int(self.client.hget(GENERATION_KEY, node) or 0)
        except redis.RedisError as exc:
            return self._unreachable(exc)

    def record(self, node: str, at: float) -> None:
        """Record a heartbeat now: it brought news, someone may look at once."""
        feed = self.feed
        if feed is not None:
            feed.drop(node)
            if not outages.redis_dependency.worth_trying():
                feed.later(node, at)
                return
        try:
            self.client.hset(SEEN_KEY, node, repr(at))
        except redis.RedisError as exc:
            self._unreachable(exc, node, at)

    def _unreachable(self, exc: redis.RedisError, node: str | None = None, at: float = 0.0) -> None:
        """In the agent API: keep the heartbeat's time for the feed to write
        when Redis is back. Elsewhere (no feed) the caller must know."""
        if self.feed is None:
            raise exc
        outages.dependency_failed(exc)
        if node is not None:
            self.feed.later(node, at)
        return None

    def seen(self, node: str) -> float | None:
        value = self.client.hget(SEEN_KEY, node)
        return float(value) if value else None

    def seen_all(self) -> dict[str, float]:
        return {k.decode(): float(v) for k, v in self.client.hgetall(SEEN_KEY).items()}

    def forget(self, node: str) -> None:
        if self.feed is not None:
            self.feed.drop(node)
        self.client.hdel(SEEN_KEY, node)

    def bump_many(self, nodes: list[str], *, channel: str) -> None:
        """Bump many generations and wake their long-polls, in one round trip:
        a message per channel names them all (``channel_nodes`` reads it)."""
        if not nodes:
            return
        pipe = self.client.pipeline(transaction=False)
        for node in nodes:
            pipe.hincrby(GENERATION_KEY, node, 1)
        names = "\n".join(nodes)
        pipe.publish(channel_scoped(self.client, GENERATION_CHANNEL), names)
        pipe.publish(channel_scoped(self.client, channel), names)
        pipe.execute()

    def mark_listener_alive(self, at: float) -> None:
        """Tell the sweep this agent API hears its nodes: not while the
        heartbeats it hears cannot be written."""
        feed = self.feed
        if feed is not None and feed.writes_failing:
            raise redis.ConnectionError("heartbeats cannot be written to Redis: not marking the agent API alive")
        try:
            self.client.set(LISTENER_KEY, repr(at), ex=3600)
        except redis.RedisError as exc:
            if feed is not None:
                outages.dependency_failed(exc)
            raise
        if feed is not None:
            outages.redis_dependency.recovered()

    def listener_alive_at(self) -> float | None:
        value = self.client.get(LISTENER_KEY)
        return float(value) if value else None


class DatabaseLiveness:
    """Embedded default: small clusters, one SQLite file, no cache to keep."""

    caches_nodes = False

    def serve_heartbeats(self) -> None:
        outages.database_watch_start()

    def touch(self, node: str, at: float) -> int:
        Node.objects.filter(name=node).update(last_heartbeat_at=_aware(at))
        return 0

    def heard(self, node: str, at: float) -> int:
        return self.touch(node, at)

    def version(self, node: str) -> int:
        return 0

    def record(self, node: str, at: float) -> None:
        self.touch(node, at)

    def seen(self, node: str) -> float | None:
        value = Node.objects.filter(name=node).values_list("last_heartbeat_at", flat=True).first()
        return value.timestamp() if value else None

    def seen_all(self) -> dict[str, float]:
        return {
            name: seen.timestamp()
            for name, seen in Node.objects.exclude(last_heartbeat_at=None).values_list("name", "last_heartbeat_at")
        }

    def forget(self, node: str) -> None:
        pass

    def bump_many(self, nodes: list[str], *, channel: str) -> None:
        pass

    def mark_listener_alive(self, at: float) -> None:
        ControlPlaneClock.objects.update_or_create(pk=1, defaults={"listener_alive_at": _aware(at)})

    def listener_alive_at(self) -> float | None:
        clock = ControlPlaneClock.objects.filter(pk=1).first()
        return clock.listener_alive_at.timestamp() if clock and clock.listener_alive_at else None


def _aware(ts: float):
    return timezone.datetime.fromtimestamp(ts, tz=dt_timezone.utc)


_store: RedisLiveness | DatabaseLiveness | None = None
_store_lock = threading.Lock()


def store() -> RedisLiveness | DatabaseLiveness:
    """The process's one liveness store.

    Made under a lock: threads of the agent API ask for it at once as the
    worker starts, and two stores would mean the heartbeat feed started on
    one while heartbeats used the other (functools.lru_cache lets two callers
    build a value each, and keeps the last).
    """
    global _store
    current = _store
    if current is None:
        with _store_lock:
            if _store is None:
                _store = RedisLiveness(settings.LLMGW_REDIS_URL) if settings.LLMGW_REDIS_URL else DatabaseLiveness()
            current = _store
    return current


def _store_clear() -> None:
    global _store
    with _store_lock:
        _store = None


store.cache_clear = _store_clear  # as with lru_cache: tests start each case with a new store


def now() -> float:
    return time.time()
