"""Each gateway process's load per model, published for the autoscaler.

Every process writes one record (a field of one Redis hash; a file in the
data directory on the embedded default) at most every ``PUBLISH_EVERY``
seconds and whenever its counts change: per model, the requests it has in
flight, the requests it holds for a model that is starting, and when it last
saw a request. A record older than ``STALE_AFTER`` is of a process that has
gone. ``deployment_load`` sums the live ones: the signal is the whole
deployment's, not one process's view. It is ``replicas.hooks.load_providers``'
provider (gateway/apps.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import redis
from django.conf import settings

from replicas.autoscaling.selectors import autoscaled_hold_limits

logger = logging.getLogger(__name__)

HASH_KEY = "llmgw:autoscale:load"
STALE_AFTER = 3.0
FORGET_AFTER = 60.0
PUBLISH_EVERY = 0.5
POLICIES_EVERY = 1.0


class RedisLoad:
    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)

    def publish(self, name: str, record: dict) -> None:
        self.client.hset(HASH_KEY, name, json.dumps(record))

    def forget(self, name: str) -> None:
        self.client.hdel(HASH_KEY, name)

    def records(self) -> dict[str, dict]:
        out, gone = {}, []
        now = time.time()
        for name, raw in self.client.hgetall(HASH_KEY).items():
            try:
                record = json.loads(raw)
                at = float(record["at"])
            except (ValueError, KeyError, TypeError):
                gone.append(name)
                continue
            if now - at > FORGET_AFTER:
                gone.append(name)
            out[name.decode()] = record
        if gone:
            self.client.hdel(HASH_KEY, *gone)
        return out


class FileLoad:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def publish(self, name: str, record: dict) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        with os.fdopen(fd, "w") as handle:
            json.dump(record, handle)
        os.replace(tmp, self.directory / f"{name.replace('/', '_')}.json")

    def forget(self, name: str) -> None:
        (self.directory / f"{name.replace('/', '_')}.json").unlink(missing_ok=True)

    def records(self) -> dict[str, dict]:
        out = {}
        for path in self.directory.glob("*.json"):
            try:
                out[path.stem] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        return out


@lru_cache(maxsize=1)
def store() -> RedisLoad | FileLoad:
    if settings.LLMGW_REDIS_URL:
        return RedisLoad(settings.LLMGW_REDIS_URL)
    return FileLoad(Path(settings.DATA_DIR) / "autoscale" / "load")


def deployment_load() -> dict[str, tuple[int, int, float | None]]:
    """{model: (in flight, held, last request at)} summed over the live gateway processes."""
    now = time.time()
    total: dict[str, tuple[int, int, float | None]] = {}
    for record in store().records().values():
        if now - float(record.get("at", 0)) > STALE_AFTER:
            continue
        for model, (inflight, held, last) in record.get("models", {}).items():
            was = total.get(model, (0, 0, None))
            lasts = [x for x in (was[2], last) if x is not None]
            total[model] = (was[0] + int(inflight), was[1] + int(held), max(lasts) if lasts else None)
    return total


class LoadReport:
    """This process's side: counts kept on the event loop, published from the
    gateway's database thread (``sync``, called from the gateway's sync loop)."""

    def __init__(self) -> None:
        self.last_request: dict[str, float] = {}
        self._published: dict | None = None
        self._published_at = 0.0
        self._policies_at = 0.0

    def seen(self, model: str) -> None:
        self.last_request[model] = time.time()

    def counts(self, gw) -> dict[str, list]:
        models: dict[str, list] = {}
        for route in gw.table.routes.values():
            if route.inflight:
                models.setdefault(route.model, [0, 0, None])[0] += route.inflight
        for model, held in gw.holds.counts().items():
            models.setdefault(model, [0, 0, None])[1] += held
        # Requests waiting in the gateway's own queue (every replica at its batch limit) wait as an
        # engine's queue would: the autoscaler counts them with those held.
        for model, waiting in gw.queue.waiting().items():
            models.setdefault(model, [0, 0, None])[1] += waiting
        for model, at in self.last_request.items():
            models.setdefault(model, [0, 0, None])[2] = at
        return models

    def publish(self, name: str, models: dict[str, list]) -> None:
        """On the database thread: this process's record (counted on the event loop)."""
        store().publish(name, {"at": time.time(), "models": models})
        self._published, self._published_at = models, time.monotonic()

    async def sync(self, gw, loop: asyncio.AbstractEventLoop) -> None:
        now = time.monotonic()
        if now - self._policies_at >= POLICIES_EVERY:
            self._policies_at = now
            gw.holds.policies = await loop.run_in_executor(gw._db, autoscaled_hold_limits)
        models = self.counts(gw)
        if models != self._published or now - self._published_at >= PUBLISH_EVERY:
            await loop.run_in_executor(gw._db, self.publish, gw.name, models)

    def forget(self, gw) -> None:
        try:
            store().forget(gw.name)
        except (redis.RedisError, OSError) as exc:
            logger.warning("gateway could not remove its load record: %s", exc)
